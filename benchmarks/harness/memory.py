"""Peak resident memory of processes, from the kernel's high-water mark (VmHWM in /proc)."""

from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional

from .processes import workers


def peak_rss_bytes(pid: int) -> Optional[int]:
    """The largest resident memory `pid` has had (VmHWM), in bytes; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemoryWatcher:
    """Context manager: `peaks` maps each worker pid seen to its largest VmHWM in bytes.

    A background thread in this process reads every worker's VmHWM (monotonic
    over a process's life) every `interval_s` and keeps the largest; it finds
    the workers (`processes.workers`: this process's descendants but
    multiprocessing's helpers) at every read until it has found some, then
    every WALK_EVERY reads, since a high-water mark read late is not lower.
    The last value read before a worker exits misses at most the growth of its
    last `interval_s`.
    """

    WALK_EVERY = 10  # reads of the workers' VmHWM per walk of the process tree

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.peaks: Dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        # Once workers are found, the process tree is walked every WALK_EVERY reads only
        # (workers live for the whole fit, and a high-water mark found late is not lower):
        # walking it every 50 ms cost about 1% of a core, taken from the flexpar side only,
        # which computes on every core. Until then it is walked at every read: the workers of
        # a --quick run live well under WALK_EVERY reads, and were missed.
        driver = os.getpid()
        found: List[int] = []
        reads = 0
        while not self._stop.is_set():
            if not found or reads % self.WALK_EVERY == 0:
                found = workers(driver)
            reads += 1
            for pid in found:
                peak = peak_rss_bytes(pid)
                if peak is not None:
                    self.peaks[pid] = max(peak, self.peaks.get(pid, 0))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakMemoryWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def largest(self) -> Optional[int]:
        """The largest peak of any worker seen; None if none was."""
        return max(self.peaks.values()) if self.peaks else None
