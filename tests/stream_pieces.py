"""Iterable datasets of every kind flexpar/data reads, and a harness that moves VWs between simulated devices.

`schedule_items` plays a job's data side in one process: "devices" are
`VirtualWorkerStreams` readers over VW subsets that change at random step
boundaries (VWs moved by `state` on the old holder and `load` on the new one),
devices that fail in the middle of a step (their VWs restored from the
positions gathered at the last commit, or from the pass ends alone), joiners
and a resume of every device from a checkpointed state. It returns each
step's items, VW by VW, to compare with one reader holding every VW.
"""

from __future__ import annotations

import collections
import os
import random

import torch
from torch.utils.data import IterableDataset

import flexpar
from flexpar.data import VirtualWorkerStreams


class CountingStream(IterableDataset):
    """No shards, no state: pass p yields its own order of `lengths[p]` numbered items (set_epoch picks p)."""

    def __init__(self, lengths):
        self.lengths = list(lengths)
        self.epoch = 0
        self.epochs_set = []

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __iter__(self):
        length = self.lengths[min(self.epoch, len(self.lengths) - 1)]
        order = list(range(length))
        random.Random(self.epoch).shuffle(order)
        for index in order:
            yield {"pass": self.epoch, "index": index, "x": float(index)}


class ShardedStream(IterableDataset):
    """flexpar's shard protocol: `n_shards` and `shard(num_shards, index)`; shards of the given sizes."""

    def __init__(self, sizes, shards=None):
        self.sizes = list(sizes)
        self.shards = list(range(len(sizes))) if shards is None else list(shards)
        self.epoch = 0

    @property
    def n_shards(self):
        return len(self.shards)

    def shard(self, num_shards, index):
        per = len(self.shards) // num_shards
        return ShardedStream(self.sizes, self.shards[index * per : (index + 1) * per])

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        shards = self.shards if self.epoch % 2 == 0 else self.shards[::-1]  # the pass changes the shard order
        for shard in shards:
            for index in range(self.sizes[shard]):
                yield {"pass": self.epoch, "shard": shard, "index": index}


class PackingStream(IterableDataset):
    """Documents of random length packed into fixed-length token sequences; the leftover tokens are state.

    The leftover of one pass starts the next (so its passes are not independent);
    `state_dict()` is the position after the last sequence yielded.
    """

    def __init__(self, documents=40, sequence=8, seed=0):
        self.documents, self.sequence, self.seed = documents, sequence, seed
        self._epoch, self._document, self._leftover = 0, 0, []

    def set_epoch(self, epoch):
        if epoch != self._epoch:
            self._epoch, self._document = epoch, 0

    def _tokens(self, epoch, document):
        rng = random.Random(self.seed * 1_000_003 + epoch * 10_007 + document)
        return [epoch * 100_000 + document * 100 + k for k in range(rng.randint(1, 3 * self.sequence))]

    def __iter__(self):
        while True:
            while len(self._leftover) < self.sequence:
                if self._document >= self.documents:
                    return
                self._leftover = self._leftover + self._tokens(self._epoch, self._document)
                self._document += 1
            sequence, self._leftover = self._leftover[: self.sequence], self._leftover[self.sequence :]
            yield torch.tensor(sequence)

    def state_dict(self):
        return {"epoch": self._epoch, "document": self._document, "leftover": list(self._leftover)}

    def load_state_dict(self, state):
        self._epoch, self._document, self._leftover = state["epoch"], state["document"], list(state["leftover"])


def huggingface_stream(rows=120, shards=4, shuffle_buffer=None, seed=7):
    from datasets import Dataset

    dataset = Dataset.from_dict({"index": list(range(rows)), "x": [float(i) for i in range(rows)]})
    dataset = dataset.to_iterable_dataset(num_shards=shards)
    if shuffle_buffer:
        dataset = dataset.shuffle(seed=seed, buffer_size=shuffle_buffer)
    return dataset


def write_tar_shards(directory, sizes):
    """WebDataset tar shards of the given sample counts; returns their paths."""
    import webdataset as wds

    paths = []
    for shard, size in enumerate(sizes):
        path = str(directory / f"shard-{shard:03d}.tar")
        with wds.TarWriter(path) as writer:
            for index in range(size):
                writer.write({"__key__": f"s{shard:03d}_{index:05d}", "txt": f"{shard}:{index}"})
        paths.append(path)
    return paths


def webdataset_stream(paths, **options):
    import webdataset as wds

    options.setdefault("shardshuffle", False)
    return wds.WebDataset(paths, empty_check=False, **options).decode()


def plain(item):
    """An item as comparable Python data."""
    if isinstance(item, torch.Tensor):
        return item.tolist()
    if isinstance(item, dict):
        return tuple(sorted((key, plain(value)) for key, value in item.items()))
    return item


