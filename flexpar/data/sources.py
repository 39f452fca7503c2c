"""What an iterable dataset is to flexpar: its shards, its state, its passes, and what is refused.

`describe(dataset)` looks at the dataset once (in the driver's checks and in
each worker) and returns a `StreamSource`: the shard count the split uses,
whether the dataset's own `state_dict()` is a complete position, and
`group(split, g)`, the `GroupSource` that opens pass `p` of group `g`'s stream.

Kinds recognised (the libraries are imported only if the user's code already
did, so the core install needs neither):

- Hugging Face `datasets.IterableDataset`: shards `n_shards`, group `g` is
  `dataset.shard(num_shards=G, index=g)`, `set_epoch(p)` at each pass, its
  `state_dict()` as the position, except where that state is not complete: a
  shuffle buffer (`.shuffle(seed, buffer_size)`: the buffer's items are not in
  the state, so a restored stream yields other items) or a batched `.map()`
  (may skip a batch, as its documentation says). Those are positioned by
  skipping from the start of the pass instead, which is exact.
  `split_dataset_by_node(...)` applied by the user is refused.
- A WebDataset pipeline (`wds.WebDataset(urls)` or a `wds.DataPipeline` whose
  first stage is a `SimpleShardList`): shards = its shard URLs, group `g` reads
  its URLs only; `wds.split_by_node` is refused; `single_node_only` (the
  WebDataset default node splitter, which would raise on a multi-process group
  and splits nothing) is replaced by a pass-through; `.shuffle(n)` without a
  seed is refused (time-seeded: each device would read another order);
  `detshuffle` stages get the pass as their epoch. No state: positioned by
  skipping.
- flexpar's shard protocol, for any other iterable: an integer attribute
  `n_shards` and a method `shard(num_shards, index)` returning the dataset
  restricted to the `index`-th of `num_shards` contiguous groups of its shards
  (the same two members as Hugging Face's). With `num_shards` dividing
  `n_shards`, each group gets `n_shards / num_shards` shards.
- Stateful datasets (torchdata's Stateful protocol: `state_dict()` and
  `load_state_dict(state)`): the state is the position; `flexpar_exact_state =
  False` on the dataset says it is not complete (then: skipping).
- Anything else with `__iter__`: no shards (round-robin), positioned by skipping.

Every pass of a dataset without complete state is iterated on a fresh copy of
the group's pristine dataset, so pass `p` is the same stream however often and
wherever it is opened (a copy's own random generators, e.g. WebDataset's
seeded shuffles, restart with it). A stateful dataset keeps one copy across
passes: its state carries what passes hand on (a packing dataset's leftover
tokens).

A dataset that splits by rank itself would split a second time, by a rank that
changes with every device set: besides the two above, any method of the
dataset's own class that reads `torch.distributed.get_rank`/`get_world_size`
or the `RANK`/`WORLD_SIZE`/`LOCAL_RANK` environment variables is refused.
"""

from __future__ import annotations

import copy
import multiprocessing
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader

from flexpar.core.stream_split import StreamSplit, pass_seed
from flexpar.data import loader_handover
from flexpar.errors import ArgumentError

_RANK_NAMES = frozenset({"get_rank", "get_world_size", "get_node_local_rank"})
_RANK_VARIABLES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"})
_LIBRARY_MODULES = ("torch.", "datasets.", "webdataset.", "torchdata.", "builtins")


_LOADER_CONTEXT = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
"""DataLoader processes are forked from the device's process, so they end with it (as worker/loader.py's)."""


def _pass_through(source):
    """Replaces WebDataset's `single_node_only`: flexpar has already cut the shard list by VW group."""
    return source


