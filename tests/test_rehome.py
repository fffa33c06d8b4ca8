"""The re-homing planner (agent.node.rehome): who re-homes, which instances, with which tables."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from agent.node.rehome import decode_hosted, encode_hosted, plan_rehome, responsible

PIPE = """
[pipeline]
name = "p"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "mid"
function = "agent.operators.builtin:identity"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def spec(instance: str, operator: str, keeper: bool = False, **extra: Any) -> Dict[str, Any]:
    return {"instance": instance, "operator": operator, "pipeline": "p", "pipeline_toml": PIPE,
            "node": "x", "cluster": "c", "keeper": keeper, "succs": ["stale"], "preds": ["stale"],
            "extra": dict(extra)}


def fleet() -> Dict[str, List[Dict[str, Any]]]:
    return {
        "n1": [spec("p.source.0", "source", True), spec("mid-a", "mid")],
        "n2": [spec("p.mid.0", "mid", True), spec("mid-b", "mid", sink_dir="/s")],
        "n3": [spec("p.sink.0", "sink", True)],
    }


def test_the_lowest_online_node_is_responsible() -> None:
    assert responsible("n1", {"n1", "n3"})
    assert not responsible("n3", {"n1", "n3"})
    assert responsible("n3", {"n4"})  # itself counts even when its own status is not seen yet


def test_dead_node_instances_get_fresh_tables_same_identity_and_a_higher_epoch() -> None:
    plan = plan_rehome("n2", fleet(), online={"n1", "n3"}, listed_online={"p.source.0", "mid-a", "p.sink.0"},
                       min_epoch=1_800_000_000)
    assert [s["instance"] for s in plan] == ["mid-b", "p.mid.0"]
    keeper = plan[1]
    assert keeper["keeper"] is True and keeper["restart"] is True and keeper["active"] is True
    # tables from the retained records of the live nodes plus the dead node, not the stale spec
    assert keeper["preds"] == ["p.source.0"] and keeper["succs"] == ["p.sink.0"]
    assert keeper["extra"]["min_epoch"] == 1_800_000_000
    assert plan[0]["extra"] == {"sink_dir": "/s", "min_epoch": 1_800_000_000}


def test_siblings_and_neighbours_of_other_dead_nodes_are_not_in_the_tables() -> None:
    hosted = fleet()
    hosted["n4"] = [spec("source-ghost", "source")]  # an offline node that is not the one re-homed
    plan = plan_rehome("n2", hosted, online={"n1", "n3"}, listed_online=set(), min_epoch=5)
    assert all(s["preds"] == ["p.source.0"] for s in plan)


def test_an_instance_already_listed_by_an_online_node_is_skipped() -> None:
    plan = plan_rehome("n2", fleet(), online={"n1", "n3"}, listed_online={"p.mid.0", "mid-b"}, min_epoch=5)
    assert plan == []


def test_a_source_and_a_sink_get_only_the_side_they_have() -> None:
    hosted = fleet()
    plan = plan_rehome("n1", hosted, online={"n2", "n3"}, listed_online=set(), min_epoch=5)
    src = next(s for s in plan if s["instance"] == "p.source.0")
    assert src["preds"] == [] and src["succs"] == ["mid-a", "mid-b", "p.mid.0"]
    plan = plan_rehome("n3", hosted, online={"n1", "n2"}, listed_online=set(), min_epoch=5)
    assert plan[0]["preds"] == ["mid-a", "mid-b", "p.mid.0"] and plan[0]["succs"] == []


def test_hosted_record_round_trip_and_bad_payloads() -> None:
    specs = fleet()["n1"]
    assert decode_hosted(encode_hosted(specs)) == sorted(specs, key=lambda s: s["instance"])
    for bad in (b"{}", b"[1]", b'[{"instance": 3}]', b"not json"):
        with pytest.raises(ValueError):
            decode_hosted(bad)
