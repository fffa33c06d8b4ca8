"""agent.node.gate on its own: who may ask this node for what, decided without a daemon, a broker or
a worker. Each test builds a Gate from this node's settings and hands it the records a check reads
(`PeerFacts`), then asserts the refusal (its words) or the acceptance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from agent.control.records import PipelineRecord
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node.gate import PEER_OPS, Gate, NodeLocal, PeerFacts
from agent.node.hostmap import HostMap
from agent.node.site_manager import LeaseBoard
from agent.operators.admission import AllowList, NodeDirs
from agent.signing import SpecTrust
from pipelines import taxi_in_zone, with_work

NOW = 1_700_000_000.0
TEXT = taxi_in_zone("hot", policy="decentralized", max_instances=2)


def gate(tmp_path: Path, counters: Optional[Dict[str, int]] = None) -> Gate:
    local = NodeLocal("me", "c", BrokerSpec("broker.local", 1883), str(tmp_path / "state"), 0.5,
                      fence_reconnect=True, inbox_per_node=False, replicate=False)
    return Gate(local, AllowList.for_node(()), NodeDirs((str(tmp_path / "state"),)), SpecTrust(None),
                {} if counters is None else counters, boot="b00t")


def facts(online: Optional[Dict[str, bool]] = None, hosted: Optional[Dict[str, List[Dict[str, Any]]]] = None,
          hostmap: Optional[HostMap] = None, deployed: Optional[Dict[str, str]] = None,
          records: Optional[Dict[str, PipelineRecord]] = None, leases: Optional[LeaseBoard] = None) -> PeerFacts:
    deployed = {"hot": TEXT} if deployed is None else deployed
    return PeerFacts(online or {}, hosted or {}, records or {}, set(deployed), deployed,
                     hostmap or HostMap("me"), leases or LeaseBoard("me", 60.0))


def spawn(instance: str = "hot.in_zone.7", text: Optional[str] = TEXT, generation: Optional[str] = None) -> Dict[str, Any]:
    spec: Dict[str, Any] = {"instance": instance, "operator": "in_zone", "pipeline": "hot"}
    if text is not None:
        spec["pipeline_toml"] = text
    if generation is not None:
        spec["extra"] = {"generation": generation}
    return {"op": "spawn", "spec": spec}


def test_a_peer_may_ask_only_the_peer_ops(tmp_path: Path) -> None:
    g = gate(tmp_path)
    for op in ("stop", "set", "pin", "scale", "ping"):
        assert g.peer_refusal(NOW, op, "n2", {"op": op}, facts()) == \
            f"op {op!r} is not allowed on the peer topic (only {', '.join(PEER_OPS)})"
    assert g.peer_refusal(NOW, "spawn", "n2", spawn(), facts()) is None


def test_a_peer_spawn_runs_only_a_pipeline_an_admin_deployed_with_its_text_and_generation(tmp_path: Path) -> None:
    g = gate(tmp_path)
    assert g.peer_may_spawn("n2", {"spec": {"operator": "in_zone"}}, facts()) == "spawn without a pipeline"
    assert g.peer_may_spawn("n2", {"spec": "hot"}, facts()) == "spawn without a pipeline"
    assert g.peer_may_spawn("n2", spawn(), facts(deployed={})) == \
        "pipeline 'hot' is not deployed (no admin's record of it)"
    assert g.peer_may_spawn("n2", spawn(text=TEXT + "\n# mine"), facts()) == \
        "the text of pipeline 'hot' is not the one an admin deployed"
    assert g.peer_may_spawn("n2", spawn(text=None), facts()) is None  # runs the record's text
    current = {"hot": PipelineRecord("deployed", "g2")}
    why = g.peer_may_spawn("n2", spawn(generation="g1"), facts(records=current))
    assert why is not None and why.startswith("pipeline 'hot': ") and "g1" in why
    assert g.peer_may_spawn("n2", spawn(generation="g2"), facts(records=current)) is None
    gone = {"hot": PipelineRecord("undeployed", "g2")}
    assert g.peer_may_spawn("n2", spawn(generation="g2"), facts(records=gone)) is not None


def test_a_clone_of_an_instance_bound_to_another_online_node_is_refused_unless_that_node_asks(tmp_path: Path) -> None:
    g = gate(tmp_path)
    up = {"me": True, "a": True, "n2": True}
    m = HostMap("me")
    m.update({}, {"a": [("hot.in_zone.7", "hot")]}, up, {}, {"x": {"hot.in_zone.7": "a"}})
    assert m.bound("hot.in_zone.7") == "a" and m.proven("hot.in_zone.7")
    hosted = {"a": [{"instance": "hot.in_zone.7", "pipeline": "hot"}]}
    assert g.peer_refusal(NOW, "spawn", "n2", spawn(), facts(up, hosted, m)) == \
        "instance 'hot.in_zone.7' runs on a (online): only a may move it"
    assert g.peer_refusal(NOW, "spawn", "a", spawn(), facts(up, hosted, m)) is None  # a hand-over
    assert g.clone_problem("n2", "hot.in_zone.7", facts(dict(up, a=False), hosted, m)) is None  # a re-home
    assert g.clone_problem("n2", "hot.in_zone.7", facts(up, {"a": []}, m)) is None  # a leftover binding
    assert g.clone_problem("n2", "hot.in_zone.8", facts(up, hosted, m)) is None  # a new copy


def test_keyed_state_comes_only_from_the_node_that_hosts_the_instance(tmp_path: Path) -> None:
    g = gate(tmp_path)
    hosted = {"a": [{"instance": "hot.in_zone.7"}]}
    body = {"op": "state_chunk", "instance": "hot.in_zone.7"}
    assert g.peer_refusal(NOW, "state_chunk", "a", body, facts(hosted=hosted)) is None
    assert g.peer_refusal(NOW, "replica", "n2", dict(body, op="replica"), facts(hosted=hosted)) == \
        "n2 does not host 'hot.in_zone.7'"


def test_only_the_site_manager_may_drain_this_node(tmp_path: Path) -> None:
    g = gate(tmp_path)
    board = LeaseBoard("me", 60.0)
    assert g.peer_refusal(NOW, "drain", "n9", {"op": "drain"}, facts(leases=board)) == "n9 is not the site manager"
    assert board.on_record("n9", json.dumps({"v": 1, "node": "n9", "until": NOW + 30}).encode(), NOW) is None
    online = {"n9": True}
    assert g.peer_refusal(NOW, "drain", "n9", {"op": "drain"}, facts(online, leases=board)) is None
    assert g.peer_refusal(NOW, "undrain", "n8", {"op": "undrain"}, facts(online, leases=board)) == \
        "n8 is not the site manager"
    assert g.peer_refusal(NOW + 31, "drain", "n9", {"op": "drain"}, facts(online, leases=board)) == \
        "n9 is not the site manager"  # its lease ran out


def test_a_spec_gets_this_nodes_own_fields_and_identity(tmp_path: Path) -> None:
    g = gate(tmp_path)
    data = {"operator": "work", "pipeline": "p", "pipeline_toml": with_work("agent.operators.builtin:identity"),
            "node": "elsewhere", "state_dir": "/tmp/theirs", "heartbeat_period": 99.0,
            "extra": {"spill": {"dir": "/tmp/theirs"}, "crash_at": "x:y", "inbox_per_node": True}}
    spec = g.spec_from(NOW, data, template=None, requester="admin a")
    assert (spec.instance, spec.node, spec.cluster, spec.state_dir, spec.heartbeat_period) == \
        ("work-me-b00t-1", "me", "c", str(tmp_path / "state"), 0.5)
    assert spec.broker == BrokerSpec("broker.local", 1883)
    assert spec.extra == {"fence_reconnect": True, "check_sender_node": True, "inbox_per_node": False,
                          "replicate": False}
    child = g.spec_from(NOW, {"operator": "work"}, template=spec)
    assert (child.instance, child.keeper, child.restart) == ("work-me-b00t-2", False, False)


def test_a_spec_off_the_allow_list_outside_the_dirs_or_ahead_of_the_clock_is_refused_and_counted(tmp_path: Path) -> None:
    counters: Dict[str, int] = {}
    g = gate(tmp_path, counters)
    base = {"instance": "p.work.0", "operator": "work", "pipeline": "p"}
    for data, words in (
        (dict(base, pipeline_toml=with_work("os:system")), "refused"),
        (dict(base, pipeline_toml=with_work("agent.operators.builtin:identity"), extra={"sink_dir": "/etc"}), "/etc"),
        (dict(base, pipeline_toml=with_work("agent.operators.builtin:identity"), extra={"min_epoch": int(NOW) + 3600}),
         "min_epoch"),
        (dict(base, operator="nope", pipeline_toml=with_work("agent.operators.builtin:identity")), "not in pipeline"),
    ):
        with pytest.raises(ValueError, match=words):
            g.spec_from(NOW, data, template=None, requester="node n2")
    assert counters == {"refused_specs": 4}
    ok = g.spec_from(NOW + 7200, dict(base, pipeline_toml=with_work("agent.operators.builtin:identity"),
                                      extra={"min_epoch": int(NOW) + 3600}), template=None)
    assert ok.extra["min_epoch"] == int(NOW) + 3600  # the same floor, once the clock has passed it


def keeper() -> InstanceSpec:
    return InstanceSpec("hot.in_zone.0", "in_zone", "me", "c", "hot", TEXT, BrokerSpec("h", 1), keeper=True)


def copy(instance: str) -> Dict[str, Any]:
    return {"spec": {"instance": instance, "operator": "in_zone", "keeper": False, "active": False}}


def test_a_workers_copy_past_max_instances_is_refused_and_counted(tmp_path: Path) -> None:
    counters: Dict[str, int] = {}
    g = gate(tmp_path, counters)
    local = [("hot.in_zone.0", "hot", "in_zone")]
    spec = g.worker_copy(NOW, keeper(), copy("hot.in_zone.a"), None, False, local, [], {}, {})
    assert isinstance(spec, InstanceSpec) and spec.instance == "hot.in_zone.a" and not spec.keeper
    placing = [("hot.in_zone.a", "hot", "in_zone")]
    assert g.worker_copy(NOW, keeper(), copy("hot.in_zone.b"), None, False, local, placing, {}, {}) == \
        "max_instances reached: operator 'in_zone' has 2 instances (max_instances = 2)"
    fleet = {"n2": {"instances": [{"id": "hot.in_zone.z", "operator": "in_zone", "pipeline": "hot"}]}}
    assert isinstance(g.worker_copy(NOW, keeper(), copy("hot.in_zone.b"), None, False, local, [], fleet, {}), str)
    assert isinstance(g.worker_copy(NOW, keeper(), copy("hot.in_zone.b"), None, False, local, [], fleet,
                                    {"n2": False}), InstanceSpec)  # an offline node's state counts no more
    # The existing copy is answered again, never refused (its creator performs its createNode() again).
    assert isinstance(g.worker_copy(NOW, keeper(), copy("hot.in_zone.a"), None, False, local, placing, {}, {}),
                      InstanceSpec)
    assert counters == {"spawn_refused_max": 2}


def test_a_workers_copy_is_refused_without_a_spec_when_undeployed_or_of_a_stale_generation(tmp_path: Path) -> None:
    g = gate(tmp_path)
    assert g.worker_copy(NOW, None, copy("hot.in_zone.a"), None, False, [], [], {}, {}) == "spawn without a spec object"
    assert g.worker_copy(NOW, keeper(), {"spec": "x"}, None, False, [], [], {}, {}) == "spawn without a spec object"
    assert g.worker_copy(NOW, keeper(), copy("hot.in_zone.a"), None, True, [], [], {}, {}) == \
        "refused: it is being undeployed"
    why = g.worker_copy(NOW, keeper(), copy("hot.in_zone.a"), PipelineRecord("undeployed", None), False, [], [], {}, {})
    assert isinstance(why, str) and why.startswith("refused: ")
    bad = g.worker_copy(NOW, keeper(), {"spec": {"instance": "a/b", "operator": "in_zone"}}, None, False, [], [], {}, {})
    assert isinstance(bad, str) and bad.startswith("invalid spec: ")
