"""agent.instance.queues alone: per-sender order, and what may overtake data, without an instance."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Set

from agent.dataplane.envelope import Envelope, Kind
from agent.protocol.scaling import FORWARDING
from agent.instance.queues import SenderQueues

FWD = next(iter(FORWARDING))


def _stats() -> Dict[str, int]:
    return {"acks_ahead_of_data": 0, "duplications_ahead_of_data": 0, "eos_ahead_of_data": 0}


def _data(sender: str, seq: int, keys: List[int]) -> Envelope:
    return Envelope(sender, 0, seq, Kind.DATA, [("src", k, {"k": k}) for k in keys])


def _proto(sender: str, seq: int, body: Dict[str, Any]) -> Envelope:
    return Envelope(sender, 0, seq, Kind.PROTO, body)


def _groups_in(items: Any) -> Set[int]:
    return {it[1] % 4 for it in items}


def test_a_duplication_ack_overtakes_data_but_not_a_protocol_message_before_it() -> None:
    stats = _stats()
    q = SenderQueues(stats, keyed=False)
    q.put(_data("a", 1, [1]))
    q.put(_proto("a", 2, {"type": "duplication_ack"}))
    q.put(_data("b", 1, [1]))
    q.put(_proto("b", 2, {"type": "deletion_ack"}))
    q.put(_proto("b", 3, {"type": "duplication_ack"}))
    handled: List[Envelope] = []
    sc = SimpleNamespace(blocked=False, duplicating=True)
    q.duplication_acks_ahead(sc, handled.append)
    assert [(e.sender, e.seq) for e in handled] == [("a", 2)]
    assert [e.seq for e in q.by_sender["a"]] == [1] and [e.seq for e in q.by_sender["b"]] == [1, 2, 3]
    assert stats["acks_ahead_of_data"] == 1


def test_nothing_overtakes_while_the_drivers_outputs_are_performed() -> None:
    q = SenderQueues(_stats(), keyed=False)
    q.put(_data("a", 1, [1]))
    q.put(_proto("a", 2, {"type": "duplication"}))
    assert q.dup_behind
    handled: List[Envelope] = []
    q.duplications_ahead(SimpleNamespace(blocked=True, core=SimpleNamespace(state=FWD)), handled.append)
    assert handled == [] and q.dup_behind  # asked again next turn
    q.duplications_ahead(SimpleNamespace(blocked=False, core=SimpleNamespace(state=FWD)), handled.append)
    assert [e.seq for e in handled] == [2] and not q.dup_behind


def test_an_eos_overtakes_only_batches_without_its_group() -> None:
    stats = _stats()
    q = SenderQueues(stats, keyed=True)
    q.put(_data("a", 1, [1, 2]))  # groups 1 and 2
    q.put(_proto("a", 2, {"type": "eos", "g": 3}))
    q.put(_proto("a", 3, {"type": "eos", "g": 1}))
    assert q.eos_behind
    handled: List[Envelope] = []
    q.eos_ahead(None, _groups_in, handled.append)
    assert [e.seq for e in handled] == [2] and [e.seq for e in q.by_sender["a"]] == [1, 3]
    assert not q.eos_behind and stats["eos_ahead_of_data"] == 1


def test_a_sender_is_forgotten_only_when_nothing_of_it_waits() -> None:
    q = SenderQueues(_stats(), keyed=False)
    q.put(_proto("a", 1, {"type": "duplication"}))
    assert q.any() and not q.data_waiting() and q.count() == 1
    assert not q.forget("a")
    q.by_sender["a"].popleft()
    assert q.forget("a") and "a" not in q.by_sender