def reference_items(dataset, virtual_workers, batch, steps, pass_end="drop", num_workers=0):
    """Each step's items, VW by VW, from one reader holding every VW."""
    reader = VirtualWorkerStreams(dataset, virtual_workers, batch, pass_end=pass_end, num_workers=num_workers)
    reader.hold(range(virtual_workers), 0)
    result = []
    for step in range(steps):
        result.append([[plain(item) for item in reader.items(step, v)] for v in range(virtual_workers)])
        reader.commit(step + 1)
    reader.close()  # its pass ends stay known
    return result, reader


def merge_states(states):
    """The positions of several readers at one boundary, one per group (what the worker would gather)."""
    merged = dict(states[0])
    groups = {}
    for state in states:
        assert state["step"] == merged["step"]
        for position in state["groups"]:
            groups.setdefault(position["group"], position)
    merged["groups"] = [groups[group] for group in sorted(groups)]
    return merged


def _random_holdings(rng, virtual_workers, devices):
    """VW sets for `devices` devices, each non-empty, together all VWs (random, not contiguous)."""
    order = list(range(virtual_workers))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, virtual_workers), devices - 1)) if devices > 1 else []
    bounds = [0, *cuts, virtual_workers]
    return [set(order[bounds[i] : bounds[i + 1]]) for i in range(devices)]


_EVENTS = ("rebalance", "failure", "none", "resume", "rebalance", "failure", "none")


def schedule_items(
    dataset, virtual_workers, batch, steps, seed, pass_end="drop", lost_positions=False, num_workers=0, events=None
):
    """Each step's items, VW by VW, under a random schedule of moves, joins, leaves, failures and a resume,
    and how many of each event it played (a Counter).

    lost_positions: a failed device's groups are restored from the pass ends alone
    (`position_at`), as when their positions were not replicated (skip kinds only).
    events: the cycle of events played at the boundaries ("rebalance", "failure", "resume", "none").
    """
    rng = random.Random(seed)
    cycle = events or _EVENTS
    events = collections.Counter()

    def reader():
        return VirtualWorkerStreams(dataset, virtual_workers, batch, pass_end=pass_end, num_workers=num_workers)

    devices = []  # [reader, held VWs]
    for held in _random_holdings(rng, virtual_workers, rng.randint(1, min(4, virtual_workers))):
        device = reader()
        device.hold(held, 0)
        devices.append([device, held])
    committed = None
    pass_ends = []
    result = []
    for step in range(steps):
        event = cycle[(step + seed) % len(cycle)] if step else "none"
        if event == "rebalance":  # a rebalance, with joins and leaves: VWs move by state() -> load()
            holder = {v: device for device, held in devices for v in held}
            new = _random_holdings(rng, virtual_workers, rng.randint(1, min(4, virtual_workers)))
            kept = [device for device, _ in devices]
            rng.shuffle(kept)
            devices = []
            for held in new:  # every state is taken before any device lets go of a VW
                device = kept.pop() if kept and rng.random() < 0.8 else reader()
                for v in sorted(held):
                    if holder[v] is not device:
                        device.load(holder[v].state(step, [v]))
                devices.append([device, held])
            for device, held in devices:
                device.hold(held, step)
            for left in kept:
                left.close()
            events["rebalance"] += 1
            events["moved"] += sum(1 for (device, held) in devices for v in held if holder[v] is not device)
        elif event == "failure":  # a failure in the middle of the step: survivors redo it from the commit
            for device, held in devices:
                for v in sorted(held)[: rng.randint(0, len(held))]:
                    device.items(step, v)
            events["failure"] += 1
            dead = rng.randrange(len(devices))
            lost, orphans = devices.pop(dead)
            lost.close()  # its DataLoader processes die with it
            if not devices or rng.random() < 0.3:
                devices.append([reader(), set()])  # a replacement joins
            for v in orphans:
                device, held = devices[rng.randrange(len(devices))]
                held.add(v)
            for device, held in devices:
                if lost_positions:
                    for group in device.split.groups_of(held):
                        device.load(device.position_at(group, step, pass_ends))
                else:
                    device.load(committed)
                device.hold(held, step)
        elif event == "resume":  # every device replaced: a resume from a checkpoint
            events["resume"] += 1
            for device, _ in devices:
                device.close()
            devices = []
            for held in _random_holdings(rng, virtual_workers, rng.randint(1, min(4, virtual_workers))):
                device = reader()
                device.load(committed)
                device.hold(held, step)
                devices.append([device, held])
        holder = {v: device for device, held in devices for v in held}
        result.append([[plain(item) for item in holder[v].items(step, v)] for v in range(virtual_workers)])
        for device, _ in devices:
            device.commit(step + 1)
        committed = merge_states([device.state(step + 1) for device, _ in devices])
        ends = {(e.group, e.pass_): e for device, _ in devices for e in device.pass_ends()}
        known = {(e.group, e.pass_) for e in pass_ends}
        pass_ends += [e for key, e in ends.items() if key not in known]
        events["passes"] = len(pass_ends)
    for device, _ in devices:
        device.close()
    return result, events


