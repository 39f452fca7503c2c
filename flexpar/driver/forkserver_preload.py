"""Imported by the fork server only (fork_server.worker_context): its children get SIGTERM back.

The fork server starts with SIGTERM blocked (fork_server._sigterm_held) and
ignores it from here on, so that a whole host's SIGTERM does not kill it.
Both are inherited by every child it forks, the user's own forkserver processes
included (Python's fork server is one per driver, shared with any
`get_context("forkserver")`): their `terminate()` would do nothing. So every
child forked from the fork server sets SIGTERM back to its default, then
unblocks it, before any of its own code runs: a SIGTERM sent to the child
before then (its launcher passing a SIGTERM on the moment it learned the
child's pid) was held, and ends the child now. flexpar's workers then install
their own handler (flexpar.worker.process.main).
"""

import os
import signal


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


signal.signal(signal.SIGTERM, signal.SIG_IGN)  # this is the fork server: deaf to SIGTERM (blocked since its start)
os.register_at_fork(after_in_child=_default_sigterm)
