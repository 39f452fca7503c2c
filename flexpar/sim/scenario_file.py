"""Reading a scenario (scenario.py) from TOML: the file format and its validation.

A scenario file is validated field by field; any mistake is a ``ValueError``
that names the field as a path from the file's root and says what was expected,
e.g. ``scenario.devices[2].speed: expected a positive number, got -1``. Unknown
keys are errors too (a misspelt key silently falling back to a default would
make a simulation quietly wrong). The full format is in docs/simulator.md;
in short::

    name = "mixed"                      # root keys: the run
    steps = 2000
    virtual_workers = 96
    seed = 0
    noise = 0.03                        # lognormal sigma of per-step compute noise
    policies = ["flexpar", "uniform", "restart"]

    [model]                             # WorkloadModel + reference_seconds_per_vw
    [network]                           # NetworkModel
    [elastic]                           # ElasticCosts
    [restart]                           # RestartCosts
    [join]                              # JoinModel: mode, link_bytes_per_s, joiner_shares_cores...
    [balance]                           # BalanceSettings
    [device_types.A100]                 # speed = 2.5 (relative) or seconds_per_vw = 0.04
    [[devices]]                         # type = "A100", count = 8, id_prefix = "a100"
    [[events]]                          # at_s = 3600 or at_step = 100; kind = "join", ids = [...]
    [scalability]                       # ScalabilitySpec
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import tomllib

from flexpar.core import join_choice

from .parameters import JOIN_MODES, ElasticCosts, JoinModel, ModelParameters, NetworkModel, RestartCosts, WorkloadModel
from .policies import POLICY_NAMES, BalanceSettings
from .scenario import DEFAULT_DEVICE_COUNTS, EVENT_KINDS, DeviceSpec, Event, ScalabilitySpec, Scenario
from .toml_fields import TableFields, config_values, describe

# --------------------------------------------------------------------------
# the parts of a scenario
# --------------------------------------------------------------------------


def _parse_parameters(root: TableFields) -> Tuple[ModelParameters, Optional[float]]:
    """The four cost tables; also returns ``model.reference_seconds_per_vw`` (or None)."""
    model = root.sub_table("model")
    reference = model.number("reference_seconds_per_vw", None, positive=True)
    workload_values = config_values(WorkloadModel, model, integers=("samples_per_vw",))
    model.finish()

    network = root.sub_table("network")
    network_values = config_values(
        NetworkModel,
        network,
        fractions=("overlap_fraction", "backward_fraction"),
        positives=("bandwidth_bytes_per_s", "broadcast_bandwidth_bytes_per_s", "bucket_bytes"),
    )
    network.finish()

    elastic = root.sub_table("elastic")
    elastic_values = config_values(ElasticCosts, elastic, positives=("host_cores",))
    elastic.finish()

    restart = root.sub_table("restart")
    restart_values = config_values(RestartCosts, restart, integers=("checkpoint_every_steps",))
    restart.finish()

    elastic_costs = ElasticCosts(**elastic_values)
    parameters = ModelParameters(
        network=NetworkModel(**network_values),
        workload=WorkloadModel(**workload_values),
        elastic=elastic_costs,
        restart=RestartCosts(**restart_values),
        join=_parse_join(root, elastic_costs),
    )
    return parameters, reference


def _tensor_pairs(reader: TableFields) -> tuple:
    """``[join] tensors``: the streamed state's tensors, ``[elements, bytes_per_element]`` each."""
    tensors = reader.table.get("tensors", [])
    reader.used.add("tensors")
    if not isinstance(tensors, list) or not all(
        isinstance(pair, list)
        and len(pair) == 2
        and all(isinstance(value, int) and not isinstance(value, bool) for value in pair)
        and pair[0] >= 0
        and pair[1] >= 1
        for pair in tensors
    ):
        raise ValueError(
            f"{reader.path}.tensors: expected a list of [elements, bytes_per_element] integer pairs (elements >= 0, "
            f"bytes >= 1), got {describe(tensors)}"
        )
    return tuple((elements, size) for elements, size in tensors)


def _parse_join(root: TableFields, elastic: ElasticCosts) -> JoinModel:
    """``[join]``: how joins come in (parameters.JoinModel)."""
    reader = root.sub_table("join")
    mode = reader.string("mode", "auto")
    if mode not in JOIN_MODES:
        raise ValueError(f"{reader.path}.mode: expected one of {list(JOIN_MODES)}, got {mode!r}")
    shares = reader.table.get("joiner_shares_cores", False)
    reader.used.add("joiner_shares_cores")
    if not isinstance(shares, bool):
        raise ValueError(f"{reader.path}.joiner_shares_cores: expected true or false, got {describe(shares)}")
    if shares and elastic.host_cores is None:
        raise ValueError(f"{reader.path}.joiner_shares_cores: needs elastic.host_cores (the cores it shares)")
    join = JoinModel(
        mode=mode,
        link_bytes_per_s=reader.number("link_bytes_per_s", None, positive=True),
        joiner_shares_cores=shares,
        small_state_bytes=reader.number("small_state_bytes", 0.0, minimum=0.0),
        stream_share=reader.number("stream_share", 0.1, positive=True),
        slice_link_bytes_per_s=reader.number("slice_link_bytes_per_s", 1e9, positive=True),
        max_first_vw_s=reader.number("max_first_vw_s", join_choice.MAX_FIRST_VW_S, positive=True),
        listener_work=reader.number("listener_work", join_choice.LISTENER_WORK, positive=True),
        baseline_ratio=reader.number("baseline_ratio", 1.0, positive=True),
        step_noise=reader.number("step_noise", None, minimum=0.0),
        tensors=_tensor_pairs(reader),
    )
    reader.finish()
    return join


