"""A streaming job's data on one device: every VW stream of an iterable dataset and its committed position.

Where a map-style job's device owns a `VirtualWorkerLoader` (loader.py), a job
whose `dataset=` is an iterable one owns a `DataStreams`: the step's VWs read
their batches from it (`batch`), its positions commit with the step
(`commit`, from `StepLoop.commit_step`), and they are training state
(`capture`/`restore`, through `TrainingState`: a joiner receives them with the
state, blocking or streamed, and checkpoints hold them, so `--resume` on
another device count continues at the next item).

The reading is flexpar/data/streams.py's `VirtualWorkerStreams`, the split
flexpar/core/stream_split.py's.
"""

from __future__ import annotations

from typing import Callable, Optional

from flexpar.data import VirtualWorkerStreams, describe


class DataStreams:
    """The VW streams of an iterable dataset as this device reads them, and their positions.

    Invariant: this device reads every stream group of the split, whichever
    VWs it runs (it holds all `V` VWs in its reader and, at each `commit`,
    reads every group's chunk of the committed step, from memory where a VW
    of it ran here). So every device holding committed step `s` holds the
    position of every VW stream at the boundary before `s` (`reader.committed
    == s` after every `commit` and `restore`): a leave, the kill -9 of any
    member and a driver loss lose no position, a survivor's is the one every
    device would have, and a joiner or a checkpoint takes any member's
    (`capture`). The chunks read since the committed boundary stay in memory
    (`VirtualWorkerStreams`), so a step redone after a failure, or run again
    by the exact sums, reads the same items without reading the stream.

    The read cost of that choice: every device reads every item of the whole
    stream once (read amplification = the device count, for a sharded dataset
    too), and collates only its own VWs' batches. Reading is cheap next to a
    VW's forward and backward for the streams this is for; exchanging the
    positions at each commit instead would make a sharded dataset's reads 1.0
    and is not done yet.

    `ready_at`: the step the reader was last told to hold every VW from (None:
    not since the last load), so `hold` is asked once per step.
    """

    def __init__(self, job, say: Callable[[str], None] = lambda line: None, source=None):
        self.job = job
        self.say = say  # a line on the device's stderr: what reaching restored positions cost
        self.source = source if source is not None else describe(job.dataset)
        self.virtual_workers = job.virtual_workers
        self.reader = self._new_reader()
        self.ready_at: Optional[int] = None

    def _new_reader(self) -> VirtualWorkerStreams:
        job = self.job
        return VirtualWorkerStreams(
            job.dataset,
            job.virtual_workers,
            job.micro_batch_size,
            seed=job.seed,
            collate_fn=job.collate_fn,
            num_workers=job.num_workers,
            source=self.source,
        )

    def _ready(self, step: int) -> None:
        if self.ready_at != step:
            self.reader.hold(range(self.virtual_workers), step)
            self.ready_at = step

    def batch(self, step: int, virtual_worker: int):
        """The batch of `virtual_worker` at `step` (the loader's interface: StepRun reads it so)."""
        self._ready(step)
        return self.reader.batch(step, virtual_worker)

    def commit(self, step: int) -> None:
        """Step `step - 1` committed: every group advances past its chunk (read now where no VW of
        it ran here), and what came before the boundary `step` is forgotten."""
        self._ready(step - 1)
        for group in range(self.reader.split.groups):
            self.reader.items(step - 1, self.reader.split.members(group)[0])
        self.reader.commit(step)
        self.ready_at = None  # hold from `step` at the next batch (its groups' positions are known)

    def capture(self, step: int) -> dict:
        """The positions of every VW stream at the boundary before the committed step `step`."""
        self._ready(step)
        return self.reader.state(step=step, virtual_workers=range(self.virtual_workers))

    def restore(self, state: dict) -> None:
        """A peer's or a checkpoint's positions (their step is the committed step restored with them)."""
        step = int(state["step"])
        if step < self.reader.committed:  # an older state than this reader's: read it anew
            self.reader.close()
            self.reader = self._new_reader()
        self.reader.load(state)
        self.ready_at = None
        self.reader.restores.clear()
        self._ready(step)  # the skip (or the dataset's own load_state_dict) is paid here, in the boundary
        self.reader.commit(step)
        skipped = [restore for restore in self.reader.restores if restore.how == "skip"]
        if skipped:  # a dataset without a complete state: its positions were reached by reading
            items, seconds = sum(r.skipped for r in skipped), sum(r.seconds for r in skipped)
            self.say(
                f"stream positions of step {step}: {len(skipped)} of {self.reader.split.groups} stream groups "
                f"reached by skipping {items} items ({seconds:.2f} s; a dataset with a complete state_dict() "
                "loads its position instead)"
            )

    def close(self) -> None:
        """Close every stream read here (and its DataLoader processes)."""
        self.reader.close()
