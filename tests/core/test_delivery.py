"""flexpar.core.delivery: each record delivered once however often, and in whatever order, it arrives."""

from hypothesis import given
from hypothesis import strategies as st

from flexpar.core.delivery import Delivery, identity, unacknowledged


def step(number: int) -> dict:
    return {"kind": "step", "step": number, "time": 100.0 + number, "generation": 1}


def evaluation(number: int) -> dict:
    return {"kind": "eval", "step": number, "time": 200.0 + number, "generation": 1}


def event(name: str, number: int, generation: int, time: float) -> dict:
    return {"kind": "event", "event": name, "step": number, "generation": generation, "time": time}


def the_run(steps: int) -> list:
    """What a job's devices publish, in order: a start event, an evaluation every 3 steps, the steps."""
    records = [event("start", 0, 1, 1.0)]
    for number in range(steps):
        if number and number % 3 == 0:
            records.append(evaluation(number))
        records.append(step(number))
    return records


@given(
    steps=st.integers(min_value=1, max_value=30),
    resends=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=6),
    written=st.integers(min_value=0, max_value=40),
)
def test_each_record_is_delivered_once_whatever_is_sent_again(steps, resends, written):
    """A driver that wrote the first `written` records before it died, and arrivals that repeat any
    stretch of them (a new rank 0, a re-adoption, a resume), deliver every record exactly once."""
    records = the_run(steps)
    arrivals = list(records)
    for start, length in resends:
        arrivals[start:start] = records[start : start + length]
    file = records[: min(written, len(records))]
    delivery = Delivery.of_records(file)
    delivered = list(file)
    for record in arrivals:
        if delivery.is_new(record):
            delivery.add(record)
            delivered.append(record)
    assert sorted(map(identity, delivered)) == sorted(map(identity, records))
    assert len(delivered) == len(records)
    assert delivery.acknowledged() == steps - 1


def test_the_acknowledged_step_stops_at_the_first_missing_one_and_the_devices_keep_what_follows():
    delivery = Delivery.of_records([step(0), step(1), evaluation(2), step(3)])
    assert delivery.acknowledged() == 1  # step 2's record never came: the devices keep it
    kept = [evaluation(2), step(2), event("rebalance", 3, 1, 5.0), step(3), step(4)]
    assert unacknowledged(kept, delivery.acknowledged()) == kept
    delivery.add(step(2))
    assert delivery.acknowledged() == 3
    assert unacknowledged(kept, delivery.acknowledged()) == [step(4)]


def test_an_evaluation_of_a_step_again_and_an_event_sent_again_are_not_new():
    """A generation evaluates a step again (a new record, same step); a kept event sent again is the same
    dict; two events of one kind at one step with different times are two events."""
    delivery = Delivery.of_records([evaluation(4), event("join", 4, 2, 7.5)])
    assert not delivery.is_new(dict(evaluation(4), time=999.0, generation=3))
    assert not delivery.is_new(event("join", 4, 2, 7.5))
    assert delivery.is_new(event("join", 4, 2, 8.5))
    assert delivery.acknowledged() == -1
