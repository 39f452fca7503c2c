"""The coordinator at the job's end: the members' exits after their last step are no failures.

Soak seed 253, run 27 (3 devices, sharded, two joiners scheduled late): a
joiner became ready after the members' last step boundary and was put in a
generation the members never formed; their normal exits then counted as
failures of all three, the recovery published a generation of the joiner
alone, and its levelling said the optimizer state was lost. Each member now
says "finished" before its process exits, and the coordinator reads what an
ended process sent before it counts the exit.
"""

import json

from flexpar.comm.channel import Channel
from flexpar.comm.store import connect
from flexpar.core import membership as ms
from flexpar.driver.coordinator import Coordinator


def _coordinator(store, exits: list) -> Coordinator:
    state = ms.Membership(initial_devices=3, max_devices=5, grace_s=30.0, hand_off=True)
    coordinator = Coordinator(
        store,
        secret="s",
        salt="salt",
        job_digest="d",
        version="v",
        state=state,
        spawn_local=lambda device_ids: None,
        stop_local=lambda device_id: None,
        local_exits=lambda: [exits.pop() for _ in range(len(exits))],
        on_note=lambda line: None,
    )
    coordinator.apply(ms.Start(3))
    for device in ("local-0", "local-1", "local-2"):
        coordinator.apply(ms.Ready(device))
    for device in ("local-0", "local-1", "local-2"):
        coordinator.apply(ms.Formed(device, 1))
    return coordinator


def test_members_that_finished_and_exited_leave_no_generation_to_a_late_joiner():
    store = connect("127.0.0.1", 0, 5.0, server=True)
    exits: list = []
    coordinator = _coordinator(store, exits)
    coordinator.apply(ms.ScaleBy(1))
    coordinator.apply(ms.Ready("local-3"))  # ready just after the members' last step boundary
    assert [action.members for action in coordinator.published][-1] == ("local-0", "local-1", "local-2", "local-3")
    events = Channel(store, "events")
    for device, rank in (("local-1", 1), ("local-2", 2), ("local-0", 0)):
        events.send({"type": "finished", "device_id": device, "rank": rank})
    exits += ["local-1", "local-2", "local-0"]
    # receive=False: the driver's notice counter did not move since its last reading, yet the exits
    # must not be counted before the messages their processes sent.
    coordinator.step(receive=False)
    # The joiner met dead peers in generation 2 and reports its failure, as a worker does.
    events.send({"type": "failure", "device_id": "local-3", "generation": 2, "step": -1, "error": "peer died"})
    coordinator.step()
    coordinator.step()
    assert coordinator.state.generation == 2 and json.loads(store.get("gen/latest")) == 2
    assert coordinator.stop_reason is None and not store.check(["stop"])
    assert coordinator.state.ended and coordinator.state.rank_0_gone  # the driver reads "done" now
