"""agent.node.handover on its own: what a drained keeper takes with it to another node, what the
answer of its createNode() means and what the node does then, from the files it wrote, without a
daemon or a broker."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import handover, statexfer
from agent.node.drain import Drain

SPEC = InstanceSpec("p.k.0", "k", "me", "c", "p", "", BrokerSpec("h", 1), keeper=False, extra={"min_epoch": 5})


def test_the_keeper_moves_with_its_state_its_position_and_a_restart_here_in_reserve(tmp_path: Path) -> None:
    (tmp_path / "p.k.0.state.json").write_text(json.dumps({"epoch": 7}))
    (tmp_path / "p.k.0.source.json").write_text(json.dumps({"offset": 3}))
    move = handover.prepare(SPEC, {"keeper": True}, tmp_path, 1000.0, "t-1")
    assert move.refused is None and move.chunks == () and move.keyed is None
    assert move.spec.restart and move.spec.active and move.spec.keeper  # what the worker said it is
    assert move.spec.extra == {"min_epoch": 5, "handover_state": {"epoch": 7}, "handover_source": {"offset": 3}}
    assert move.local.restart and move.local.extra == {"min_epoch": 5}


def test_without_a_state_file_it_starts_above_any_epoch_it_used(tmp_path: Path) -> None:
    move = handover.prepare(SPEC, {}, tmp_path, 1000.9, "t-1")
    assert move.spec.extra["handover_state"] is None and move.spec.extra["min_epoch"] == 1000
    assert not move.spec.keeper  # its spec's word when its stats say nothing


def test_its_keyed_state_goes_in_chunks_and_an_unreadable_one_keeps_it_here(tmp_path: Path) -> None:
    keyed = tmp_path / "p.k.0.keyed.json"
    keyed.write_text(json.dumps({"groups": {"0": {"a": 1}}}))
    move = handover.prepare(SPEC, {}, tmp_path, 1000.0, "t-1")
    assert move.keyed == len(statexfer.snapshot_bytes(keyed) or b"") and len(move.chunks) >= 1
    assert move.spec.extra["handover_keyed"]["transfer"] == "t-1"
    keyed.write_text("{not json")
    refused = handover.prepare(SPEC, {}, tmp_path, 1000.0, "t-2")
    assert refused.refused and "cannot be read" in refused.refused and refused.spec == refused.local


def test_the_answer_moves_it_keeps_it_or_restarts_it_here() -> None:
    assert handover.outcome({"ok": True, "node": "n2"}, "me", stopping=False) == handover.MOVED
    assert handover.outcome({"ok": True, "node": "me"}, "me", stopping=False) == handover.STAYS  # runs here
    assert handover.outcome({"ok": False, "error": "no slot"}, "me", stopping=False) == handover.RESTART
    assert handover.outcome({"ok": False, "error": "no slot"}, "me", stopping=True) == handover.STAYS


class Node:
    """A node's hand-overs with every call recorded."""

    def __init__(self, tmp_path: Path, stopping: bool = False) -> None:
        self.did: List[Tuple[Any, ...]] = []
        self.asked: List[Tuple[InstanceSpec, Any, Dict[str, Any]]] = []
        self.drain = Drain()
        rec = self.did.append
        self.handovers = handover.HandOvers("me", str(tmp_path), "b00t", self.drain, lambda: 1000.5,
                                            handover.HandOverCalls(
            create_node=lambda spec, reply, **kw: self.asked.append((spec, reply, kw)),
            restart=lambda spec: rec(("restart", spec)), moved=lambda i, node: rec(("moved", i, node)),
            forget=lambda i: rec(("forget", i)), event=lambda etype, i, op, pipe, **d: rec((etype, d.get("ok"))),
            changed=lambda: rec(("changed",)), stopping=lambda: stopping))


def test_a_keeper_handed_over_is_forgotten_here_once_another_node_runs_it(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.handovers.start(SPEC, {"keeper": True}, 3.0)
    [(moved, reply, kw)] = n.asked
    assert kw["cause"] == "handover" and kw["now"] == 3.0 and moved.restart and moved.keeper
    assert n.drain.moving == {"p.k.0"} and n.did == []  # nothing forgotten before the answer
    reply({"ok": True, "instance": "p.k.0", "node": "n2"})
    assert n.did == [("changed",), ("moved", "p.k.0", "n2"), ("forget", "p.k.0"), ("drain", True)]
    assert n.drain.moving == set()


def test_a_hand_over_nobody_takes_restarts_it_here_unless_the_agent_stops(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.handovers.start(SPEC, {}, 3.0)
    n.asked[0][1]({"ok": False, "error": "no slot"})
    (restart,) = [d for d in n.did if d[0] == "restart"]
    assert restart[1].instance == "p.k.0" and restart[1].restart and "handover_state" not in restart[1].extra
    assert ("forget", "p.k.0") not in n.did and ("drain", False) in n.did
    stopping = Node(tmp_path, stopping=True)
    stopping.handovers.start(SPEC, {}, 3.0)
    stopping.asked[0][1]({"ok": False, "error": "no slot"})
    assert [d[0] for d in stopping.did] == ["changed", "drain"]  # re-adopted at the agent's restart
    n.handovers.start(SPEC, {}, 4.0)
    n.asked[1][1]({"ok": True, "node": "me"})  # placed on the draining node: it runs here
    assert len([d for d in n.did if d[0] == "restart"]) == 1 and ("forget", "p.k.0") not in n.did


def test_a_hand_over_refused_restarts_it_here_at_once_and_each_transfer_has_its_own_id(tmp_path: Path) -> None:
    n = Node(tmp_path)
    keyed = tmp_path / "p.k.0.keyed.json"
    keyed.write_text(json.dumps({"groups": {"0": {"a": 1}}}))
    n.handovers.start(SPEC, {}, 3.0)
    n.handovers.start(SPEC, {}, 4.0)
    ids = [spec.extra["handover_keyed"]["transfer"] for spec, _, _ in n.asked]
    assert ids[0] != ids[1] and all(i.startswith("b00t-") for i in ids)
    keyed.write_text("{not json")
    n.handovers.start(SPEC, {}, 5.0)
    assert len(n.asked) == 2 and n.did[-2:] == [("drain", False), ("restart", dataclasses.replace(SPEC, restart=True))]
