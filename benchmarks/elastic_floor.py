"""The physical floor of benchmarks/elastic.py, and flexpar's own state transfer by part.

A plain gloo broadcast and send of the state's bytes (parameters + Adam state,
as one torch.save buffer) between local processes, a fresh process group in
running processes, each state tensor sent straight into the receiver's own,
and flexpar's transfer path (flexpar.state: capture, send, receive, restore),
also into fresh processes that receive as a joiner does.
"""

from __future__ import annotations

import multiprocessing
import time

import torch
from elastic_plan import Settings, adam, cross_entropy, model_factory, one_virtual_worker_batch, trained_state
from harness import free_port, median, slowest_rank, started, timed


def _state_tensors(model, optimizer) -> list:
    """Every tensor of the training state that a joiner must receive, in a fixed order."""
    tensors = list(model.state_dict().values())
    for parameter in model.parameters():
        state = optimizer.state[parameter]
        tensors += [state[key] for key in sorted(state) if torch.is_tensor(state[key])]
    return tensors


def _floor_worker(
    rank: int,
    world: int,
    port: int,
    model_name: str,
    repeats: int,
    transfer_repeats: int,
    fresh_receivers: int,
    results,
) -> None:
    """One process of the floor measurement; rank 0 reports every figure it measured.

    Last, rank 1 sits out while rank 0 sends flexpar's state to each of
    `fresh_receivers` new processes in turn (`_fresh_receiver`), rank 2 idle
    beside them, as an old member is while a joiner receives.
    """
    import datetime

    import torch.distributed as dist

    from flexpar.worker.process import keep_freed_memory

    keep_freed_memory()  # the source and the others are workers in a job: as every worker does first
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    model, optimizer = trained_state(Settings(quick=model_name == "small", rounds=1))
    while int(store.add("floor/joiners_built", 0)) < fresh_receivers:  # their model builds must not overlap
        time.sleep(0.05)
    figures: dict = {}

    def record(key: str, seconds: float) -> None:
        figures.setdefault(key, []).append(slowest_rank(seconds))

    def form(name: str) -> float:
        if dist.is_initialized():
            # Without this barrier the slowest rank's time would include the
            # skew left by the transfers before (the sender finishes first),
            # which is not group formation: it read 0.10 s for 3 processes
            # against about 0.01 s measured apart.
            dist.barrier()
            dist.destroy_process_group()
        _, seconds = timed(
            lambda: dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank, world_size=world)
        )
        dist.barrier()
        return seconds

    form("pg/0")  # the first group of a process also pays gloo's start-up: not what flexpar pays
    from flexpar.comm import state_transfer as training_state

    data = training_state.to_bytes(training_state.capture(model, optimizer, None, 1, {}))
    state_bytes = len(data)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for repeat in range(repeats):
        record("pg_again_s", form(f"pg/{repeat + 1}"))  # a fresh group in running processes, as flexpar does
        _floor_transfers(rank, payload, record)
        _direct_transfer(rank, _state_tensors(model, optimizer), record)
    del data, payload  # 2 x 302 MB that flexpar's transfer does not hold
    for _ in range(transfer_repeats):
        _flexpar_transfer(rank, model, optimizer, record)
    dist.barrier()
    dist.destroy_process_group()
    for repeat in range(fresh_receivers if rank != 1 else 0):
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"join/{repeat}", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        dist.barrier()
        if rank == 0:
            training_state.send_state(training_state.capture(model, optimizer, None, 1, {}), [1], torch.device("cpu"))
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        results.put({"state_bytes": state_bytes, **figures})


def _fresh_receiver(port: int, repeat: int, model_name: str, results) -> None:
    """A joiner's side of the transfer, in a process that never held the state.

    Like a joiner (flexpar.worker_process.main, Worker.warm_up), it keeps the
    memory it frees (`keep_freed_memory`, every worker's first call), has
    built the model and run one VW's forward and backward without an update,
    receives the model's tensors into its own (`receive_state` with its
    state_dict) and the rest into fresh memory, then restores. Forked from
    flexpar's fork server (fit() started it), it has the workers' allocator
    tunables too. It says when it is built: the floor waits for every
    receiver before it measures anything.
    """
    import datetime

    import torch.distributed as dist

    from flexpar.comm import state_transfer as training_state
    from flexpar.worker.process import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=180))
    model = model_factory(Settings(quick=model_name == "small", rounds=1))()
    optimizer = adam(model.parameters())
    cross_entropy(model, one_virtual_worker_batch()).backward()  # the warm-up
    optimizer.zero_grad(set_to_none=True)
    store.add("floor/joiners_built", 1)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"join/{repeat}", store),
        rank=1,
        world_size=3,
        timeout=datetime.timedelta(seconds=120),
    )
    dist.barrier()
    received, receive_s = timed(lambda: training_state.receive_state(0, torch.device("cpu"), model.state_dict()))
    _, restore_s = timed(lambda: training_state.restore(model, optimizer, None, received))
    results.put({"fresh_receive_s": receive_s, "fresh_restore_s": restore_s})
    dist.barrier()
    dist.destroy_process_group()


