"""agent.instance.replays alone: the replays a new incarnation waits for, without an instance."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from agent.dataplane.envelope import Envelope, Kind
from agent.instance.replays import REPLAY_WAIT, ReplayWait
from foglab.sim.instance_faults import ClockAtDropWait, ResyncAtFirstSeenWait

POSITIONS: Dict[str, Tuple[int, int, bool]] = {"p1": (3, 10, False)}


def _position(sender: str) -> Optional[Tuple[int, int, bool]]:
    return POSITIONS.get(sender)


def _data(sender: str, epoch: int, seq: int, n: int = 1) -> Envelope:
    return Envelope(sender, epoch, seq, Kind.DATA, [("src", i, None) for i in range(n)])


def _stats() -> Dict[str, int]:
    return {"dropped_before_replay": 0, "eos_before_replay": 0}


def test_data_before_the_marker_is_dropped_and_counted_and_the_marker_ends_the_wait() -> None:
    stats = _stats()
    w = ReplayWait(stats)
    w.start(["p1"], _position)
    assert w.awaiting == {"p1": (3, None)}
    assert w.drops(_data("p1", 3, 11), 5.0)
    assert stats["dropped_before_replay"] == 1 and w.awaiting == {"p1": (3, 5.0)}
    w.marker("p1")
    assert not w and not w.drops(_data("p1", 3, 12), 6.0)


def test_a_newer_epoch_of_the_predecessor_ends_the_wait() -> None:
    w = ReplayWait(_stats())
    w.start(["p1"], _position)
    assert not w.drops(_data("p1", 4, 1), 1.0)
    assert w.awaiting == {}


def test_a_predecessor_the_snapshot_lacks_is_awaited_until_its_number_1() -> None:
    w = ReplayWait(_stats())
    w.start(["p2"], _position)
    assert w.awaiting == {"p2": (None, None)}
    assert w.drops(_data("p2", 0, 7), 1.0)
    assert not w.drops(_data("p2", 0, 1), 2.0) and not w


def test_the_seeded_fault_takes_a_predecessor_the_snapshot_lacks_at_its_first_number() -> None:
    w = ResyncAtFirstSeenWait(_stats())
    w.start(["p1", "p2"], _position)
    assert w.awaiting == {"p1": (3, None)}


def test_a_protocol_message_starts_the_clock_and_the_marker_is_asked_again_after_replay_wait() -> None:
    w = ReplayWait(_stats())
    w.start(["p1"], _position)
    w.seen(Envelope("p1", 3, 11, Kind.PROTO, {"type": "duplication"}), 2.0)
    assert w.unanswered(2.0 + REPLAY_WAIT - 0.1) == []
    assert w.unanswered(2.0 + REPLAY_WAIT) == ["p1"]


def test_a_marker_or_a_newer_epoch_does_not_start_the_clock() -> None:
    w = ReplayWait(_stats())
    w.start(["p1"], _position)
    w.seen(Envelope("p1", 3, 11, Kind.DATA, []), 1.0)  # the marker itself
    w.seen(_data("p1", 4, 1), 1.0)  # a new incarnation: its data ends the wait
    assert w.awaiting == {"p1": (3, None)}


def test_with_the_seeded_fault_only_a_dropped_batch_starts_the_clock() -> None:
    w = ClockAtDropWait(_stats())
    w.start(["p1"], _position)
    w.seen(Envelope("p1", 3, 11, Kind.PROTO, {"type": "duplication"}), 2.0)
    assert w.unanswered(100.0) == []


def test_an_eos_ahead_of_the_marker_is_dropped_and_counted_others_are_not() -> None:
    stats = _stats()
    w = ReplayWait(stats)
    w.start(["p1"], _position)
    assert w.eos_early(Envelope("p1", 3, 11, Kind.PROTO, {"type": "eos", "g": 1}))
    assert not w.eos_early(Envelope("p1", 3, 12, Kind.PROTO, {"type": "duplication"}))
    assert not w.eos_early(Envelope("p9", 0, 1, Kind.PROTO, {"type": "eos", "g": 1}))
    assert stats["eos_before_replay"] == 1
