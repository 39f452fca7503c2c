"""Callbacks: called in the driver, in step order, once per record; STOP ends the job cleanly."""

import os

import evaluation_pieces as ep
import pieces
import pytest

import flexpar
from flexpar.callbacks import CALLBACK_STOP, Callback, Dispatcher, check_callbacks
from flexpar.observe.trackers import CSVTracker


def test_callbacks_are_checked():
    class Nothing:
        pass

    with pytest.raises(TypeError, match="none of the methods"):
        check_callbacks([Nothing()])
    with pytest.raises(TypeError, match="pass an instance"):
        check_callbacks([ep.Recorder])
    with pytest.raises(TypeError, match="list of callback"):
        check_callbacks(ep.Recorder())
    with pytest.raises(TypeError, match="none of the methods"):
        flexpar.FitOptions(steps=1, callbacks=[object()])
    assert check_callbacks(None) == ()


def test_stop_is_one_value_and_a_stop_is_a_reason():
    import pickle

    assert pickle.loads(pickle.dumps(flexpar.STOP)) is flexpar.STOP
    dispatcher = Dispatcher([ep.Recorder(stop_hook="on_step", stop_step=2)])
    assert dispatcher.call("on_step", {"step": 1}) is None
    reason = dispatcher.call("on_step", {"step": 2})
    assert reason.startswith(CALLBACK_STOP) and "Recorder.on_step at step 2" in reason
    assert dispatcher.stop_reason == reason


def test_only_a_callbacks_own_on_eval_makes_the_devices_wait_for_a_verdict():
    class StepsOnly(Callback):
        def on_step(self, record):
            pass

    assert not Dispatcher([StepsOnly()]).can_stop_at_eval
    assert Dispatcher([ep.Recorder()]).can_stop_at_eval
    assert not Dispatcher([CSVTracker.__new__(CSVTracker)]).can_stop_at_eval  # trackers never stop


class StoppingTracker(CSVTracker):
    """A tracker that also stops the job at an evaluation: its own on_eval, below Tracker's never_stops."""

    def on_eval(self, record):
        super().on_eval(record)
        return flexpar.STOP if record["step"] == 6 else None


def test_an_overridden_on_eval_counts_even_below_never_stops():
    from flexpar.callbacks import vouched_never_stops

    class StillQuiet(CSVTracker):
        never_stops = True  # it says so for its own on_eval

        def on_eval(self, record):
            super().on_eval(record)

    class StepsOnlyTracker(CSVTracker):
        def on_step(self, record):
            pass

    stopping = StoppingTracker.__new__(StoppingTracker)
    assert not vouched_never_stops(stopping) and Dispatcher([stopping]).can_stop_at_eval
    assert not Dispatcher([StillQuiet.__new__(StillQuiet)]).can_stop_at_eval
    assert not Dispatcher([StepsOnlyTracker.__new__(StepsOnlyTracker)]).can_stop_at_eval
    quiet = ep.Recorder()
    quiet.never_stops = True  # an instance's word covers the instance
    assert not Dispatcher([quiet]).can_stop_at_eval


def test_a_tracker_subclass_that_stops_at_an_evaluation_stops_exactly(train, tmp_path):
    """Its STOP from on_eval is exact (the devices wait for the verdict), as any callback's."""
    job = ep.make_job(virtual_workers=4, eval_batch=50)
    model, summary = train(job, steps=40, devices=2, eval_every=3, callbacks=[StoppingTracker(str(tmp_path))])
    assert summary["steps"] == 6 and "StoppingTracker.on_eval at step 6" in summary["stopped"]
    pieces.assert_same_parameters(model, pieces.reference(job, 6))


def test_callbacks_see_every_step_once_and_in_order_across_a_failure(train):
    recorder = ep.Recorder()
    job = ep.make_job(virtual_workers=4, eval_batch=50)
    model, summary = train(job, steps=12, devices=2, eval_every=5, faults="7:local-1:backward", callbacks=[recorder])
    assert [record["step"] for record in recorder.of("on_step")] == list(range(12))
    assert [record["step"] for record in recorder.of("on_eval")] == [5, 10, 12]
    events = [record["event"] for record in recorder.of("on_event")]
    assert events[0] == "start" and "failure" in events
    # In step order: each record comes after the steps before it.
    order = [(hook, record["step"]) for hook, record in recorder.calls if hook != "on_end"]
    last_step = -1
    for hook, step in order:
        if hook == "on_step":
            assert step == last_step + 1
            last_step = step
        elif hook == "on_eval":
            assert step == last_step + 1, "an evaluation follows the step it evaluates"
    ((_, end),) = [call for call in recorder.calls if call[0] == "on_end"]
    assert end["steps"] == 12 and end["eval"]["step"] == 12 and end == summary
    pieces.assert_same_parameters(model, pieces.reference(job, 12))


def test_stop_from_on_step_returns_the_model_of_the_stop_step(train):
    recorder = ep.Recorder(stop_hook="on_step", stop_step=3)
    job = ep.make_job(virtual_workers=4, eval_batch=50, delay_s=0.01)
    model, summary = train(job, steps=40, devices=2, callbacks=[recorder])
    stopped_at = summary["steps"]
    assert 3 + 2 <= stopped_at < 40, "after the step in flight when the devices see the request"
    assert summary["stopped"].startswith(CALLBACK_STOP) and "on_step at step 3" in summary["stopped"]
    assert [record["step"] for record in recorder.of("on_step")] == list(range(stopped_at))
    pieces.assert_same_parameters(model, pieces.reference(job, stopped_at))
    # It ends as the last step does: an evaluation of the model returned.
    assert summary["eval"]["step"] == stopped_at
    ep.assert_metrics_equal(summary["eval"]["metrics"], ep.evaluate_reference(job, stopped_at), rtol=1e-4)
    assert any(event["event"] == "stop" for event in summary["events"])


def test_stop_from_on_eval_is_exact(train, tmp_path):
    recorder = ep.Recorder(stop_hook="on_eval", stop_step=6)
    job = ep.make_job(virtual_workers=4, eval_batch=50)
    model, summary = train(
        job,
        steps=40,
        devices=2,
        eval_every=3,
        callbacks=[recorder],
        checkpoint_every=100,
        checkpoint_dir=str(tmp_path / "checkpoints"),
    )
    assert summary["steps"] == 6, "the model returned is the one evaluated"
    assert [record["step"] for record in recorder.of("on_step")] == list(range(6))
    assert [record["step"] for record in recorder.of("on_eval")] == [3, 6]
    pieces.assert_same_parameters(model, pieces.reference(job, 6))
    assert summary["eval"]["step"] == 6
    assert summary["checkpoint"].endswith("step-00000006.pt") and os.path.exists(summary["checkpoint"])


class Raises(Callback):
    def on_step(self, record):
        if record["step"] == 2:
            return record["loss"] / 0


def test_an_exception_in_a_callback_stops_the_job_with_its_traceback(train, tmp_path):
    with pytest.raises(flexpar.CallbackError) as raised:
        train(pieces.make_job(delay_s=0.01), steps=200, devices=2, callbacks=[Raises()])
    message = str(raised.value)
    assert "callback Raises.on_step raised at step 2: ZeroDivisionError" in message
    assert message.count("Traceback (most recent call last)") == 1
    assert 'return record["loss"] / 0' in message, "the callback's own line"
    assert "flexpar/callbacks.py" not in message, "not flexpar's frames"
    assert raised.value.__traceback__ is None or raised.value.__cause__ is None
