"""The probe: the costs the benchmarks do not measure apart, in fresh gloo processes.

All-reduce and optimizer step of balance.py's job, a boundary without a state
transfer (after a training step of elastic.py's job, as in a job) for groups
of 2 .. world processes, and how long a peer killed with SIGKILL during an
all-reduce takes to surface in the survivors.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Callable, Mapping, Sequence

import elastic_plan
from harness import free_port, median, median_of, progress, slowest_rank, started

_progress = progress("sim_validation")

# A boundary takes a few milliseconds: the probe forms each group size this many
# times (a median over 10 moved by a third from one run to the next). Each
# repeat follows a training step of elastic.py's job (about 0.4 s with the
# 25M-parameter model on shared cores), so 20 rather than the 40 of
# back-to-back boundaries: a probe run takes about 30 s.
BOUNDARY_REPEATS = 20
# The probe's 2-process boundary also moves between runs in fresh processes
# (3.1 to 4.8 ms over five runs on the development machine, each a median of
# 40 back-to-back boundaries; 2.3 to 2.6 ms over eight runs once each followed
# a training step): the validation takes the median over this many probe runs.
PROBE_RUNS = 3


def _probe_worker(rank: int, world: int, port: int, repeats: int, elastic_model: str, results) -> None:
    """One probe process: all-reduce and optimizer timings of the balance job, boundaries, then a kill.

    The last rank kills itself with SIGKILL while the others wait in an
    all-reduce; each survivor reports how long its error took to surface. The
    store lives in the parent, so that it outlives every probe process.
    """
    import datetime

    import balance_workload  # the balance job's model and optimizer, by reference
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as each device process of the benchmark
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("probe", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=10),
    )
    torch.manual_seed(rank)
    model = balance_workload.make_model()
    optimizer = balance_workload.make_optimizer(model.parameters())
    parameter_count = sum(parameter.numel() for parameter in model.parameters())
    gradient = torch.randn(parameter_count)

    all_reduce_s, optimizer_s = [], []
    for repeat in range(repeats + 2):  # the first two warm up
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(gradient)
        elapsed = slowest_rank(time.perf_counter() - started)
        for parameter in model.parameters():
            parameter.grad = torch.randn_like(parameter)
        dist.barrier()
        started = time.perf_counter()
        optimizer.step()
        stepped = slowest_rank(time.perf_counter() - started)
        if repeat >= 2:
            all_reduce_s.append(elapsed)
            optimizer_s.append(stepped)
    del model, optimizer  # the boundaries follow steps of elastic.py's job instead
    boundaries = _probe_boundaries(rank, world, store, BOUNDARY_REPEATS, elastic_step(elastic_model))
    if rank == 0:
        results.put(
            {
                "kind": "timings",
                "parameter_count": parameter_count,
                "world": world,
                "all_reduce_s": median(all_reduce_s),
                "optimizer_s": median(optimizer_s),
            }
        )
    results.put({"kind": "boundaries", "rank": rank, "seconds": boundaries})
    dist.barrier()
    if rank == world - 1:
        time.sleep(0.3)  # let the others enter the all-reduce first
        store.set("probe/killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(gradient)
        surfaced = None
    except RuntimeError:  # gloo: connection reset / closed, or its timeout (DistError is one too)
        surfaced = time.time()
    detection = None if surfaced is None else surfaced - float(store.get("probe/killed_at").decode())
    results.put({"kind": "detection", "rank": rank, "detection_s": detection})
    results.close()
    results.join_thread()  # the queue's feeder thread must deliver before _exit
    os._exit(0)  # the group is broken: skip its teardown


def elastic_step(model_name: str) -> Callable[[], None]:
    """One training step of elastic.py's job in this process: a VW's forward and backward, then Adam.

    A boundary in a job comes right after a commit, i.e. after a step that
    swept the model, its gradients and Adam's state (about 400 MB for the
    25M-parameter model) through the caches; the probe's boundaries do the
    same. Measured on the development machine (medians of 2-process
    boundaries, fresh probe runs): back to back 1.7-2.3 ms; after each member
    swept 400 MB three times 3.3-3.4 ms; after this step 2.3-2.6 ms, where
    elastic.py's scale-ins read 2.4-3.8 ms (medians of a run's changes).
    """
    settings = elastic_plan.Settings(quick=model_name == "small", rounds=1)
    model, optimizer = elastic_plan.trained_state(settings)
    batch = elastic_plan.one_virtual_worker_batch()

    def step() -> None:
        elastic_plan.cross_entropy(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _probe_boundaries(rank: int, world: int, store, repeats: int, step: Callable[[], None]) -> dict:
    """What a flexpar boundary without a state transfer costs, for groups of 2 .. world processes.

    Each repeat follows a training step of elastic.py's job in every member
    (`elastic_step`), as a boundary follows a commit, and then does what a
    boundary does from a commit on when nobody needs the state (`Worker.run`
    and `Worker.enter`): read the generation's record from the store, meet the other members there (`control.meet`, as
    `DeviceLink.gather`), retire the old group (flexpar's `GroupReaper`) and form a
    fresh one (`fresh_group`, which releases the old group at the end),
    report it formed and take stock (source, receivers, last commit: one
    all-reduce). Every member times it from its own arrival, so the member
    that arrives last - whose time is the boundary's cost, as flexpar's stall
    counts it - times the least.
    Ranks outside a group size's members skip to the next size. The last
    group formed, of all `world` processes, is left for the kill.
    """
    import torch.distributed as dist

    from flexpar.comm import protocol as control
    from flexpar.comm import state_transfer as training_state
    from flexpar.comm.channel import Channel
    from flexpar.comm.collectives import GroupReaper, fresh_group

    if rank == 0:
        store.set("probe/generation", json.dumps({"members": list(range(world)), "failed": [], "left": []}))
    events = Channel(store, "probe/events")
    reaper = GroupReaper()  # a worker's, made with the worker
    seconds: dict = {}
    for size in range(2, world + 1):
        for repeat in range(repeats):
            if rank >= size:
                continue
            step()
            started = time.perf_counter()
            control.get_json(store, "probe/generation")  # the new generation's record
            control.meet(store, f"probe/{size}/{repeat}/arrived", size)  # as DeviceLink.gather, before forming
            with fresh_group(
                reaper.retire([]), "gloo", dist.PrefixStore(f"probe/{size}/{repeat}", store), rank, size, 30
            ):
                events.send({"type": "formed", "device_id": f"probe-{rank}", "generation": repeat})
                training_state.take_stock(0, time.time(), rank, size, "cpu")
                seconds.setdefault(size, []).append(time.perf_counter() - started)
    with fresh_group(reaper.retire([]), "gloo", dist.PrefixStore("probe/kill", store), rank, world, 10):
        pass
    return seconds


def boundary_seconds(per_rank: Sequence[Mapping[int, Sequence[float]]]) -> dict[int, float]:
    """Per group size: the median over repeats of the least member time (the last arrival's)."""
    sizes = sorted({size for seconds in per_rank for size in seconds})
    result = {}
    for size in sizes:
        series = [seconds[size] for seconds in per_rank if size in seconds]
        result[size] = median([min(values) for values in zip(*series)])
    return result


def run_probe(world: int = 4, repeats: int = 10, elastic_model: str = "full") -> dict:
    """All-reduce time, optimizer time, boundary cost and failure detection, in `world` fresh processes.

    `elastic_model`: elastic.py's model (its JSON's "model"), whose training
    step precedes each boundary.
    """
    import datetime

    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch.optim"])
    results = context.Queue()
    processes = [
        context.Process(
            target=_probe_worker, name=f"sim-probe-{rank}", args=(rank, world, port, repeats, elastic_model, results)
        )
        for rank in range(world)
    ]
    _progress(f"probe: {world} gloo processes (all-reduce, optimizer step, boundaries, kill -9 detection)")
    timings, detections, boundaries = None, [], []
    try:
        with started(processes, grace_s=20):
            deadline = time.monotonic() + 180
            while (
                timings is None or len(detections) < world - 1 or len(boundaries) < world
            ) and time.monotonic() < deadline:
                try:
                    message = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if message["kind"] == "timings":
                    timings = message
                elif message["kind"] == "boundaries":
                    boundaries.append(message["seconds"])
                else:
                    detections.append(message["detection_s"])
    finally:
        del store  # closes the probe's store server (the processes have ended)
    if timings is None:
        raise RuntimeError("the calibration probe did not report its timings")
    surfaced = [value for value in detections if value is not None]
    # The first survivor's error starts the recovery: in flexpar it reports the
    # failure and the coordinator tells the others (it also sees the exit itself).
    timings["detection_s"] = min(surfaced) if surfaced else None
    timings["detection_by_survivor_s"] = detections
    timings["boundary_s_by_size"] = boundary_seconds(boundaries) if len(boundaries) == world else {}
    return timings


def combine_probes(probes: Sequence[dict]) -> dict:
    """One probe from several runs: the median of each timing, and of each group size's boundary.

    The first run's other fields (parameter count, world) stand; each run's
    boundaries are kept under ``boundary_s_by_run``.
    """
    combined = dict(probes[0])
    for key in ("all_reduce_s", "optimizer_s", "detection_s"):
        combined[key] = median_of(probes, key)
    runs = [boundaries_by_size(probe) for probe in probes]
    sizes = sorted({size for run in runs for size in run})
    combined["boundary_s_by_size"] = {size: median([run[size] for run in runs if size in run]) for size in sizes}
    combined["boundary_s_by_run"] = runs
    combined["runs"] = len(probes)
    return combined


def boundaries_by_size(probe: dict) -> dict[int, float]:
    """The probe's boundary seconds by group size (sizes are strings once the probe went through JSON)."""
    return {int(size): seconds for size, seconds in (probe.get("boundary_s_by_size") or {}).items()}
