"""Who trains in which generation: membership decisions of the control plane, as pure data.

`decide(state, event) -> (state, actions)` (decide.py, with the rules) is the
whole policy (scale requests are answered in scaling.py); events and
actions are events.py's. This package's face is
what the coordinator and the tests call: `from flexpar.core import membership
as ms; ms.decide(ms.Membership(...), ms.Start(2))`.
"""

from flexpar.core.membership import events
from flexpar.core.membership.decide import NO_DEVICE_STARTED, STOPPED_BEFORE_START, decide
from flexpar.core.membership.events import *  # noqa: F403  (the events and actions: events.__all__)
from flexpar.core.membership.state import Membership, id_order

__all__ = ["NO_DEVICE_STARTED", "STOPPED_BEFORE_START", "Membership", "decide", "id_order", *events.__all__]
