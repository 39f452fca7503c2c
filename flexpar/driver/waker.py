"""The thread that wakes the driver's loop when a device or a command sent something.

The loop (driver_loop.py) sleeps between its passes; `DriverWaker` ends that
sleep as soon as DRIVER_WAKE_KEY is set in the store (comm/protocol.py says who
sets it), so the loop reads what was sent without polling the store.
"""

from __future__ import annotations

import datetime
import threading

from flexpar.comm.protocol import DRIVER_WAKE_KEY
from flexpar.comm.store import connect


class DriverWaker:
    """A thread of the driver that waits in the store for DRIVER_WAKE_KEY and sets `woken`.

    TCPStore's `wait` answers when the key is set (the store's own server
    holds the waiter: no polling). The thread deletes the key before it sets
    the event, and writers bump DRIVER_NOTICE_KEY before they set the key, so
    no message is missed: one sent while the loop runs either moved the
    counter the loop reads next, or sets the key again. `close()` sets the key
    itself to let the thread end.
    """

    # A wait that long never times out in practice; if it does, the thread waits again on
    # a fresh connection (a client whose wait timed out may still get the late answer).
    _WAIT = datetime.timedelta(days=7)

    def __init__(self, host: str, port: int, timeout_s: float, store):
        self.store = store
        self.woken = threading.Event()
        self._closing = threading.Event()
        self._client = connect(host, port, timeout_s)
        self._thread = threading.Thread(
            target=self._run, args=(host, port, timeout_s), name="flexpar-waker", daemon=True
        )
        self._thread.start()

    def _run(self, host: str, port: int, timeout_s: float) -> None:
        client = self._client
        while not self._closing.is_set():
            try:
                client.wait([DRIVER_WAKE_KEY], self._WAIT)
                client.delete_key(DRIVER_WAKE_KEY)
            except RuntimeError:
                if self._closing.is_set():
                    return
                try:
                    client = connect(host, port, timeout_s)
                except RuntimeError:
                    return  # the store is gone: the driver is ending
            self.woken.set()

    def close(self) -> None:
        self._closing.set()
        try:
            self.store.set(DRIVER_WAKE_KEY, "1")
        except RuntimeError:
            pass
        self._thread.join(timeout=5.0)
