"""agent.node.handover on its own: what a drained keeper takes with it to another node, and what
the answer of its createNode() means, from the files it wrote, without a daemon or a broker."""

from __future__ import annotations

import json
from pathlib import Path

from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import handover, statexfer

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