# ------------------------------------------------------------ streaming jobs (tests/end_to_end/test_streaming_jobs.py)


class PairStream(IterableDataset):
    """No shards, no state: (inputs, label) pairs of pieces.make_dataset(size), pass p rotated by 7p items.

    With the default 456 items and a global batch of 48 a pass is 9 steps and 24 items (dropped)."""

    def __init__(self, size=456):
        from pieces import make_dataset

        self.inputs, self.labels = make_dataset(size).tensors
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def order(self, epoch):
        size = len(self.labels)
        return [(k + 7 * epoch) % size for k in range(size)]

    def __iter__(self):
        for index in self.order(self.epoch):
            yield self.inputs[index], self.labels[index]


class ShardedPairs(IterableDataset):
    """flexpar's shard protocol over (inputs, label) pairs: `shards` shards of `per_shard` items each;
    odd passes read a shard backwards."""

    def __init__(self, shards=6, per_shard=76, chosen=None):
        from pieces import make_dataset

        self.inputs, self.labels = make_dataset(shards * per_shard).tensors
        self.per_shard = per_shard
        self.total = shards
        self.chosen = list(range(shards)) if chosen is None else list(chosen)
        self.epoch = 0

    @property
    def n_shards(self):
        return len(self.chosen)

    def shard(self, num_shards, index):
        per = len(self.chosen) // num_shards
        picked = ShardedPairs.__new__(ShardedPairs)
        picked.__dict__.update(self.__dict__)
        picked.chosen = self.chosen[index * per : (index + 1) * per]
        return picked

    def set_epoch(self, epoch):
        self.epoch = epoch

    def shard_order(self, shard, epoch):
        indices = [shard * self.per_shard + k for k in range(self.per_shard)]
        return indices[::-1] if epoch % 2 else indices

    def __iter__(self):
        for shard in self.chosen:
            for index in self.shard_order(shard, self.epoch):
                yield self.inputs[index], self.labels[index]


class StatefulPairs(PairStream):
    """PairStream with torchdata's Stateful protocol: state_dict() is (pass, items of it yielded), a
    complete position, so flexpar restores it with load_state_dict instead of skipping."""

    def __init__(self, size=456):
        super().__init__(size)
        self._next = 0

    def set_epoch(self, epoch):
        if epoch != self.epoch:
            self.epoch, self._next = epoch, 0

    def __iter__(self):
        order = self.order(self.epoch)
        while self._next < len(order):
            index = order[self._next]
            self._next += 1
            yield self.inputs[index], self.labels[index]

    def state_dict(self):
        return {"epoch": self.epoch, "next": self._next}

    def load_state_dict(self, state):
        self.epoch, self._next = state["epoch"], state["next"]


class SplitsByRank(PairStream):
    """Reads the rank to keep its own share: would split a second time, by a rank that changes."""

    def __iter__(self):
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        for k, pair in enumerate(super().__iter__()):
            if k % world == rank:
                yield pair


class ReadLoggedPairs(PairStream):
    """A PairStream that appends the reading process's pid to `log` each time a pass starts (any copy of it,
    in any process): who read the stream, and how often."""

    def __init__(self, log, size=456):
        super().__init__(size)
        self.log = str(log)

    def __iter__(self):
        with open(self.log, "a", encoding="utf-8") as handle:
            handle.write(f"{os.getpid()}\n")
        return super().__iter__()


class StopAfter(flexpar.Callback):
    """A callback that stops the job once the step record of `step` arrives (flexpar.STOP)."""

    def __init__(self, step):
        self.step = step

    def on_step(self, record):
        return flexpar.STOP if record["step"] >= self.step else None


