"""agent.instance.eventrate alone: how often the scaling driver's events go out, and its history."""

from __future__ import annotations

from agent import events
from agent.instance.eventrate import DECISION_EVENT_PERIOD, LOCK_EVENT_BURST, EventRate


def _decision(ts: float) -> events.Event:
    return events.decision(ts=ts, node="n1", instance="op-0", operator="op", pipeline="p", load=1.0,
                           capacity=10.0, probability=None, draw=0.5, action="none", count=0,
                           type="decision", detail={"source": "worker"})


def test_a_decision_that_acts_always_goes_out_one_that_does_not_once_a_period() -> None:
    rate = EventRate()
    assert rate.decision_due(0.0, False)
    assert not rate.decision_due(DECISION_EVENT_PERIOD - 0.1, False)
    assert rate.decision_due(1.0, True)
    assert rate.decision_due(DECISION_EVENT_PERIOD, False)


def test_the_history_is_kept_and_published_when_acted_or_a_period_after_the_last() -> None:
    rate = EventRate()
    assert rate.remember(_decision(1.0), 0.0, False) is not None
    assert rate.remember(_decision(2.0), 1.0, False) is None
    assert rate.history[-1].to_dict()["ts"] == 2.0 and len(rate.history) == 2
    assert rate.remember(_decision(3.0), 2.0, True) is not None


def test_at_most_a_burst_of_lock_events_per_second() -> None:
    rate = EventRate()
    assert all(rate.lock_allowed(0.0) for _ in range(LOCK_EVENT_BURST))
    assert not rate.lock_allowed(0.5)
    assert rate.lock_allowed(1.01)
