"""agent.instance.silence alone: the silence checks' clock and the holes that stay open."""

from __future__ import annotations

from agent.instance.silence import GAP_TIMEOUT, SILENCE_CHECK, Silence


def test_a_check_is_due_one_period_after_the_last() -> None:
    s = Silence()
    s.checked(10.0)
    assert not s.due(10.0 + SILENCE_CHECK - 0.01) and s.due(10.0 + SILENCE_CHECK)


def test_a_hole_that_stays_the_same_for_gap_timeout_is_stuck_and_then_forgotten() -> None:
    s = Silence()
    assert s.stuck({"a": (1, 5, 9)}, 0.0) == []
    assert s.stuck({"a": (1, 5, 9)}, GAP_TIMEOUT - 0.5) == []
    assert s.stuck({"a": (1, 5, 9), "b": (0, 2, 3)}, GAP_TIMEOUT) == ["a"]
    assert s.stuck({"b": (0, 2, 3)}, GAP_TIMEOUT + 1.0) == []  # every hole forgotten: b's clock starts again


def test_a_hole_that_moves_restarts_its_clock() -> None:
    s = Silence()
    s.stuck({"a": (1, 5)}, 0.0)
    s.stuck({"a": (1, 7)}, 3.0)  # the hole at 5 closed, another opened at 7
    assert s.stuck({"a": (1, 7)}, GAP_TIMEOUT + 1.0) == []
    assert s.stuck({"a": (1, 7)}, GAP_TIMEOUT + 3.0) == ["a"]


def test_a_forgotten_sender_starts_again() -> None:
    s = Silence()
    s.stuck({"a": (1, 5)}, 0.0)
    s.forget("a")
    assert s.stuck({"a": (1, 5)}, GAP_TIMEOUT) == []
