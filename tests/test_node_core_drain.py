"""agent.node.drain on its own: which keeper of a drain stops when, and what an undrain keeps,
decided on a given time line without a daemon, a broker or a worker."""

from __future__ import annotations

from agent.node.drain import COPIES_FIRST_WAIT, Drain


def test_a_keeper_without_keyed_copies_to_wait_for_stops_at_once() -> None:
    d = Drain()
    d.set(True)
    assert d.draining and d.hand_over("p.k.0", set(), 1.0) is True and d.stops("p.k.0")
    assert d.copies_first == {} and d.release(2.0) == []
    assert d.exited("p.k.0") is True and not d.stops("p.k.0")
    assert d.exited("p.k.0") is False  # once


def test_the_keepers_wait_until_every_keyed_copy_has_left() -> None:
    d = Drain()
    d.set(True)
    assert d.hand_over("p.k.0", {"p.c.1", "p.c.2"}, 10.0) is False
    assert d.hand_over("p.j.0", {"p.c.1", "p.c.2"}, 10.0) is False
    assert d.release(11.0, left="p.c.1") == []
    assert d.exited("p.c.1") is False  # a copy, not a keeper
    assert d.release(12.0, left="p.c.2") == [("p.k.0", set()), ("p.j.0", set())]
    assert d.copies_first == {} and d.stops("p.k.0") and d.stops("p.j.0")


def test_a_copy_that_does_not_leave_holds_the_keepers_up_for_the_wait_at_most() -> None:
    d = Drain()
    d.hand_over("p.k.0", {"p.c.1"}, 10.0)
    assert d.release(10.0 + COPIES_FIRST_WAIT - 0.001) == []
    assert d.release(10.0 + COPIES_FIRST_WAIT) == [("p.k.0", {"p.c.1"})]  # still leaving: said in the log


def test_an_undrain_keeps_the_keepers_not_stopped_yet_and_a_keeper_that_exited_waits_for_nothing() -> None:
    d = Drain()
    d.set(True)
    d.hand_over("p.k.0", set(), 1.0)  # stopped already: it moves on
    d.hand_over("p.j.0", {"p.c.1"}, 1.0)
    d.hand_over("p.i.0", {"p.c.1"}, 1.0)
    assert d.exited("p.i.0") is True and "p.i.0" not in d.copies_first  # exited while waiting
    d.set(False)
    assert not d.draining and d.copies_first == {} and d.handing_over == {"p.k.0"}
    assert not d.stops("p.j.0") and d.release(1e9) == []
