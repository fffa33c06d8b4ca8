"""agent.node.fleetview on its own: what the retained records make of this agent's view of the
fleet, record by record, without a daemon or a broker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import signing
from agent.control import records
from agent.node import nodestate
from agent.node.fleetview import FleetView
from agent.node.placement import NodeView
from agent.signing import SpecTrust


def state(node: str, *ids: str, moved: object = None, slots: int = 4) -> bytes:
    doc = nodestate.build_node_state(node, slots, [nodestate.InstanceInfo(i, i.split(".")[1], False, "active")
                                                   for i in ids], nodestate.MachineSample(1.0, 1.0), 1.0)
    for item in doc["instances"]:
        item["pipeline"] = item["id"].split(".")[0]
    if moved is not None:
        doc["moved"] = moved
    return nodestate.encode_state(doc)


def test_a_nodes_state_replaces_what_we_placed_there_and_says_when_its_moves_changed() -> None:
    v = FleetView("me")
    v.reserve("n2")
    v.place("n2", ("p.w.9", "p", "w"))
    v.place("n3", ("p.w.8", "p", "w"))
    assert v.on_state("n2", state("n2", "p.w.9")) is False
    assert v.reserved == {} and list(v.placed) == ["p.w.8"] and v.fleet["n2"]["instances"][0]["id"] == "p.w.9"
    assert v.on_state("n2", state("n2", "p.w.9", moved={"p.w.1": "n3"})) is True
    assert v.on_state("n2", state("n2", "p.w.9", moved={"p.w.1": "n3"})) is False
    assert v.on_state("me", state("me")) is False and "me" not in v.fleet  # ours is the one we publish
    assert v.on_state("n2", b"") is False and "n2" not in v.fleet  # cleared


@pytest.mark.parametrize("payload", [b"{not json", state("n3"), json.dumps({"node": "n2", "instances": 5}).encode()])
def test_a_state_that_does_not_parse_or_names_another_node_leaves_the_view_as_it_was(payload: bytes) -> None:
    v = FleetView("me")
    v.on_state("n2", state("n2", "p.w.1"))
    v.reserve("n2")
    before = json.dumps(v.fleet, sort_keys=True)
    with pytest.raises((ValueError, TypeError, KeyError)):
        v.on_state("n2", payload)
    assert json.dumps(v.fleet, sort_keys=True) == before and v.reserved == {"n2": 1}


def test_placement_sees_our_node_first_and_the_others_less_the_slots_we_asked_for() -> None:
    v = FleetView("me")
    v.on_state("n3", state("n3", "p.w.1"))
    v.on_state("n2", state("n2"))
    v.on_status("n3", False)
    v.reserve("n2")
    v.reserve("n2")
    mine = NodeView(node="me", slots=2, free_slots=1, online=True)
    views = v.views(mine, {"n3": 2})
    assert [(x.node, x.free_slots, x.online) for x in views] == [("me", 1, True), ("n2", 2, True), ("n3", 1, False)]
    for _ in range(5):
        v.reserve("n2")
    assert v.views(mine, {})[1].free_slots == 0


def test_an_instance_counts_as_elsewhere_only_on_an_online_node() -> None:
    v = FleetView("me")
    v.on_state("n2", state("n2", "p.w.1", "p.w.2", "q.w.3"))
    v.on_status("n2", True)
    assert v.runs_on("p.w.1") == "n2" and sorted(v.siblings("p", "w", "p.w.1")) == ["p.w.2"]
    v.on_status("n2", False)
    assert v.runs_on("p.w.1") is None and v.siblings("p", "w", "p.w.1") == []


def test_a_pipeline_is_deployed_with_its_text_until_its_tombstone() -> None:
    v = FleetView("me")
    text = '[pipeline]\nname = "p"\n'
    assert v.on_pipeline("p", records.stamp(text, "g1").encode(), SpecTrust(None)) is None
    assert v.deployed == {"p"} and v.records["p"].generation == "g1" and text in v.deployed_text["p"]
    assert v.on_pipeline("p", records.tombstone("p", "g1"), SpecTrust(None)) is None
    assert v.deployed == set() and v.deployed_text == {} and v.records["p"].state == "undeployed"
    assert v.on_pipeline("p", b"", SpecTrust(None)) is None and v.records == {}


def test_an_unsigned_record_is_refused_when_admin_keys_are_required_and_changes_nothing(tmp_path: Path) -> None:
    signing.generate_keypair(tmp_path / "admin.key", tmp_path / "admin.pub")
    required = SpecTrust(signing.load_verifier([tmp_path / "admin.pub"]))
    v = FleetView("me")
    v.on_pipeline("p", records.stamp('[pipeline]\nname = "p"\n', "g1").encode(), SpecTrust(None))
    why = v.on_pipeline("p", records.stamp('[pipeline]\nname = "p"\n# other\n', "g2").encode(), required)
    assert why == "pipeline 'p' carries no admin signature (this node requires one)"
    assert v.records["p"].generation == "g1" and v.deployed == {"p"}
    assert v.on_pipeline("p", records.tombstone("p", "g1"), required) is None  # a tombstone needs none
    assert v.deployed == set()


def test_the_hosted_and_rehomed_records_and_the_standbys() -> None:
    v = FleetView("me")
    hosted = [{"instance": "p.w.1", "operator": "w", "pipeline": "p", "pipeline_toml": ""}]
    assert v.on_hosted("n2", json.dumps(hosted).encode()) == ["p.w.1"]
    with pytest.raises(ValueError):
        v.on_hosted("n2", b'{"instance": 1}')
    assert v.hosted_by_node["n2"][0]["instance"] == "p.w.1"
    v.on_rehomed("n3", json.dumps({"p.w.1": 1500.0}).encode())
    assert v.rehomed_by_node == {"n3": {"p.w.1": 1500.0}}
    v.on_status("n2", True)
    v.on_status("n3", True)
    v.on_status("n4", False)
    v.fleet["n3"] = {"draining": True}
    assert v.eligible_standbys() == ["n2"]


def test_our_rehomed_record_is_ours_once_we_hold_it_and_an_older_copy_from_the_broker_is_published_over() -> None:
    """A broker killed with SIGKILL comes back from its last autosave (5 s before): at our
    reconnect it hands back a copy of our re-homed record without what we re-homed since.
    Taken, it made us forget those re-homes for good (every later record was built on it)."""
    v = FleetView("me")
    assert v.on_rehomed("me", json.dumps({"p.w.1": 1500.0}).encode()) is False  # at our start: read back
    assert v.rehomed_by_node["me"] == {"p.w.1": 1500.0}
    v.rehomed_by_node["me"]["p.w.2"] = 1600.0  # we re-homed another one (rehomer.Rehomer.tick)
    assert v.on_rehomed("me", json.dumps({"p.w.1": 1500.0}).encode()) is True  # the older copy: publish ours
    assert v.rehomed_by_node["me"] == {"p.w.1": 1500.0, "p.w.2": 1600.0}
    assert v.on_rehomed("me", b"{}") is True and v.rehomed_by_node["me"]["p.w.2"] == 1600.0
    assert v.on_rehomed("me", json.dumps({"p.w.1": 1500.0, "p.w.2": 1600.0}).encode()) is False  # ours, back
    assert v.on_rehomed("n2", json.dumps({"p.w.3": 1700.0}).encode()) is False  # another node's: as it says
    assert v.on_rehomed("n2", b"{}") is False and v.rehomed_by_node["n2"] == {}