def _seconds_per_vw(
    reader: TableFields,
    reference: Optional[float],
    device_types: Mapping[str, Tuple[float, str]],
    allow_type: bool = True,
) -> Tuple[float, str]:
    """A device's seconds per VW from exactly one of ``type``, ``speed`` or ``seconds_per_vw``."""
    given = [key for key in ("type", "speed", "seconds_per_vw") if reader.has(key) and (allow_type or key != "type")]
    choices = "type, speed or seconds_per_vw" if allow_type else "speed or seconds_per_vw"
    if len(given) != 1:
        raise ValueError(f"{reader.path}: expected exactly one of {choices}, got {given or 'none'}")
    if given[0] == "type":
        name = reader.string("type")
        if name not in device_types:
            raise ValueError(
                f"{reader.path}.type: expected one of the device_types {sorted(device_types)}, got {name!r}"
            )
        return device_types[name][0], name
    if given[0] == "speed":
        speed = reader.number("speed", positive=True)
        if reference is None:
            raise ValueError(
                f"{reader.path}.speed: a relative speed needs model.reference_seconds_per_vw "
                "(seconds per VW at speed 1.0)"
            )
        return reference / speed, f"speed {speed:g}"
    seconds = reader.number("seconds_per_vw", positive=True)
    return seconds, f"{seconds:g} s/VW"


def _parse_device_types(root: TableFields, reference: Optional[float]) -> Dict[str, Tuple[float, str]]:
    types = root.sub_table("device_types")
    result: Dict[str, Tuple[float, str]] = {}
    for name in list(types.table):
        reader = types.sub_table(name)
        seconds, _ = _seconds_per_vw(reader, reference, {}, allow_type=False)
        reader.finish()
        result[name] = (seconds, name)
    types.finish()
    return result


def _parse_devices(
    root: TableFields, reference: Optional[float], device_types: Mapping[str, Tuple[float, str]]
) -> Tuple[DeviceSpec, ...]:
    devices: List[DeviceSpec] = []
    seen: Dict[str, str] = {}
    readers = root.array_of_tables("devices")
    if not readers:
        raise ValueError("scenario.devices: expected at least one [[devices]] entry")
    for reader in readers:
        seconds, kind = _seconds_per_vw(reader, reference, device_types)
        count = reader.integer("count", 1, minimum=1)
        # kind is the type's name when the entry names a type.
        default_prefix = kind.lower() if kind in device_types else "device"
        prefix = reader.string("id_prefix", default_prefix)
        reader.finish()
        for index in range(count):
            device_id = f"{prefix}-{index}"
            if device_id in seen:
                raise ValueError(
                    f"{reader.path}.id_prefix: device id {device_id!r} is already used by {seen[device_id]}; "
                    "give each [[devices]] entry its own id_prefix"
                )
            seen[device_id] = reader.path
            devices.append(DeviceSpec(device_id, seconds, kind))
    return tuple(devices)


def _parse_events(
    root: TableFields,
    reference: Optional[float],
    device_types: Mapping[str, Tuple[float, str]],
    initial_ids: Tuple[str, ...],
) -> Tuple[Event, ...]:
    events: List[Event] = []
    known = set(initial_ids)
    joined: Dict[str, str] = {}
    readers = root.array_of_tables("events")
    # Joins first, so that a leave may name a device whose join comes later in the file.
    for reader in readers:
        if reader.table.get("kind") == "join":
            for index, device_id in enumerate(reader.string_list("ids")):
                if device_id in known or device_id in joined:
                    raise ValueError(
                        f"{reader.path}.ids[{index}]: device id {device_id!r} is already in use; "
                        "a joining device needs a new id (ids are never reused)"
                    )
                joined[device_id] = reader.path
    for reader in readers:
        kind = reader.string("kind")
        if kind not in EVENT_KINDS:
            raise ValueError(f"{reader.path}.kind: expected one of {list(EVENT_KINDS)}, got {kind!r}")
        if reader.has("at_s") == reader.has("at_step"):
            raise ValueError(f"{reader.path}: expected exactly one of at_s (seconds) and at_step (step index)")
        at_s = reader.number("at_s", None, minimum=0.0)
        at_step = reader.integer("at_step", None, minimum=0)
        ids = reader.string_list("ids")
        devices: Tuple[DeviceSpec, ...] = ()
        factor = 1.0
        if kind == "join":
            seconds, device_kind = _seconds_per_vw(reader, reference, device_types)
            devices = tuple(DeviceSpec(device_id, seconds, device_kind) for device_id in ids)
        else:
            for index, device_id in enumerate(ids):
                if device_id not in known and device_id not in joined:
                    raise ValueError(
                        f"{reader.path}.ids[{index}]: expected an initial or joining device id, got {device_id!r}"
                    )
            if kind == "slowdown":
                factor = reader.number("factor", positive=True)
        reader.finish()
        events.append(Event(kind, ids, at_s=at_s, at_step=at_step, devices=devices, factor=factor))
    return tuple(events)


