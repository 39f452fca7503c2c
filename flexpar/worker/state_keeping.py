"""A worker's training state: captured for peers and checkpoints, restored, written off the step loop.

The state is the model, optimizer and scheduler plus what must travel with
them (balancing, fp16 loss scale, cost rates, the last step records):
`TrainingState` captures and restores it. `Checkpoints` writes it: a
background thread (flexpar.worker.checkpoints) writes the file, so the step
loop pays only for an in-memory copy. When the driver is lost, the device
that was rank 0 writes the last committed step, or every survivor does where
rank 0 may have gone too (`Checkpoints.rescue`)."""

from __future__ import annotations

from typing import Callable, Optional

from flexpar.comm import state_transfer as training_state
from flexpar.core import frozen
from flexpar.errors import UserCodeError
from flexpar.worker import checkpoints


def is_peft(model) -> bool:
    """A peft model (duck-typed: flexpar does not import peft): export writes its adapter too."""
    return type(model).__module__.startswith("peft") and hasattr(model, "peft_config")


class TrainingState:
    """What a device hands on and takes: its training state as one dict, and back.

    It holds no state of its own: the pieces are their owners' (the model,
    optimizer and scheduler; the committed step, `CommittedStep`; the
    records, `RecordQueue`; the loss scaler, cost rates and exact-sum
    exponents). A capture is of the committed step; a restore replaces every
    piece at once with a peer's or a checkpoint's.
    """

    def __init__(self, job, training, committed, records, cost_planner, data_streams=None):
        self.job = job
        self.data_streams = data_streams  # an iterable dataset's VW streams (data_streams.py), else None
        self.model, self.optimizer, self.scheduler = training.model, training.optimizer, training.scheduler
        self.frozen = training.frozen
        self.committed = committed
        self.records = records
        self.scaler, self.cost_planner, self.exact = training.scaler, cost_planner, training.exact

    def capture(self, checkpoint_settings=None) -> dict:
        """The whole state; `checkpoint_settings` (the run's settings) when it is for a checkpoint
        (`Checkpoints.write` adds the frozen parameters after the copy where checkpoint_frozen)."""
        model_state = self.model_state()
        extra = self.capture_extra(checkpoint_settings, model_state)
        return training_state.capture(
            self.model, self.optimizer, self.scheduler, self.committed.step, extra, model_state
        )

    def capture_extra(self, checkpoint_settings=None, model_state: Optional[dict] = None) -> dict:
        """What travels with the model and optimizer: balancing, commit time, records, loss scale, rates.

        For a checkpoint, also its frozen entry: the digests, how to rebuild the
        model, and whether the file holds the whole state_dict (`complete`:
        `checkpoint_frozen`, or nothing frozen and no buffer left out), so that
        export needs the factory only when some weight must be rebuilt.
        """
        extra = {**self.committed.extra(), "recent_records": self.records.to_json()}
        if self.scaler is not None:  # fp16: the loss scale travels to joiners and into checkpoints
            extra["grad_scaler"] = self.scaler.state_dict()
        if self.cost_planner is not None:  # by cost: joiners plan with the same rates
            extra["cost_rates"] = self.cost_planner.state()
        if self.exact is not None:  # Job(deterministic=True): the exact sums' exponents are training state
            extra["exact_sum"] = self.exact.state_dict()
        if self.data_streams is not None:  # a streaming job: every VW stream's position at the committed step
            extra["data_streams"] = self.data_streams.capture(self.committed.step)
        if checkpoint_settings is not None:  # what resume and export check the factory's rebuild against
            whole = model_state is not None and set(self.model.state_dict()) <= set(model_state)
            extra["frozen"] = self.frozen.checkpoint_entry(
                checkpoint_settings.checkpoint_frozen or whole,
                checkpoint_settings.model_factory,
                self.job.seed,
                is_peft(self.model),
            )
        return extra

    def model_state(self) -> dict:
        """The model part of every state this device hands on (joiner, checkpoint, result): no frozen weights.

        The one place a capture's model part is decided (sharded or not).
        """
        return self.frozen.travelling(self.model)

    def restore(self, state: dict) -> None:
        """A peer's or a checkpoint's whole state (a checkpoint's frozen part checked against this model's)."""
        extra = state.get("extra") or {}
        recorded = (extra.get("frozen") or {}).get("digests")
        if recorded is not None:  # a checkpoint: its frozen part must be the one this factory built
            problem = frozen.frozen_problem(self.frozen.digests, recorded, where="the checkpoint")
            if problem:
                raise UserCodeError(f"{problem}; resume with the same model factory and pretrained files")
        training_state.restore(self.model, self.optimizer, self.scheduler, state, load_model=self.frozen.load)
        self.restore_extra(state)

    def restore_extra(self, state: dict) -> None:
        """The committed step and what `capture_extra` captured."""
        extra = state.get("extra") or {}
        self.committed.restore(int(state["step"]), extra)
        self.records.load_json(extra.get("recent_records", "[]"))
        if self.scaler is not None and "grad_scaler" in extra:
            self.scaler.load_state_dict(extra["grad_scaler"])
        if self.cost_planner is not None and "cost_rates" in extra:
            self.cost_planner.restore(extra["cost_rates"])
        if self.exact is not None and "exact_sum" in extra:
            self.exact.load_state_dict(extra["exact_sum"])
        if self.data_streams is not None:
            if "data_streams" not in extra:
                raise UserCodeError(
                    f"the state of step {state['step']} holds no stream positions (a checkpoint of a job "
                    "over a map-style dataset?): a streaming job resumes only from its own checkpoints"
                )
            self.data_streams.restore(extra["data_streams"])


