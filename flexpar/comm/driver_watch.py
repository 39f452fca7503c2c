"""A device's cheap look at whether its driver's process has ended: one idle connection to the store's port.

A device learns that its driver is gone when a store call fails. Its
follower thread makes one every 20 ms, but only when it gets the CPU: on a
loaded host (or under a busy main thread holding the GIL) it was seen to
run late enough that the members trained 3-6 steps past a dead driver, and
a fault aimed at the restarted driver then hit the dead one. A store call
from the step loop itself would bound that, at a round trip per step that
waits on the driver's store thread, which a loaded host schedules late too.

`DriverWatch` holds one more TCP connection to the store's port and never
sends on it (TCPStore never sends unsolicited, so it stays silent while the
driver lives; no bytes, no protocol of flexpar's own). When the driver's
process ends, the kernel closes its sockets and this one turns readable
(EOF or a reset): `closed()` sees it with one `poll` of the socket, about a
microsecond, with no store call and no other thread. A host that vanishes
closes nothing: that is noticed within the store's timeout, as before.
"""

from __future__ import annotations

import select
import socket


class DriverWatch:
    """An idle connection to the driver's store at `host:port`; `closed()` once the driver's end closed it.

    A connection that cannot be made counts as closed (the driver is gone
    already). The caller confirms a close with a store call before it acts
    on it (`DeviceLink.driver_gone_now`): a connection closed by anything
    else (a middlebox) must not stop a job whose driver lives.
    """

    def __init__(self, host: str, port: int, timeout_s: float):
        self._socket = None
        self._poll = select.poll()
        try:
            self._socket = socket.create_connection((host, port), timeout=timeout_s)
        except OSError:
            return
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a silent path's state stays alive
        self._socket.setblocking(False)
        self._poll.register(self._socket, select.POLLIN)

    def closed(self) -> bool:
        """Whether the driver's end closed the connection (or it could not be made): no wait, no store call."""
        if self._socket is None:
            return True
        if not self._poll.poll(0):
            return False
        try:
            return self._socket.recv(1, socket.MSG_PEEK) == b""  # EOF; data would be a store's (never sent)
        except BlockingIOError:
            return False
        except OSError:  # reset: the driver's process ended with the connection unread
            return True

    def close(self) -> None:
        if self._socket is not None:
            self._poll.unregister(self._socket)
            self._socket.close()
            self._socket = None
