"""What the balancer remembers between steps (`BalanceState`), and its plain-dict form.

The state travels with the training state (to joiners and into checkpoints)
as ``state_to_dict``'s plain types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, Mapping, Sequence, Tuple

from flexpar.core.balance.checks import assignment_tuple, checked_count, device_id_tuple, finite_seconds, usable_seconds

_STATE_KEYS = ("seconds_per_vw", "device_ids", "assignment")
_OPTIONAL_STATE_KEYS = ("recent", "steady")


@dataclass(frozen=True)
class BalanceState:
    """What the balancer remembers between steps. Immutable; replaced, not edited.

    ``seconds_per_vw`` holds the smoothed compute seconds per VW of every device
    ever observed (device ids are never reused within a job, so entries of
    departed devices are harmless; they are kept so that a state stays valid
    whatever device set asks about it). It is stored as a read-only mapping in
    sorted key order; values below ``MINIMUM_SECONDS_PER_VW`` are stored as the
    minimum. ``device_ids`` and ``assignment`` are the device set and
    assignment of the last step, aligned by rank; both empty before the first.

    ``recent`` holds each observed device's last ``NOISE_WINDOW`` raw per-VW
    times, oldest first: its noise is measured on them. ``steady`` says how
    many of the newest of them were taken since the device's speed last
    changed (a device missing there counts all of them). Both are empty in a
    state built by hand from smoothed times, which then count as noise-free.
    """

    seconds_per_vw: Mapping[str, float] = field(default_factory=dict)
    device_ids: Tuple[str, ...] = ()
    assignment: Tuple[int, ...] = ()
    recent: Mapping[str, Tuple[float, ...]] = field(default_factory=dict)
    steady: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seconds: Dict[str, float] = {}
        for device_id in sorted(device_id_tuple(list(self.seconds_per_vw), "seconds_per_vw keys")):
            value = finite_seconds(self.seconds_per_vw[device_id], f"seconds_per_vw[{device_id!r}]")
            seconds[device_id] = usable_seconds(value)
        device_ids = device_id_tuple(self.device_ids, "device_ids")
        assignment = assignment_tuple(self.assignment, "assignment", minimum=1)
        if len(assignment) != len(device_ids):
            raise ValueError(
                f"assignment has {len(assignment)} entries but device_ids has {len(device_ids)}; "
                "they must be aligned by rank"
            )
        recent = {}
        for device_id in sorted(device_id_tuple(list(self.recent), "recent keys")):
            values = self.recent[device_id]
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise ValueError(f"recent[{device_id!r}]={values!r} must be a sequence of seconds")
            recent[device_id] = tuple(
                usable_seconds(finite_seconds(value, f"recent[{device_id!r}][{index}]"))
                for index, value in enumerate(values)
            )
        steady = {
            device_id: checked_count(self.steady[device_id], f"steady[{device_id!r}]", minimum=0)
            for device_id in sorted(device_id_tuple(list(self.steady), "steady keys"))
        }
        # Frozen: the normalised values go in through object.__setattr__.
        object.__setattr__(self, "seconds_per_vw", MappingProxyType(seconds))
        object.__setattr__(self, "device_ids", device_ids)
        object.__setattr__(self, "assignment", assignment)
        object.__setattr__(self, "recent", MappingProxyType(recent))
        object.__setattr__(self, "steady", MappingProxyType(steady))

    @classmethod
    def _trusted(cls, seconds_per_vw, device_ids, assignment, recent, steady) -> "BalanceState":
        """A state from values that are already checked (``observe``'s): no second validation.

        Checking every kept raw time again would cost most of ``observe`` at
        a thousand devices. The mappings are stored in sorted key order, as
        ``__post_init__`` stores them.
        """
        state = object.__new__(cls)
        for name, mapping in (("seconds_per_vw", seconds_per_vw), ("recent", recent), ("steady", steady)):
            object.__setattr__(state, name, MappingProxyType({key: mapping[key] for key in sorted(mapping)}))
        object.__setattr__(state, "device_ids", device_ids)
        object.__setattr__(state, "assignment", assignment)
        return state

    def __reduce__(self):
        # A mapping proxy cannot be pickled; go through the plain-dict form so
        # that a state can be pickled and deep-copied like any value.
        return (state_from_dict, (state_to_dict(self),))


def state_to_dict(state: BalanceState) -> dict:
    """The state as plain JSON-ready types (dict, list, str, int, float).

    Keys of the mappings come out sorted, so equal states give equal dicts
    and equal JSON text.
    """
    return {
        "seconds_per_vw": dict(state.seconds_per_vw),
        "device_ids": list(state.device_ids),
        "assignment": list(state.assignment),
        "recent": {device_id: list(values) for device_id, values in state.recent.items()},
        "steady": dict(state.steady),
    }


def state_from_dict(data: Mapping[str, Any]) -> BalanceState:
    """Inverse of ``state_to_dict``; ValueError naming a missing or unknown key.

    ``recent`` and ``steady`` may be missing (a state saved by an older
    flexpar): they then start empty, and fill within a few steps.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"a balance state must be a mapping, not {type(data).__name__}")
    missing = [key for key in _STATE_KEYS if key not in data]
    if missing:
        raise ValueError(f"balance state lacks the key(s) {missing}; it needs {list(_STATE_KEYS)}")
    allowed = _STATE_KEYS + _OPTIONAL_STATE_KEYS
    unknown = sorted(str(key) for key in data if key not in allowed)
    if unknown:
        raise ValueError(f"balance state has unknown key(s) {unknown}; it takes only {list(allowed)}")
    for key in ("seconds_per_vw",) + _OPTIONAL_STATE_KEYS:
        if not isinstance(data.get(key, {}), Mapping):
            raise ValueError(f"{key} must be a mapping keyed by device id, not {type(data[key]).__name__}")
    return BalanceState(
        seconds_per_vw=dict(data["seconds_per_vw"]),
        device_ids=tuple(data["device_ids"]),
        assignment=tuple(data["assignment"]),
        recent=dict(data.get("recent", {})),
        steady=dict(data.get("steady", {})),
    )
