"""agent.instance.intake alone: the inbox topic, whose messages a topic carries, bad bytes counted."""

from __future__ import annotations

from typing import Dict

from agent import topics
from agent.dataplane.envelope import Envelope, Kind, encode
from agent.instance.intake import Intake


def _stats() -> Dict[str, int]:
    return {"foreign_inbox": 0, "malformed": 0, "protocol_in": 0, "protocol_errors": 0}


def test_a_per_node_inbox_names_its_writer_and_counts_our_inbox_at_another_node() -> None:
    stats = _stats()
    intake = Intake("c", "n1", "op-0", True, True, stats, {})
    assert intake.topic == "fog/c/inbox/n1/op-0/+"
    assert intake.writer(topics.inbox_at("c", "n1", "op-0", "n2")) == "n2"
    other = topics.inbox_at("c", "n3", "op-0", "n2")  # our inbox where we ran before
    assert intake.writer(other) is None and intake.foreign(other) and stats["foreign_inbox"] == 1
    assert not intake.foreign("taxi/rides") and stats["foreign_inbox"] == 1


def test_a_shared_inbox_has_no_foreign_topics() -> None:
    stats = _stats()
    intake = Intake("c", "n1", "op-0", False, True, stats, {})
    assert intake.topic == topics.inbox_all("c", "op-0")
    assert not intake.foreign("fog/c/inbox/n3/op-0/n2") and stats["foreign_inbox"] == 0


def test_bad_bytes_are_counted_and_skipped_and_good_ones_decoded() -> None:
    stats = _stats()
    intake = Intake("c", "n1", "op-0", False, True, stats, {})
    assert intake.decode(b"\xff{not json", 0.0) is None and stats["malformed"] == 1
    env = Envelope("src-0", 0, 1, Kind.DATA, [("src", 1, {"v": 1})])
    got = intake.decode(encode(env), 0.1)
    assert got is not None and (got.sender, got.seq, got.body) == ("src-0", 1, [("src", 1, {"v": 1})])