@dataclass
class GroupSource:
    """Opens the passes of one group's stream."""

    template: Any  # the group's dataset as first built (never iterated when `fresh_per_pass`)
    stateful: bool  # its state_dict() is a complete position
    fresh_per_pass: bool
    prepare: Optional[Callable[[Any, int], None]] = None  # called with (dataset, pass) before iterating
    skippable: bool = True  # a position is reached by skipping from the pass start (passes independent)
    num_workers: int = 0  # > 0: the stream is a DataLoader's over the dataset with that many processes
    group: int = 0
    seed: int = 0  # the job's: with num_workers, pass p's loader processes are seeded from (seed, group, p)
    loader_batch: int = 1  # with num_workers: the items a loader process hands over at a time
    _live: Any = None

    def open(self, pass_: int, state: Any = None) -> Iterator:
        """An iterator over pass `pass_`, from `state` (this source's own state_dict) or its start."""
        if self.fresh_per_pass or self._live is None or state is not None:
            self._live = _copy(self.template)
        dataset = self._live
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(pass_)
        if self.prepare is not None:
            self.prepare(dataset, pass_)
        if state is not None:
            dataset.load_state_dict(state)
        if not self.num_workers:
            return iter(dataset)
        # The DataLoader's own order: its worker processes take turns, `loader_batch` items each (the
        # per-VW batch: the order of a plain loop over DataLoader(batch_size=that)), an exhausted one
        # dropping out; the same on every run for the same dataset, num_workers and batch.
        loader = DataLoader(
            dataset,
            batch_size=self.loader_batch,
            num_workers=self.num_workers,
            collate_fn=loader_handover.pack,  # a run of items in one message (data/loader_handover.py)
            multiprocessing_context=_LOADER_CONTEXT,
            # Its processes seed torch and random from a draw of this generator: the device's own
            # generator would give each device, and each run, other random streams.
            generator=torch.Generator().manual_seed(pass_seed(self.seed, self.group, pass_)),
        )
        return loader_handover.LoaderItems(loader)

    def state(self) -> Any:
        """The open dataset's state (after the last item it yielded), or None without a complete one."""
        if not self.stateful or self._live is None:
            return None
        return copy.deepcopy(self._live.state_dict())


@dataclass(frozen=True)
class StreamSource:
    """One iterable dataset as flexpar reads it."""

    dataset: Any
    kind: str  # "huggingface", "webdataset", "sharded", "stateful", "plain"
    shards: Optional[int]  # for the split; None: none
    stateful: bool  # positions carry the dataset's state_dict (else: skipped to)
    note: str = ""  # what flexpar changed in the pipeline, to say so once

    def group(
        self, split: StreamSplit, group: int, num_workers: int = 0, seed: int = 0, loader_batch: int = 1
    ) -> GroupSource:
        """The source of `group`'s stream under `split` (behind a DataLoader of `num_workers` processes
        handing over `loader_batch` items at a time)."""
        loading = {"num_workers": num_workers, "group": group, "seed": seed, "loader_batch": loader_batch}
        if self.kind == "webdataset":
            return GroupSource(_webdataset_group(self.dataset, split, group), False, True, _webdataset_epoch, **loading)
        if self.kind in ("huggingface", "sharded") and split.sharded:
            template = self.dataset.shard(num_shards=split.groups, index=group)
        else:
            template = self.dataset
        if num_workers:
            # Each worker process iterates its own copy: the state of the one in this process says
            # nothing, and each pass starts from it, as in a plain loop over a DataLoader.
            return GroupSource(_copy(template), False, True, **loading)
        # A stateful dataset of the user's may carry state from pass to pass (a packing dataset's leftover
        # tokens): its later passes cannot be reached by skipping from a fresh copy. Hugging Face's
        # passes carry nothing (set_epoch starts each anew).
        skippable = self.kind == "huggingface" or not self.stateful
        return GroupSource(_copy(template), self.stateful, not self.stateful, skippable=skippable)


def _copy(dataset):
    try:
        return copy.deepcopy(dataset)
    except Exception:  # noqa: BLE001 - a dataset holding what cannot be copied is used as it is
        return dataset