def _parse_scalability(root: TableFields, default_steps: int, default_seed: int) -> ScalabilitySpec:
    reader = root.sub_table("scalability")
    spec = ScalabilitySpec(
        device_counts=reader.integer_list("device_counts", DEFAULT_DEVICE_COUNTS, minimum=1),
        virtual_workers_per_device=reader.integer("virtual_workers_per_device", 4, minimum=1),
        steps=reader.integer("steps", min(default_steps, 1000), minimum=1),
        noise=reader.number("noise", 0.0, minimum=0.0, maximum=1.0),
        failures_per_device_hour=reader.number("failures_per_device_hour", 0.0, minimum=0.0),
        replacement_s=reader.number("replacement_s", 600.0, minimum=0.0),
        seed=reader.integer("seed", default_seed, minimum=0),
    )
    reader.finish()
    return spec


def _parse_balance(root: TableFields) -> BalanceSettings:
    reader = root.sub_table("balance")
    settings = BalanceSettings(
        smoothing=reader.number("smoothing", 0.5, minimum=0.0, maximum=1.0),
        hysteresis=reader.number("hysteresis", 0.05, minimum=0.0, maximum=1.0),
        interval_steps=reader.integer("interval_steps", 1, minimum=1),
    )
    reader.finish()
    return settings


def parse_scenario(data: Mapping[str, Any], source: str = "") -> Scenario:
    """A validated ``Scenario`` from the parsed TOML mapping; ValueError naming the field."""
    root = TableFields(dict(data), "scenario")
    name = root.string("name", Path(source).stem if source else "scenario")
    description = root.table.get("description", "")
    root.used.add("description")
    if not isinstance(description, str):
        raise ValueError(f"scenario.description: expected a string, got {describe(description)}")
    steps = root.integer("steps", minimum=1)
    virtual_workers = root.integer("virtual_workers", minimum=1)
    seed = root.integer("seed", 0, minimum=0)
    noise = root.number("noise", 0.0, minimum=0.0, maximum=1.0)
    policies = root.string_list("policies", POLICY_NAMES)
    for index, policy in enumerate(policies):
        if policy not in POLICY_NAMES:
            raise ValueError(f"scenario.policies[{index}]: expected one of {list(POLICY_NAMES)}, got {policy!r}")

    parameters, reference = _parse_parameters(root)
    balance_settings = _parse_balance(root)
    device_types = _parse_device_types(root, reference)
    devices = _parse_devices(root, reference, device_types)
    if virtual_workers < len(devices):
        raise ValueError(
            f"scenario.virtual_workers: expected an integer >= {len(devices)} (one VW per initial device), "
            f"got {virtual_workers}"
        )
    events = _parse_events(root, reference, device_types, tuple(device.device_id for device in devices))
    scalability = _parse_scalability(root, steps, seed)
    root.finish()
    return Scenario(
        name=name,
        steps=steps,
        virtual_workers=virtual_workers,
        devices=devices,
        events=events,
        parameters=parameters,
        balance=balance_settings,
        policies=policies,
        seed=seed,
        noise=noise,
        description=description,
        scalability=scalability,
        source=source,
    )


def shipped_scenarios() -> Dict[str, Path]:
    """The scenario files that ship with flexpar, by name (file stem)."""
    folder = Path(__file__).with_name("scenarios")
    return {path.stem: path for path in sorted(folder.glob("*.toml"))}


def resolve_scenario_path(scenario: str) -> Path:
    """``scenario`` as a path, or the name of a shipped scenario (``mixed_cluster``)."""
    path = Path(scenario)
    if path.exists():
        return path
    shipped = shipped_scenarios()
    stem = path.stem if path.suffix == ".toml" else str(scenario)
    if stem in shipped and path.parent == Path("."):
        return shipped[stem]
    raise ValueError(f"scenario file {str(scenario)!r} does not exist (shipped scenarios: {sorted(shipped)})")


def load_scenario(scenario: str) -> Scenario:
    """Read and validate a scenario file (a path, or a shipped scenario's name)."""
    path = resolve_scenario_path(str(scenario))
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    return parse_scenario(data, source=str(path))