def round_robin_items(stream, global_batch, virtual_workers):
    """items(step, vw) of a plain stream as a plain loop reads it: step s trains on items s*B .. (s+1)*B-1
    of the pass (a pass of n items is n // B steps, its last n % B items dropped), VW v on v, v+V, ..."""
    per_pass = len(stream.labels) // global_batch

    def items(step, virtual_worker):
        order = stream.order(step // per_pass)
        first = (step % per_pass) * global_batch
        chunk = order[first : first + global_batch]
        return [(stream.inputs[i], stream.labels[i]) for i in chunk[virtual_worker::virtual_workers]]

    return items


def shard_items(stream, micro_batch):
    """items(step, vw) of ShardedPairs with one shard per VW: VW v reads shard v, micro_batch items a step."""
    per_pass = stream.per_shard // micro_batch

    def items(step, virtual_worker):
        order = stream.shard_order(virtual_worker, step // per_pass)
        first = (step % per_pass) * micro_batch
        return [(stream.inputs[i], stream.labels[i]) for i in order[first : first + micro_batch]]

    return items


def stream_reference(job, steps, items):
    """The plain single-process loop over a stream: per step, every VW's items (`items(step, vw)`) under
    the VW's random stream, the mean loss over the whole global batch, one backward, one update."""
    from pieces import Loss

    from flexpar.core import batching
    from flexpar.worker.user_code import build_model, build_optimizer

    model = build_model(job)
    optimizer, scheduler = build_optimizer(job, model)
    loss_of = Loss(0.0)
    collate = job.collate_fn or torch.utils.data.default_collate
    for step in range(steps):
        losses = []
        for virtual_worker in range(job.virtual_workers):
            batch = collate(items(step, virtual_worker))
            torch.manual_seed(batching.virtual_worker_seed(job.seed, step, virtual_worker))
            losses.append(loss_of(model, batch))
        torch.stack(losses).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def huggingface_pairs(shards=6, per_shard=76, buffer_size=32, seed=3):
    """pieces.make_dataset's pairs as a Hugging Face IterableDataset of `shards` shards, shuffled with a
    buffer (its state_dict() then leaves the buffer out: flexpar positions it by skipping)."""
    from datasets import Dataset
    from pieces import make_dataset

    inputs, labels = make_dataset(shards * per_shard).tensors
    table = Dataset.from_dict({"inputs": inputs.tolist(), "label": labels.tolist()})
    return table.to_iterable_dataset(num_shards=shards).shuffle(seed=seed, buffer_size=buffer_size)


def collate_rows(rows):
    """Hugging Face rows ({"inputs": [...], "label": k}) -> (inputs, labels), as pieces.Loss takes them."""
    inputs = torch.tensor([row["inputs"] for row in rows], dtype=torch.float32)
    return inputs, torch.tensor([row["label"] for row in rows])


def huggingface_items(dataset, virtual_workers, micro_batch, steps):
    """items(step, vw) of a Hugging Face dataset of one shard per VW, as a plain loop reads them: VW v
    iterates `dataset.shard(num_shards=V, index=v)` pass after pass (`set_epoch(pass)` first), a pass's
    last items that do not fill a micro-batch dropped."""
    read = {}
    for virtual_worker in range(virtual_workers):
        batches = []
        epoch = 0
        while len(batches) < steps:
            shard = dataset.shard(num_shards=virtual_workers, index=virtual_worker)
            shard.set_epoch(epoch)
            rows = list(shard)
            whole = len(rows) // micro_batch
            batches += [rows[k * micro_batch : (k + 1) * micro_batch] for k in range(whole)]
            epoch += 1
        read[virtual_worker] = batches
    return lambda step, virtual_worker: read[virtual_worker][step]


class TarRows:
    """collate_fn for a WebDataset of write_tar_shards(directory, [per_shard] * n): each sample's
    "shard:index" text names row shard * per_shard + index of pieces.make_dataset(n * per_shard)."""

    def __init__(self, shards=6, per_shard=76):
        from pieces import make_dataset

        self.inputs, self.labels = make_dataset(shards * per_shard).tensors
        self.per_shard = per_shard

    def rows(self, samples):
        rows = []
        for sample in samples:
            shard, index = (int(part) for part in sample["txt"].split(":"))
            rows.append(shard * self.per_shard + index)
        return rows

    def __call__(self, samples):
        rows = self.rows(samples)
        return self.inputs[rows], self.labels[rows]


def tar_items(per_shard, micro_batch):
    """items(step, vw) of the tar shards with one shard per VW, read in order every pass (the samples'
    text only: what TarRows collates)."""
    per_pass = per_shard // micro_batch

    def items(step, virtual_worker):
        first = (step % per_pass) * micro_batch
        return [{"txt": f"{virtual_worker}:{index}"} for index in range(first, first + micro_batch)]

    return items


class TokenFeatures:
    """A collate_fn for PackingStream's token sequences: pieces' (inputs, labels) pairs, a fixed function
    of the tokens (FEATURES features from the sequence's tokens, the label from its first token)."""

    def __call__(self, sequences):
        from pieces import CLASSES, FEATURES

        tokens = torch.stack(list(sequences)).double()
        steps = torch.arange(1, FEATURES + 1, dtype=torch.float64)
        inputs = torch.sin(tokens[:, :1] * 0.001 * steps + tokens[:, -1:] * 0.0003).float()
        return inputs, (tokens[:, 0].long() % CLASSES)
