"""A job whose workers' loaders serve a stale batch, for the sample ledger's tests.

`StaleBatchLoss` is an ordinary loss; unpickling it in a worker process (the
job travels to the workers pickled) makes that process's loaders load, at
step STALE_STEP, the samples of the step before, under the right data seed,
while the plan (and `batching`) still name the right ones. This is the bug the
ledger must see: a ledger derived from the plan would call the run clean.
The test process itself is never patched (it is no multiprocessing child).
"""

from __future__ import annotations

import multiprocessing

import pieces

from flexpar.worker.loader import VirtualWorkerLoader

STALE_STEP = 3


class StaleBatchLoss(pieces.Loss):
    def __reduce__(self):
        return _stale_loss_in_a_worker, (self.delay_s,)


def _stale_loss_in_a_worker(delay_s: float) -> StaleBatchLoss:
    if multiprocessing.parent_process() is not None:
        _serve_the_previous_steps_samples_at(STALE_STEP)
    return StaleBatchLoss(delay_s)


def _serve_the_previous_steps_samples_at(stale_step: int) -> None:
    if getattr(VirtualWorkerLoader, "_stale_patch", False):
        return
    requests = VirtualWorkerLoader._requests

    def stale_requests(self, step, first_virtual_worker):
        for request in requests(self, step, first_virtual_worker):
            issued_step, virtual_worker = self._issued[-1]
            if issued_step == stale_step:
                previous = self._step_indices(stale_step - 1)[virtual_worker]
                request = [(seed, int(index)) for (seed, _), index in zip(request, previous)]
            yield request

    VirtualWorkerLoader._requests = stale_requests
    VirtualWorkerLoader._stale_patch = True