class Checkpoints:
    """This device's checkpoint writes: the background writer, and what it last wrote.

    Invariant: `written` is the (folder, step) of this device's last write
    (a second write of the same step to the same folder is the same state,
    and is skipped); `writer` exists from the first write on, and at most one
    write is in flight (the next waits for it). The committed step written is
    `state.committed.step`; the device set it writes for is passed with
    every call.
    """

    def __init__(self, state: TrainingState, shards, faults, say: Callable[[str], None]):
        self.state = state
        self.shards = shards
        self.faults = faults
        self.say = say
        self.writer: Optional[checkpoints.CheckpointWriter] = None
        self.written: tuple = ()

    def writer_now(self, settings) -> checkpoints.CheckpointWriter:
        if self.writer is None:
            self.writer = checkpoints.CheckpointWriter(keep=settings.keep_checkpoints)
        return self.writer

    def wait(self) -> None:
        """Return once no checkpoint write is in flight (a failed one is said here, not raised: exiting)."""
        if self.writer is None:
            return
        try:
            self.writer.wait()
        except RuntimeError as error:
            self.say(str(error))

    def maybe(self, settings, rank: int, members: tuple) -> None:
        """Every `checkpoint_every` steps, and always after the last step."""
        every, step = settings.checkpoint_every, self.state.committed.step
        if every and (step % every == 0 or step == settings.total_steps):
            self.write(settings, settings.checkpoint_dir, rank, members)

    def write(self, settings, directory: str, rank: int, members: tuple, parts=None, common=None) -> str:
        """Start writing the committed state to `directory`; returns the file's path.

        The step loop pays for a CPU copy of the state only; a background
        thread writes the file (atomically) and keeps the newest
        `keep_checkpoints` (flexpar.worker.checkpoints). A write in flight is waited
        for before the next one starts, in `Worker.finish`, on the rescue path and
        before the process exits.
        """
        step = self.state.committed.step
        path = checkpoints.checkpoint_path(directory, step)
        self.faults.fire("checkpoint", step, members)
        # This device wrote this step here already (the last step, then the stop): the same state.
        # A file that is there for any other reason (an earlier try of this run) is replaced, never kept.
        if self.written == (directory, step):
            return path
        writer = self.writer_now(settings)
        if self.shards is not None:
            files = self._sharded_files(settings, directory, rank, parts, common)
            # The common file's writer removes an earlier partition's parts of this step once it is in place.
            writes_common = any(path == checkpoints.checkpoint_path(directory, step) for path, _ in files)
            partition = self.shards.partition.world_size if writes_common else None
            writer.submit_files(directory, step, checkpoints.cpu_copy(files), other_partitions=partition)
        else:
            state = checkpoints.cpu_copy(self.state.capture(checkpoint_settings=settings))
            if settings.checkpoint_frozen:
                # The frozen parameters never change: the writer thread serialises the live
                # tensors, so the step loop copies only what trains (and the small buffers).
                state["model"] = self.state.frozen.complete(self.state.model, state["model"])
            writer.submit(directory, step, state)
        self.written = (directory, step)
        return path

    def _sharded_files(self, settings, directory: str, rank: int, parts=None, common=None) -> list:
        """[(path, state)] of a sharded job's checkpoint that this device writes.

        By default each device writes the part of the chunks it is primary of
        (`step-N.optimizer/part-I-of-K.pt`: per chunk, its parameters' ranges
        and their state, by torch.optim's parameter numbers), and rank 0 also
        the common file `step-N.pt` (the whole model, the param groups, the
        replicated parameters' optimizer state, the scheduler, step and extras):
        no device ever holds the whole optimizer state, and any partition reads
        any other (flexpar/worker/checkpoints.py's `CheckpointReader`).
        """
        shards, step = self.shards, self.state.committed.step
        layout = shards.partition
        parts = (rank,) if parts is None else parts
        files = []
        for index in sorted(parts):
            segments = [
                {"parameter": shards.number_of(k), "start": start, "stop": stop, "state": state}
                for chunk in layout.chunks
                if chunk.index == index
                for (k, start, stop), state in shards.pieces_of([(chunk.space, chunk.start, chunk.stop)], False)
            ]
            record = {"step": step, "part": index, "parts": layout.world_size, "segments": segments}
            files.append((checkpoints.part_path(directory, step, index, layout.world_size), record))
        if rank == 0 if common is None else common:
            replicated = shards.replicated_state()["optimizer"]
            shapes = {
                shards.number_of(k): list(shards.parameters[index].shape) for k, index in enumerate(shards.sharded)
            }
            # "parts": which partition's part files belong to this step-N.pt (checkpoints.complete_parts).
            optimizer = {**replicated, "sharded": {"by": shards.by, "shapes": shapes, "parts": layout.world_size}}
            scheduler = self.state.scheduler.state_dict() if self.state.scheduler is not None else None
            model_state = self.state.model_state()
            common_state = {"model": model_state, "optimizer": optimizer, "scheduler": scheduler}
            extra = self.state.capture_extra(settings, model_state)
            files.append((checkpoints.checkpoint_path(directory, step), {**common_state, "step": step, "extra": extra}))
        return files

    def rescue(self, settings, agreed: bool, rank: int, members: tuple) -> str:
        """The driver is gone: write the last committed step where a resume finds it; returns where it is.

        `agreed`: the members stopped together in a step (every one of them is
        alive and holds it), so rank 0 alone writes. Otherwise a collective
        failed as well (rank 0 may have gone with the driver, as when the
        driver's host dies), and with the store gone no survivor can learn
        which others are alive: each one writes what it committed. On a shared
        folder that is one file per step (each writer renames its own
        temporary file into place); on separate hosts each keeps its own copy.
        Written at once, not when the wait for a restarted driver ends: should
        every device die meanwhile, the step is on disk.
        """
        directory = settings.checkpoint_dir or settings.rescue_dir
        if self.shards is not None and self.shards.partition is not None:
            # Sharded: agreed, every member writes its part (rank 0 the common file too); otherwise
            # every survivor writes every part it holds, and the common file if its parameters are whole.
            held = {chunk.index for chunk in self.shards.partition.held_by(rank)}
            path = self.write(
                settings,
                directory,
                rank,
                members,
                parts=None if agreed else held,
                common=None if agreed else self.shards.values_complete,
            )
            self.wait()
        elif rank == 0 or not agreed:
            path = self.write(settings, directory, rank, members)
            self.wait()
            return path
        path = checkpoints.checkpoint_path(directory, self.state.committed.step)
        return path + (f" (written by {members[0]})" if members else "")
