"""A worker's part in evaluating the model at step boundaries (flexpar.evaluation)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flexpar.core import balance, evaluation
from flexpar.worker.device_link import DriverLost
from flexpar.worker import evaluator
from flexpar.comm.gradient_sync import PeerFailure, _collective, _wait


class WorkerEvaluation:
    """Part of `flexpar.worker.Worker` (its attributes are the worker's own; see there)."""

    # ------------------------------------------------------------ evaluation

    # (generation, committed step) of the last evaluation this device took part in. Every
    # member of a generation runs the same sequence, so this is agreed; a new generation
    # evaluates its first step boundary again if it is an evaluation's (the old one may
    # have broken off during it), and the driver keeps one record per step.
    _evaluated: tuple = (0, -1)
    _verdict_stop: str = ""  # a callback's on_eval stopped the job at the last evaluation

    def _evaluation_due(self, final: bool = False) -> bool:
        """Whether the model after `committed` steps is to be evaluated now.

        Every `eval_every` steps, after the last step, and (`final`) at a stop
        a callback asked for; a function of the committed step and the
        generation only, so every member reaches the same answer.
        """
        if self.job.evaluate is None or self.committed <= 0 or self._evaluated == (self.generation, self.committed):
            return False
        every = self.settings.eval_every
        return final or self.committed == self.settings.total_steps or bool(every and self.committed % every == 0)

    def evaluate(self, ask_driver: bool) -> str:
        """Evaluate the model after `committed` steps on this generation's devices.

        The devices split the evaluation set's chunks in proportion to the next
        step's VW assignment (their speeds; flexpar.evaluation), each sums its
        chunks' metrics, and one all-reduce adds the sums. Only then does the
        record exist: a failure before it completes leaves nothing published,
        and the next generation evaluates again. Every member keeps the record
        (a new rank 0 re-sends it); rank 0 publishes it. With `ask_driver`, the
        devices then wait for the driver's callbacks' verdict on it; returns
        the stop reason, or "".
        """
        step = self.committed
        started = time.perf_counter()
        keys = tuple(self.settings.eval_keys)
        shares = balance.next_assignment(self.balance_state, self.members, self.job.virtual_workers)
        samples = evaluation.sample_ranges(len(self.job.eval_dataset), shares, self.job.eval_batch_size)[self.rank]
        sums = evaluator.evaluate_samples(self.job, self.model, samples, keys, self.device)
        vector = torch.tensor(evaluation.metric_vector(sums, keys), dtype=torch.float64, device=self.device)
        self._fault_point("eval", step)  # tests: a death here breaks the all-reduce below
        if len(self.members) > 1:
            work = _collective(lambda: dist.all_reduce(vector, async_op=True))
            _wait(work, self._peer_lost)
        self._evaluated = (self.generation, step)
        record = {
            "kind": "eval", "step": step, "time": time.time(),
            "elapsed_s": 0.0,  # filled in by the driver, which knows the job's start
            "generation": self.generation, "devices": list(self.members),
            "eval_s": time.perf_counter() - started,
            "metrics": evaluation.metrics_of(vector.cpu().tolist(), keys),
        }
        self.recent_records.append(record)
        if self.rank == 0:
            self.link.publish(record)
        if not ask_driver:
            return ""
        self._verdict_stop = self._verdict(step)
        return self._verdict_stop

    def _verdict(self, step: int) -> str:
        """The driver's callbacks' word on the evaluation at `step`: a stop reason, or "" to go on.

        The driver writes it once, so every member reads the same. A peer that
        dies meanwhile makes this a failure (the next generation evaluates
        again and finds the verdict already there).
        """
        key = f"verdict/{step}"
        try:
            while not self.link.store.check([key]):
                self.link.check()
                lost = self._peer_lost()
                if lost:
                    raise PeerFailure(f"peer {lost} is gone (reported by the coordinator)")
                time.sleep(0.002)
            return self.link.store.get(key).decode()
        except RuntimeError as error:  # the store, hosted by the driver, is gone
            self.link.driver_lost = True
            raise DriverLost(f"the job's driver is gone ({str(error).splitlines()[0] if str(error) else error})") from None
