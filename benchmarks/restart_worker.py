"""The elastic benchmark's job, and its checkpoint-restart baseline under torchrun.

Two things live here, both plain PyTorch (no flexpar import, so the baseline
pays nothing for flexpar):

- the single-device pieces of the job both sides train (`make_model`, `adam`,
  `cross_entropy`, `make_dataset`): an MLP of a few wide layers, Adam;
- `main()`, a torchrun training script written the way torchrun's elastic
  documentation asks for: at start it loads the latest checkpoint if there is
  one, wraps the model in `DistributedDataParallel` (gloo), trains, and saves a
  checkpoint (model + optimizer state, `torch.save`) after every step, so a
  membership change, which makes torchrun stop every worker and start a fresh
  set, loses at most the step in flight.

Rank 0 appends JSON lines to `--records`: one `start` record per worker set (with
the wall times at which the process started, finished `import torch`, formed
the process group, built the model, loaded the checkpoint and built DDP) and
one `step` record per committed step. The benchmark reads the stall from them.
"""

import time

PROCESS_STARTED = time.time()  # before `import torch`: the restart pays that import
# The imports below follow the clock start on purpose (hence noqa: E402).

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

IMPORTED = time.time()

FEATURES = 1024
CLASSES = 16


def make_model(features: int = FEATURES, hidden: int = 4096, classes: int = CLASSES) -> nn.Module:
    """An MLP of a few wide layers: about 25.2M parameters at the default sizes."""
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, features),
        nn.ReLU(),
        nn.Linear(features, classes),
    )


def make_small_model() -> nn.Module:
    """The --quick model: the same shape of network, about 3.2M parameters."""
    return make_model(hidden=1024)


def adam(parameters):
    return torch.optim.Adam(parameters, lr=1e-4)


def cross_entropy(model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def make_dataset(size: int = 512, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (size,), generator=generator)
    return torch.utils.data.TensorDataset(inputs, labels)


MODELS = {"full": make_model, "small": make_small_model}


# ------------------------------------------------------------------ torchrun script


def _log(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _save_checkpoint(path: str, model, optimizer, step: int) -> None:
    """Atomic: a worker killed mid-save leaves the previous checkpoint intact."""
    temporary = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, temporary)
    os.replace(temporary, path)


def main() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    parser = argparse.ArgumentParser(description="checkpoint-restart DDP worker (run under torchrun)")
    parser.add_argument("--records", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument(
        "--max-steps", type=int, default=200, help="a safety stop; the benchmark ends the workers once it has measured"
    )
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--model", choices=sorted(MODELS), default="full")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--pid-folder", default=None, help="each worker leaves its pid here, so the benchmark can always clean up"
    )
    args = parser.parse_args()
    if args.pid_folder:
        os.makedirs(args.pid_folder, exist_ok=True)
        open(os.path.join(args.pid_folder, str(os.getpid())), "w").close()

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    group_formed = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MODELS[args.model]()
    optimizer = adam(model.parameters())
    model_built = time.time()
    step = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    loaded = time.time()
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters to the others
    ddp_ready = time.time()
    if rank == 0:
        _log(
            args.records,
            {
                "kind": "start",
                "world": world,
                "step": step,
                "process_started": PROCESS_STARTED,
                "imported": IMPORTED,
                "group_formed": group_formed,
                "model_built": model_built,
                "loaded": loaded,
                "ddp_ready": ddp_ready,
            },
        )
    dataset = make_dataset()
    per_rank = args.global_batch // world
    previous = time.time()
    last_save_s = 0.0
    while step < args.max_steps:
        # The same global batch at every world size: rank r takes its slice of it.
        start = (step * args.global_batch) % (len(dataset) - args.global_batch + 1)
        indices = range(start + rank * per_rank, start + (rank + 1) * per_rank)
        inputs, labels = dataset[list(indices)]
        loss = cross_entropy(ddp, (inputs, labels))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            # Recorded before the save: a worker stopped during the save loses this
            # step (the checkpoint still holds the one before), and `steps_lost` shows it.
            committed = time.time()
            _log(
                args.records,
                {
                    "kind": "step",
                    "step": step - 1,
                    "time": committed,
                    "world": world,
                    "step_time_s": committed - previous,
                    "save_s": last_save_s,
                },
            )
            _save_checkpoint(args.checkpoint, model, optimizer, step)
            last_save_s = time.time() - committed
        previous = time.time()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