def is_stream(dataset) -> bool:
    """Whether `dataset=` is an iterable (streaming) dataset rather than a map-style one: a torch
    `IterableDataset` (a Hugging Face `datasets.IterableDataset` is one), or anything iterable
    without both `__getitem__` and `__len__`."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    hf = sys.modules.get("datasets")
    if hf is not None and isinstance(dataset, getattr(hf, "IterableDataset", ())):
        return True
    mapped = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    return not mapped and callable(getattr(dataset, "__iter__", None))


def describe(dataset) -> StreamSource:
    """What `dataset` is to the split; ArgumentError (one line: what to remove) for what is refused."""
    if not callable(getattr(dataset, "__iter__", None)):
        raise ArgumentError(f"dataset= must be iterable (got {type(dataset).__name__})")
    if callable(getattr(dataset, "__next__", None)):
        raise ArgumentError(
            f"dataset= is an iterator ({type(dataset).__name__}), which can be read once: pass an iterable "
            "whose iter() starts the stream anew (e.g. a torch IterableDataset whose __iter__ is a generator)"
        )
    hf = sys.modules.get("datasets")
    if hf is not None and isinstance(dataset, getattr(hf, "IterableDataset", ())):
        return _describe_huggingface(dataset)
    wds = sys.modules.get("webdataset")
    if wds is not None and isinstance(dataset, getattr(wds, "DataPipeline", ())):
        return _describe_webdataset(dataset)
    _refuse_rank_reading(type(dataset))
    stateful = callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
    stateful = stateful and getattr(dataset, "flexpar_exact_state", True) is not False
    shards = getattr(dataset, "n_shards", None)
    if isinstance(shards, int) and not isinstance(shards, bool) and shards > 0:
        if not callable(getattr(dataset, "shard", None)):
            raise ArgumentError(
                f"dataset= has n_shards={shards} but no shard(num_shards, index) method: add it, "
                "or remove n_shards to have the stream split round-robin"
            )
        return StreamSource(dataset, "sharded", shards, stateful)
    return StreamSource(dataset, "stateful" if stateful else "plain", None, stateful)


def _describe_huggingface(dataset) -> StreamSource:
    if getattr(dataset, "_distributed", None) is not None:
        raise ArgumentError(
            "dataset= was split by node (datasets.distributed.split_dataset_by_node): pass the dataset "
            "before that call; flexpar splits it by virtual worker itself"
        )
    _refuse_huggingface_rank_reading(dataset)
    return StreamSource(dataset, "huggingface", int(dataset.n_shards), _huggingface_state_complete(dataset))


def _refuse_huggingface_rank_reading(dataset) -> None:
    """The functions of the dataset's .map()/.filter() steps must not read the rank either."""
    for node in _huggingface_chain(dataset):
        function = getattr(node, "function", None)
        if isinstance(function, types.FunctionType):
            _refuse_rank_reading_code(function.__code__, f"the .map()/.filter() function {function.__qualname__}")


def _huggingface_chain(dataset) -> list:
    """The examples iterables a Hugging Face IterableDataset is made of (its pipeline, outermost first)."""
    chain, pending = [], [getattr(dataset, "_ex_iterable", None)]
    while pending:
        node = pending.pop()
        if node is None:
            continue
        chain.append(node)
        pending.append(getattr(node, "ex_iterable", None))
        pending.extend(getattr(node, "ex_iterables", None) or ())
    return chain


def _huggingface_state_complete(dataset) -> bool:
    """False where the dataset's state_dict() does not restore the same stream (a shuffle buffer, a batched map)."""
    for node in _huggingface_chain(dataset):
        name = type(node).__name__
        if "BufferShuffled" in name or (name.startswith("Mapped") and getattr(node, "batched", False)):
            return False
    return True


def _stage_function(stage):
    """The function a WebDataset stage runs (through pipelinefilter's curried wrappers)."""
    for attribute in ("f", "func"):
        inner = getattr(stage, attribute, None)
        if callable(inner):
            return inner
    return stage


