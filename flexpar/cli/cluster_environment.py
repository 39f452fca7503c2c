"""Where a job is and its secret, from the command line or the cluster's environment.

`flexpar join | scale | status` find the job at the address given, else at
the one the cluster's environment names (`cluster_address`: FLEXPAR_ADDRESS,
MASTER_ADDR/MASTER_PORT, PET_RDZV_ENDPOINT); `flexpar run` in a cluster
listens where it says (`listen_address`). The secret comes from
--secret-file, FLEXPAR_SECRET or FLEXPAR_SECRET_FILE (`read_secret`).
"""

from __future__ import annotations

import os
from typing import Optional

from flexpar import options as options_module


def read_secret(secret_file: Optional[str]) -> Optional[str]:
    """The job's secret: --secret-file, else FLEXPAR_SECRET, else the file FLEXPAR_SECRET_FILE names.

    The file form is how a Kubernetes Secret is mounted; the value form how a
    shell or a scheduler passes it. None when none is given.
    """
    path = _secret_path(secret_file)
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                secret = handle.read().strip()
        except OSError as error:
            raise ValueError(f"cannot read the secret file {path}: {error.strerror}") from None
        if not secret:
            raise ValueError(f"the secret file {path} is empty")
        return secret
    return os.environ.get("FLEXPAR_SECRET") or None


def _secret_path(secret_file: Optional[str]) -> Optional[str]:
    return secret_file or (None if os.environ.get("FLEXPAR_SECRET") else os.environ.get("FLEXPAR_SECRET_FILE"))


def secret_origin(secret_file: Optional[str]) -> str:
    """Where `read_secret` found the secret, in words for a message: the file, or FLEXPAR_SECRET."""
    path = _secret_path(secret_file)
    if path is None:
        return "the secret in FLEXPAR_SECRET"
    return f"the secret in {path}" + ("" if secret_file else " (FLEXPAR_SECRET_FILE)")


ADDRESS_VARIABLES = ("FLEXPAR_ADDRESS", "MASTER_ADDR/MASTER_PORT", "PET_RDZV_ENDPOINT")


def cluster_address(environment=None) -> Optional[tuple]:
    """(HOST:PORT, the variable it came from) from the cluster's environment, or None.

    First match wins: FLEXPAR_ADDRESS (HOST:PORT); MASTER_ADDR with
    MASTER_PORT (torchrun, Kubeflow PyTorchJob, SLURM recipes); PET_RDZV_ENDPOINT
    (HOST:PORT, Kubeflow TrainJob / torchrun's rendezvous endpoint).
    """
    environment = os.environ if environment is None else environment
    if environment.get("FLEXPAR_ADDRESS"):
        return environment["FLEXPAR_ADDRESS"], "FLEXPAR_ADDRESS"
    if environment.get("MASTER_ADDR") and environment.get("MASTER_PORT"):
        port = environment["MASTER_PORT"].strip()
        if not port.isdigit():
            # Kubernetes' service links set <SERVICE>_PORT=tcp://IP:PORT, so a Service named
            # "master" yields MASTER_PORT=tcp://...: not a port, and never to be guessed at.
            raise SystemExit(
                f"flexpar: MASTER_PORT={port!r} is not a port number (a Kubernetes Service "
                "named 'master' sets it so: set enableServiceLinks: false in the pod spec, "
                "or give the address with FLEXPAR_ADDRESS=HOST:PORT)"
            )
        return f"{environment['MASTER_ADDR'].strip()}:{port}", "MASTER_ADDR/MASTER_PORT"
    if environment.get("PET_RDZV_ENDPOINT"):
        return environment["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT"
    return None


def job_address(given: Optional[str], command: str) -> tuple:
    """(host, port) of the job: the argument, else the environment; SystemExit naming both if neither."""
    if given:
        return parse_address(given)
    found = cluster_address()
    if found is None:
        raise SystemExit(
            f"flexpar {command}: give the job's address HOST:PORT (the job prints it), or set "
            f"one of {', '.join(ADDRESS_VARIABLES)}"
        )
    address, variable = found
    return parse_address(address, variable)


def listen_address(arguments) -> None:
    """`flexpar run` in a cluster: the port (and, off loopback, all interfaces) from the environment."""
    found = cluster_address()
    if found is None or (arguments.port is not None and arguments.host is not None):
        return
    host, port = parse_address(*found)
    if arguments.port is None:
        arguments.port = port
    if arguments.host is None:
        # The advertised name (a Service, a node name) is reached from other hosts:
        # listen on every interface, unless it is this host's loopback.
        arguments.host = host if options_module.is_loopback(host) else "0.0.0.0"


def parse_address(address: str, source: str = "") -> tuple:
    host, _, port = address.strip().rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")  # [IPv6]:PORT
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host or (":" in host and not bracketed):
        where = f" (from {source})" if source else ""
        raise SystemExit(f"flexpar: address {address!r}{where} is not HOST:PORT (the job prints it at start)")
    return host.strip("[]"), int(port)


def secret_or_exit(arguments, command: str) -> str:
    secret = read_secret(arguments.secret_file)
    if not secret:
        raise SystemExit(
            f"flexpar {command}: give the job's secret with --secret-file FILE, FLEXPAR_SECRET or "
            "FLEXPAR_SECRET_FILE (a job on loopback keeps it in its run directory, file 'secret')"
        )
    return secret