def _floor_transfers(rank: int, payload: torch.Tensor, record) -> None:
    """The state's bytes by plain gloo: broadcast 1 -> 2, and send 1 -> 1 (what one joiner needs)."""
    import torch.distributed as dist

    dist.barrier()
    _, seconds = timed(lambda: dist.broadcast(payload, 0))
    record("broadcast_3_s", seconds)
    dist.barrier()
    seconds = 0.0
    if rank == 0:
        _, seconds = timed(lambda: dist.send(payload, 1))
    elif rank == 1:
        _, seconds = timed(lambda: dist.recv(payload, 0))
    record("send_2_s", seconds)


def _flexpar_transfer(rank: int, model, optimizer, record) -> None:
    """flexpar's own path (flexpar.state), function by function, rank 0 -> rank 1.

    The receiver's `receive_s` runs from the same barrier as the sender's
    capture and send, so it spans them: the path ends at receive + restore.
    A joiner, which receives in a process that never held the state, is
    timed apart (`_fresh_receiver`).
    """
    import torch.distributed as dist

    from flexpar.comm import state_transfer as training_state

    cpu = torch.device("cpu")
    parts = dict.fromkeys(("flexpar_capture_s", "flexpar_send_s", "flexpar_receive_s", "flexpar_restore_s"), 0.0)
    dist.barrier()
    if rank == 0:
        state, parts["flexpar_capture_s"] = timed(lambda: training_state.capture(model, optimizer, None, 1, {}))
        _, parts["flexpar_send_s"] = timed(lambda: training_state.send_state(state, [1], cpu))
    elif rank == 1:
        loaded, parts["flexpar_receive_s"] = timed(lambda: training_state.receive_state(0, cpu))
        _, parts["flexpar_restore_s"] = timed(lambda: training_state.restore(model, optimizer, None, loaded))
    for key, seconds in parts.items():
        record(key, seconds)


def _direct_transfer(rank: int, tensors: list, record) -> None:
    """What a copy-free path would cost: each state tensor sent straight into the receiver's own."""
    import torch.distributed as dist

    dist.barrier()
    seconds = 0.0
    if rank == 0:
        _, seconds = timed(lambda: [dist.send(tensor, 1) for tensor in tensors])
    elif rank == 1:
        _, seconds = timed(lambda: [dist.recv(tensor, 0) for tensor in tensors])
    record("direct_tensor_send_s", seconds)


def measure_floor(settings: Settings) -> dict:
    """Broadcast floor, process-group formation and flexpar's transfer parts (3 processes)."""
    # A fork server that has imported torch (flexpar's fit() already started one)
    # keeps three `import torch` off this measurement's wall time.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "flexpar.comm.state_transfer"]
    )
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_floor_worker,
            name=f"elastic-floor-{rank}",
            args=(
                rank,
                3,
                port,
                settings.model_name,
                settings.broadcast_repeats,
                settings.transfer_repeats,
                settings.fresh_receivers,
                results,
            ),
        )
        for rank in range(3)
    ]
    # Each waits for its turn (its own group) without using the CPU.
    processes += [
        context.Process(
            target=_fresh_receiver, name=f"elastic-joiner-{repeat}", args=(port, repeat, settings.model_name, results)
        )
        for repeat in range(settings.fresh_receivers)
    ]
    fresh: dict = {}
    with started(processes, grace_s=30):
        while True:
            message = results.get(timeout=300)
            if "fresh_receive_s" not in message:
                figures = {**message, **{f"flexpar_{key}": values for key, values in fresh.items()}}
                break
            for key, seconds in message.items():
                fresh.setdefault(key, []).append(seconds)
    return {key: (median(value) if isinstance(value, list) else value) for key, value in figures.items()}