def _describe_webdataset(pipeline) -> StreamSource:
    import webdataset as wds

    stages = list(pipeline.pipeline)
    if not stages:
        raise ArgumentError("dataset= is an empty WebDataset pipeline")
    note = ""
    for stage in stages:
        function = _stage_function(stage)
        if function is wds.shardlists.split_by_node:
            raise ArgumentError(
                "dataset= splits its shards by node (wds.split_by_node): remove it (nodesplitter=None); "
                "flexpar splits the shards by virtual worker itself"
            )
        if function is wds.shardlists.single_node_only:
            note = "WebDataset's single_node_only node splitter is replaced by a pass-through"
        args, kw = tuple(getattr(stage, "args", ()) or ()), dict(getattr(stage, "kw", {}) or {})
        if function is wds.filters._shuffle and _unseeded(args, kw):
            raise ArgumentError(
                "dataset= shuffles with .shuffle(n) and no seed, so every device would read another order: "
                "give it seed=... (or use wds.detshuffle)"
            )
        for user_function in (function, *args, *kw.values()):
            if isinstance(user_function, types.FunctionType) and not user_function.__module__.startswith("webdataset"):
                _refuse_rank_reading_code(user_function.__code__, f"the pipeline stage {user_function.__qualname__}")
    first = stages[0]
    shards = None
    if isinstance(first, wds.shardlists.SimpleShardList):
        shards = len(first.urls)
    return StreamSource(pipeline, "webdataset", shards, False, note)


def _unseeded(args: tuple, kw: dict) -> bool:
    """A WebDataset `_shuffle(data, bufsize, initial, rng, seed)` stage that shuffles from a time seed."""
    bufsize = args[0] if args else kw.get("bufsize", 1000)
    rng = args[2] if len(args) > 2 else kw.get("rng")
    seed = args[3] if len(args) > 3 else kw.get("seed")
    return bool(bufsize) and rng is None and seed is None


def _webdataset_group(pipeline, split: StreamSplit, group: int):
    import webdataset as wds

    copied = copy.deepcopy(pipeline)
    copied.pipeline = [
        _pass_through if _stage_function(stage) is wds.shardlists.single_node_only else stage
        for stage in copied.pipeline
    ]
    if split.sharded:
        shard_list = copied.pipeline[0]
        shard_list.urls = [shard_list.urls[index] for index in split.shards_of(group)]
    return copied


def _webdataset_epoch(pipeline, pass_: int) -> None:
    """detshuffle stages count their epochs per iteration: pass `p` is their epoch `p` (they add 1 first)."""
    import webdataset as wds

    for stage in pipeline.pipeline:
        if isinstance(stage, wds.filters.detshuffle):
            stage.epoch = pass_ - 1


def _refuse_rank_reading(cls) -> None:
    """ArgumentError if a method of the dataset's own classes reads the distributed rank or world size."""
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        if module.startswith(_LIBRARY_MODULES) or klass is object:
            continue
        for name, member in vars(klass).items():
            function = getattr(member, "__func__", member)
            if isinstance(function, property):
                function = function.fget
            code = getattr(function, "__code__", None)
            if code is not None:
                _refuse_rank_reading_code(code, f"{klass.__qualname__}.{name}")


def _refuse_rank_reading_code(code, where: str) -> None:
    pending = [code]
    while pending:
        current = pending.pop()
        names = set(current.co_names)
        constants = {value for value in current.co_consts if isinstance(value, str)}
        found = sorted((names & _RANK_NAMES) | (constants & _RANK_VARIABLES))
        if found:
            raise ArgumentError(
                f"dataset= reads the distributed rank itself ({where} uses {', '.join(found)}): remove that "
                "split and yield the whole stream; flexpar splits it by virtual worker, whatever the devices"
            )
        pending.extend(value for value in current.co_consts if isinstance(value, types.CodeType))
