"""A device whose driver is gone (`Phase.ORPHANED`): it keeps its state and waits for a restarted one.

The members stopped after the step in flight (committed together while the
collectives still worked, or broken off when they failed too). Each device
writes the last committed step as before (so nothing is lost should no driver
come back, or the devices die meanwhile), says so once, and waits up to
`driver_grace_s` for a driver at the same address. A driver restarted with
`--resume` re-adopts it: the device reports what it holds (flexpar/core/adoption.py's
`DeviceReport`), and the restarted driver's first generation, numbered above
every one any device saw, holds it; `Worker.enter` then brings every member to
the latest committed step, in memory. Without one, it exits as before, naming
the checkpoint and the resume command. A device never trains while no driver
is there: it trains again only in a generation a driver published.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from flexpar.comm import waiting
from flexpar.comm.protocol import adopt_proof, get_json, join_proof
from flexpar.core import adoption
from flexpar.version import __version__
from flexpar.worker.device_link import DriverLost
from flexpar.worker.phase import Phase
from flexpar.worker.settings import RunSettings


class WorkerOrphan:
    """Part of `flexpar.worker.lifecycle.Worker` (its attributes are the worker's own; see there)."""

    def _orphaned(self, agreed: bool) -> tuple:
        """Wait for a restarted driver; returns the generation (number, record) it re-adopted this device into.

        Raises DriverLost (the process ends with exit code 4, or 0 when let go
        by SIGTERM) when none comes within the grace, or the one that answers
        does not re-adopt (started without --resume); Evicted when it refuses
        this device (a device of an older generation: fenced off).
        """
        self.phase = Phase.ORPHANED
        # A joiner still listening holds no committed state of its own: it reports none, writes no rescue.
        streamed = self._abandon_stream()
        abandoned = self._step_in_flight is not None
        self._step_in_flight = None
        # Sharded: a step whose summed gradient every member holds may still be finished (shard_levelling.py).
        self._zero_grad(keep_gradient=self.pending_commit is not None)
        seen = self.link.latest_generation
        lost_at = self.link.lost_at or time.time()
        holds = self.committed >= 0 and bool(self.members)
        # Faults aimed at the lost driver are spent: a re-adopted rank 0 must not fire them at the next,
        # nor the rescue checkpoint below at the lost one's pid.
        self.faults.spend_driver_faults(self.committed)
        # Written while the old group still stands (agreed: every member is there).
        path = self._write_rescue(agreed) if holds else ""
        self.reaper.retire(self.sync.release_works() + streamed)()
        grace = self.settings.driver_grace_s
        if grace <= 0:
            raise DriverLost(self._gone(path, "the job's driver is gone (its store stopped answering)"))
        address = self._address()
        if holds:
            self._say(
                f"the job's driver is gone; the last committed step, {self.committed}, is in {path}. Waiting up to "
                f"{grace:g} s for a driver at {address} to re-adopt this device; restart it with: "
                f"{self._resume_command()}"
            )
        else:
            self._say(
                f"the job's driver is gone; waiting up to {grace:g} s for a driver at {address} "
                "(this device holds no committed state yet)"
            )
        report = {"device_id": self.args.device_id, "address": address, "since": lost_at, "until": lost_at + grace}
        resume = self._resume_command() if holds else ""  # `flexpar status` repeats it during the gap
        waiting.write(self.args.port, dict(report, step=self.committed, generation=self.generation, resume=resume))
        try:
            return self._wait_for_a_driver(path, seen, lost_at, abandoned)
        finally:
            waiting.remove(self.args.port, self.args.device_id)

    def _wait_for_a_driver(self, path: str, seen: int, lost_at: float, abandoned: bool) -> tuple:
        while True:
            driver = self.link.await_driver()
            if driver is None:
                if self.link.leave_requested_at is not None:
                    why = "asked to stop (SIGTERM) while it waited for a driver"
                    raise DriverLost(self._gone(path, why), let_go=True)
                why = (
                    f"the job's driver is gone and none came back to {self._address()} within "
                    f"{self.settings.driver_grace_s:g} s"
                )
                raise DriverLost(self._gone(path, why))
            if not driver.get("adopting"):
                why = (
                    f"the job's driver is gone, and the driver now at {self._address()} was started without "
                    "--resume: it does not re-adopt this device"
                )
                raise DriverLost(self._gone(path, why))
            try:
                self.link.rejoin()
                salt = self.link.store.get("job/salt").decode()
                self.link.send("adopt", **self._report(seen, lost_at, abandoned, salt))
                # Joining: a late member is let in at a later boundary; a refused one is Evicted here.
                generation, record = self.link.wait_for_generation(seen, joining=True)
                settings = get_json(self.link.store, "job/settings")
            except (DriverLost, RuntimeError):
                continue  # that driver went again before it re-adopted this device: wait for the next
            self._take_driver(salt, settings)
            self._say(f"re-adopted by the restarted driver at {self._address()} (generation {generation})")
            return generation, record

    def _report(self, seen: int, lost_at: float, abandoned: bool, salt: str) -> dict:
        """What this device tells a restarted driver (core.adoption.DeviceReport's fields, and who it is)."""
        return {
            "generation": self.generation,
            "members": list(self.members),
            "seen": max(seen, self.generation),
            "committed": self.committed,
            "warm": self._warmup_s is not None,
            "lost_at": lost_at,
            "abandoned": abandoned,
            "proof": adopt_proof(self.args.secret, self.args.device_id, salt),
            "fingerprint": adoption.fingerprint(self.job, self.settings, __version__),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "remote": self.args.remote,
            "device": self.args.device,
            **self._identity(),
        }

    def _take_driver(self, salt: str, settings: dict) -> None:
        """The restarted driver's salt (proofs) and settings (checkpoints, timeouts, the eval verdict, the
        resume command); this device's own remaining faults stay."""
        self.salt = salt
        self.proof = join_proof(self.args.secret, self.args.device_id, salt)
        self.settings = dataclasses.replace(RunSettings(**settings), faults=self.settings.faults)
        self.faults.new_driver(self.settings.driver_pid)
        self.link.configure(self.settings.timeout_s, self.settings.driver_grace_s)

    def _gone(self, path: str, why: str) -> str:
        """The last line of a device whose driver did not come back: where the state is, how to resume."""
        if not path:
            text = f"{why}; this device held no committed state"
        else:
            text = (
                f"{why}; the last committed step, {self.committed}, is in {path}. Resume with: {self._resume_command()}"
            )
        self._say(text)
        return text

    def _address(self) -> str:
        return self.settings.address or f"{self.args.host}:{self.args.port}"
