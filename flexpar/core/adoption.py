"""Re-adopting devices that outlived their driver: the pure decision.

A restarted driver (`--resume`) opens an adoption window. Devices that were waiting for a
driver at its address reconnect and report (`DeviceReport`); a device still finishing the
step in flight first sends a notice (`final=False`), then its report. When the window
closes, `outcome` says whom to adopt, whom to refuse (fencing) and what stays a joiner.

No store, no clock, no processes: the coordinator (flexpar/driver/coordinator.py) turns
messages and the time into calls, and membership.decide (flexpar/core/membership/decide.py)
carries the outcome out. Fencing: a device of a generation older than the newest one a
live device reports was left out while it was away (evicted, counted dead, or it left); it
is refused, and the restarted job's generations number above every one any device saw.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

# How long a restarted driver waits for the members of the newest generation to report
# before it adopts those that did (or, if none did, resumes from the newest checkpoint).
# Waiting devices retry the address every 0.05-0.25 s (e6_reconnect.py: a device read the
# new store 0.13-0.20 s after it listened), so a live device is in within half a second;
# the window only runs out when a member died with the driver, or no device is left.
ADOPTION_WINDOW_S = 2.0
# A device seen waiting on the driver's own host (its report file names a live process, see
# flexpar/comm/waiting.py) is alive: the window waits for it past ADOPTION_WINDOW_S, up to this
# much longer. Under load (a full test suite on 2 cores) a live device's reconnect once took
# more than the 2 s, and the restarted driver replaced a device that was there.
LATE_WINDOW_S = 20.0


@dataclass(frozen=True)
class DeviceReport:
    """What a device that outlived its driver tells the restarted one.

    `generation`: the newest generation it formed and trained in (0: never a member, a
    joiner); `members`: that generation's members in rank order; `seen`: the newest
    generation number it saw published (one may have been published, not formed);
    `committed`: its last committed step (-1: none); `warm`: a joiner that finished its
    warm-up; `lost_at`: wall-clock seconds when it noticed the driver was gone;
    `abandoned`: it broke off a step in flight after `committed`; `final`: False for the
    notice of a device still finishing its step in flight (its step is not known yet).
    """

    device_id: str
    generation: int = 0
    members: tuple = ()
    seen: int = 0
    committed: int = -1
    warm: bool = False
    lost_at: float = 0.0
    abandoned: bool = False
    final: bool = True


@dataclass(frozen=True)
class Adoption:
    """The open window: its deadline (the coordinator's clock) and the latest report of each device.

    `checkpoint_step` / `checkpoint_path`: the newest checkpoint the restarted driver can see (-1 /
    "": none); it is read only if it holds a newer step than every device re-adopted.
    """

    deadline: float
    reports: tuple = ()
    checkpoint_step: int = -1
    checkpoint_path: str = ""
    expected: frozenset = frozenset()  # devices seen waiting on this host, alive: waited for past the deadline

    def by_device(self) -> dict:
        return {report.device_id: report for report in self.reports}


def add_report(adoption: Adoption, report: DeviceReport) -> Adoption:
    """The window with `report` as its device's latest; a final report is never replaced by a notice."""
    known = adoption.by_device().get(report.device_id)
    if known is not None and known.final and not report.final:
        return adoption
    others = tuple(r for r in adoption.reports if r.device_id != report.device_id)
    return dataclasses.replace(adoption, reports=others + (report,))


def newest_generation(reports) -> tuple:
    """(number, members) of the newest generation any reporting device trained in; (0, ()) if none."""
    members_of = [(r.generation, r.members) for r in reports if r.generation > 0]
    return max(members_of, default=(0, ()), key=lambda pair: pair[0])


def is_current(report: DeviceReport, generation: int, members: tuple) -> bool:
    """A member of the newest generation: adopted (never fenced)."""
    return generation > 0 and report.generation == generation and report.device_id in members


def is_stale(report: DeviceReport, generation: int, members: tuple) -> bool:
    """A device of an older generation: it trained in a generation older than the newest one a
    live device knows, or claims the newest without being in its member list. Its view of the
    membership is stale (it was left out while it was away: evicted, counted dead, or it left);
    it is refused, and what it holds is never used."""
    return report.generation > 0 and not is_current(report, generation, members)


def closeable(adoption: Adoption, dead: frozenset, now: float) -> bool:
    """Whether the window may close now.

    Never while a member of the newest generation that said it is there is still finishing its
    step (it holds the newest state); otherwise once every member of the newest generation
    reported (or died), or at the deadline; past the deadline, while a device seen waiting on this
    host (`expected`) has neither reported nor died, not before `LATE_WINDOW_S` more.
    """
    reports = adoption.by_device()
    generation, members = newest_generation(adoption.reports)
    unsettled = [d for d in members if d in reports and not reports[d].final and d not in dead]
    if unsettled:
        return False
    settled = {d for d, r in reports.items() if r.final} | set(dead)
    if generation > 0 and set(members) <= settled:
        return True
    if now < adoption.deadline:
        return False
    return not (adoption.expected - settled) or now >= adoption.deadline + LATE_WINDOW_S


def seen_waiting(adoption: Adoption, device_ids) -> Adoption:
    """The window with `device_ids` as the devices now seen waiting on this host (a device whose
    process ended drops out of the set: it is no longer waited for)."""
    return dataclasses.replace(adoption, expected=frozenset(device_ids))


@dataclass(frozen=True)
class Outcome:
    """What the window decided.

    `members`: adopted, in their old rank order (empty: nothing to adopt, the job resumes from
    its checkpoint); `not_back`: members of the newest generation that never reported (died with
    the driver, or since); `stale`: devices of an older generation (refused); `warm_joiners` /
    `cold_joiners`: joiners that finished / had not finished their warm-up (a member of the newest
    generation that holds no committed step, a joiner still listening to a streamed join, is a
    warm joiner: it comes back as the joiner it is, never as the job's state); `from_generation`:
    the newest generation; `next_generation`: the number the adopted set forms under, above every
    number any device saw; `step`: the latest committed step among the adopted; `lost_at`: the
    first device's notice of the loss; `steps_lost`: 1 when a device holding that step broke off
    the step after it (the step in flight was lost), else 0.
    """

    members: tuple
    not_back: tuple
    stale: tuple
    warm_joiners: tuple
    cold_joiners: tuple
    from_generation: int
    next_generation: int
    step: int
    lost_at: float
    steps_lost: int


def outcome(adoption: Adoption, dead: frozenset = frozenset()) -> Outcome:
    reports = {d: r for d, r in adoption.by_device().items() if d not in dead}
    generation, members = newest_generation(adoption.reports)
    current = {d for d, r in reports.items() if r.final and is_current(r, generation, members)}
    # A member that holds no committed step (a joiner still listening to a streamed join,
    # flexpar/worker/streaming.py) comes back as the warm joiner it is: it holds nothing to adopt.
    listeners = [d for d in members if d in current and reports[d].committed < 0]
    adopted = tuple(d for d in members if d in current and d not in listeners)
    stale = tuple(sorted(d for d, r in reports.items() if is_stale(r, generation, members)))
    joiners = [r for r in adoption.reports if r.generation == 0 and r.device_id in reports]
    latest = max((reports[d].committed for d in adopted), default=-1)
    seen = max((max(r.seen, r.generation) for r in adoption.reports), default=0)
    return Outcome(
        members=adopted,
        not_back=tuple(d for d in members if d not in current),
        stale=stale,
        warm_joiners=tuple(r.device_id for r in joiners if r.warm) + tuple(listeners),
        cold_joiners=tuple(r.device_id for r in joiners if not r.warm),
        from_generation=generation,
        next_generation=seen + 1,
        step=latest,
        lost_at=min((reports[d].lost_at for d in adopted), default=0.0),
        steps_lost=int(any(reports[d].abandoned and reports[d].committed == latest for d in adopted)),
    )


@dataclass(frozen=True)
class Adopted:
    """What the first generation of a re-adopted job records (`Publish.adopted`): the generation it
    was re-adopted from, the latest committed step the adopted devices hold, when the first of them
    noticed the driver was gone (wall clock), the steps in flight lost (0 or 1), and the members of
    that generation that did not come back."""

    from_generation: int
    step: int
    lost_at: float
    steps_lost: int
    not_back: tuple = ()


def local_index(device_id: str) -> int:
    """N of 'local-N' (this host's devices), else -1."""
    name, _, number = device_id.rpartition("-")
    return int(number) if name == "local" and number.isdigit() else -1


def ids_in(adoption: Adoption) -> set:
    """Every device id the reports name: the reporters and the members of their generations."""
    return {r.device_id for r in adoption.reports} | {d for r in adoption.reports for d in r.members}


def late_report_verdict(report: DeviceReport, adopted_from: int, known: bool) -> Optional[str]:
    """A report after the window closed: None (admit it as a joiner) or why it is refused.

    `adopted_from`: the generation the adoption started from (0: nothing was adopted and the
    job resumed from its checkpoint); `known`: the device id is already in the job.
    """
    if known:
        return "a device of this id is already in the job"
    if adopted_from == 0:
        return "the restarted driver found no device to re-adopt and resumed from the newest checkpoint: join it again"
    if report.generation > adopted_from:
        return f"it reports generation {report.generation}, newer than the {adopted_from} the job was re-adopted from"
    if 0 < report.generation < adopted_from:
        return (
            f"it belongs to generation {report.generation}, older than the {adopted_from} the job was "
            "re-adopted from: it was left out while it was away, and what it holds is not used"
        )
    return None


# ------------------------------------------------------------ job identity

# The Job's plain settings a re-adopted device must share with the restarted driver: they shape the
# data order, the VWs, the recipes and the collectives (its pieces themselves are code).
_JOB_FIELDS = (
    "global_batch",
    "virtual_workers",
    "micro_batch",
    "seed",
    "num_workers",
    "eval_batch",
    "mixed_precision",
    "max_grad_norm",
    "compile",
)
_JOB_PIECES = ("lr_scheduler", "collate_fn", "evaluate", "eval_dataset", "sample_cost")
# The run's settings that every member must share: the loader's length, the collectives' layout.
_SETTINGS_FIELDS = ("total_steps", "backend", "bucket_mb", "sample_ledger")


def fingerprint(job, settings, version: str) -> dict:
    """What makes a running device part of this job, in plain values (compared key by key).

    The model's digest and the frozen-weights checks travel in the report's `ready` fields and are
    checked by the coordinator as for a joiner; this covers the rest of the job: its plain fields,
    which optional pieces it has, its dataset's size, and the run settings the collectives depend on.
    """
    sized = hasattr(job.dataset, "__getitem__") and hasattr(job.dataset, "__len__")
    try:
        size = len(job.dataset) if sized else "stream"
    except TypeError:  # a torch IterableDataset (its __getitem__ is Dataset's) without a length
        size = "stream"
    values = {"version": version, "dataset_size": size}
    values.update({name: _plain(getattr(job, name, None)) for name in _JOB_FIELDS})
    values.update({f"has_{name}": getattr(job, name, None) is not None for name in _JOB_PIECES})
    values.update({name: _plain(getattr(settings, name)) for name in _SETTINGS_FIELDS})
    return values


def _plain(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def fingerprint_problem(ours: dict, theirs: dict) -> str:
    """Why a device of `theirs` cannot be re-adopted by a driver of `ours` ("" when it can)."""
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return (
                f"it runs another job: {key} is {theirs.get(key)!r} there and {ours.get(key)!r} here; "
                "restart the driver with the job's own command (its resume command)"
            )
    return ""
