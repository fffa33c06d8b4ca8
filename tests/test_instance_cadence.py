"""agent.instance.cadence alone: when the state is written and when a heartbeat goes out."""

from __future__ import annotations

from agent.instance.cadence import STATE_PERIOD, Cadence


def test_the_state_is_written_when_changed_forced_or_a_period_after_the_last_write() -> None:
    c = Cadence(heartbeat_period=2.0)
    assert c.write_due(0.0, False)  # never written: changed
    c.written(0.0)
    assert not c.write_due(STATE_PERIOD - 0.1, False)
    assert c.write_due(STATE_PERIOD - 0.1, True)
    c.changed()
    assert c.write_due(0.1, False)
    c.written(0.1)
    assert not c.dirty and c.write_due(0.1 + STATE_PERIOD, False)


def test_a_heartbeat_is_due_one_period_after_the_last() -> None:
    c = Cadence(heartbeat_period=2.0)
    assert not c.beat_due(1.9) and c.beat_due(2.0)
    c.beat(2.5)
    assert c.next_beat() == 4.5 and not c.beat_due(4.4) and c.beat_due(4.5)
