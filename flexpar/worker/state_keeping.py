"""A worker's training state: captured for peers and checkpoints, restored, written off the step loop.

The state is the model, optimizer and scheduler plus what must travel with
them (balancing, fp16 loss scale, cost rates, the last step records); a
checkpoint is written by a background thread (flexpar.worker.checkpoints) so the
step loop pays only for an in-memory copy. When the driver is lost, the
device that was rank 0 writes the last committed step, or every survivor
does where rank 0 may have gone too (`_write_rescue`)."""

from __future__ import annotations

from typing import Optional

from flexpar.comm import state_transfer as training_state
from flexpar.core import frozen
from flexpar.errors import UserCodeError
from flexpar.worker import checkpoints


def is_peft(model) -> bool:
    """A peft model (duck-typed: flexpar does not import peft): export writes its adapter too."""
    return type(model).__module__.startswith("peft") and hasattr(model, "peft_config")


class WorkerCheckpoints:
    """Part of `flexpar.worker.Worker` (its attributes are the worker's own; see there)."""

    # ------------------------------------------------------------ state

    def _capture(self, for_checkpoint: bool = False) -> dict:
        # checkpoint_frozen: `_write_checkpoint` adds the frozen parameters after the copy.
        model_state = self._model_state_for_transfer()
        extra = self._capture_extra(for_checkpoint, model_state)
        return training_state.capture(
            self.model, self.optimizer, self.scheduler, self.committed.step, extra, model_state
        )

    def _capture_extra(self, for_checkpoint: bool = False, model_state: Optional[dict] = None) -> dict:
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
        if for_checkpoint:  # what resume and export check the factory's rebuild against
            whole = model_state is not None and set(self.model.state_dict()) <= set(model_state)
            extra["frozen"] = self.frozen.checkpoint_entry(
                self.settings.checkpoint_frozen or whole,
                self.settings.model_factory,
                self.job.seed,
                is_peft(self.model),
            )
        return extra

    def _model_state_for_transfer(self) -> dict:
        """The model part of every state this device hands on (joiner, checkpoint, result): no frozen weights.

        The one place a capture's model part is decided (the name agreed with issue 27's sharding).
        """
        return self.frozen.travelling(self.model)

    def _restore(self, state: dict) -> None:
        extra = state.get("extra") or {}
        recorded = (extra.get("frozen") or {}).get("digests")
        if recorded is not None:  # a checkpoint: its frozen part must be the one this factory built
            problem = frozen.frozen_problem(self.frozen.digests, recorded, where="the checkpoint")
            if problem:
                raise UserCodeError(f"{problem}; resume with the same model factory and pretrained files")
        training_state.restore(self.model, self.optimizer, self.scheduler, state, load_model=self.frozen.load)
        self._restore_extra(state)

    def _restore_extra(self, state: dict) -> None:
        """The committed step and what `_capture_extra` captured."""
        extra = state.get("extra") or {}
        self.committed.restore(int(state["step"]), extra)
        self.records.load_json(extra.get("recent_records", "[]"))
        if self.scaler is not None and "grad_scaler" in extra:
            self.scaler.load_state_dict(extra["grad_scaler"])
        if self.cost_planner is not None and "cost_rates" in extra:
            self.cost_planner.restore(extra["cost_rates"])
        if self.exact is not None and "exact_sum" in extra:
            self.exact.load_state_dict(extra["exact_sum"])

    def _maybe_checkpoint(self) -> None:
        """Every `checkpoint_every` steps, and always after the last step."""
        every = self.settings.checkpoint_every
        if every and (self.committed.step % every == 0 or self.committed.step == self.settings.total_steps):
            self._write_checkpoint(self.settings.checkpoint_dir)

    def _write_checkpoint(self, directory: str, parts=None, common=None) -> str:
        """Start writing the committed state to `directory`; returns the file's path.

        The step loop pays for a CPU copy of the state only; a background
        thread writes the file (atomically) and keeps the newest
        `keep_checkpoints` (flexpar.worker.checkpoints). A write in flight is waited
        for before the next one starts, in `finish`, on the rescue path and
        before the process exits.
        """
        path = checkpoints.checkpoint_path(directory, self.committed.step)
        self.faults.fire("checkpoint", self.committed.step, self.members)
        # This device wrote this step here already (the last step, then the stop): the same state.
        # A file that is there for any other reason (an earlier try of this run) is replaced, never kept.
        if self._checkpoint_written == (directory, self.committed.step):
            return path
        writer = self._checkpoint_writer_now()
        if self.shards is not None:
            files = self._sharded_checkpoint_files(directory, parts, common)
            writer.submit_files(directory, self.committed.step, checkpoints.cpu_copy(files))
        else:
            state = checkpoints.cpu_copy(self._capture(for_checkpoint=True))
            if self.settings.checkpoint_frozen:
                # The frozen parameters never change: the writer thread serialises the live
                # tensors, so the step loop copies only what trains (and the small buffers).
                state["model"] = self.frozen.complete(self.model, state["model"])
            writer.submit(directory, self.committed.step, state)
        self._checkpoint_written = (directory, self.committed.step)
        return path

    _checkpoint_written: tuple = ()  # (folder, step) of this device's last checkpoint write

    def _sharded_checkpoint_files(self, directory: str, parts=None, common=None) -> list:
        """[(path, state)] of a sharded job's checkpoint that this device writes.

        By default each device writes the part of the chunks it is primary of
        (`step-N.optimizer/part-I-of-K.pt`: per chunk, its parameters' ranges
        and their state, by torch.optim's parameter numbers), and rank 0 also
        the common file `step-N.pt` (the whole model, the param groups, the
        replicated parameters' optimizer state, the scheduler, step and extras):
        no device ever holds the whole optimizer state, and any partition reads
        any other (flexpar/worker/checkpoints.py's `CheckpointReader`).
        """
        shards, step = self.shards, self.committed.step
        layout = shards.partition
        parts = (self.rank,) if parts is None else parts
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
        if self.rank == 0 if common is None else common:
            replicated = shards.replicated_state()["optimizer"]
            shapes = {
                shards.number_of(k): list(shards.parameters[index].shape) for k, index in enumerate(shards.sharded)
            }
            optimizer = {**replicated, "sharded": {"by": shards.by, "shapes": shapes}}
            scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
            model_state = self._model_state_for_transfer()
            common_state = {"model": model_state, "optimizer": optimizer, "scheduler": scheduler}
            extra = self._capture_extra(for_checkpoint=True, model_state=model_state)
            files.append((checkpoints.checkpoint_path(directory, step), {**common_state, "step": step, "extra": extra}))
        return files

    _checkpoint_writer: Optional[checkpoints.CheckpointWriter] = None

    def _checkpoint_writer_now(self) -> checkpoints.CheckpointWriter:
        if self._checkpoint_writer is None:
            self._checkpoint_writer = checkpoints.CheckpointWriter(keep=self.settings.keep_checkpoints)
        return self._checkpoint_writer

    def wait_for_checkpoint(self) -> None:
        """Return once no checkpoint write is in flight (a failed one is said here, not raised: exiting)."""
        if self._checkpoint_writer is None:
            return
        try:
            self._checkpoint_writer.wait()
        except RuntimeError as error:
            self._say(str(error))

    def _write_rescue(self, agreed: bool) -> str:
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
        directory = self.settings.checkpoint_dir or self.settings.rescue_dir
        if self.shards is not None and self.shards.partition is not None:
            # Sharded: agreed, every member writes its part (rank 0 the common file too); otherwise
            # every survivor writes every part it holds, and the common file if its parameters are whole.
            held = {chunk.index for chunk in self.shards.partition.held_by(self.rank)}
            path = self._write_checkpoint(
                directory,
                parts=None if agreed else held,
                common=None if agreed else self.shards.values_complete,
            )
            self.wait_for_checkpoint()
        elif self.rank == 0 or not agreed:
            path = self._write_checkpoint(directory)
            self.wait_for_checkpoint()
            return path
        path = checkpoints.checkpoint_path(directory, self.committed.step)
        return path + (f" (written by {self.members[0]})" if self.members else "")
