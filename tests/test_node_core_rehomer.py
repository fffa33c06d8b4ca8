"""agent.node.rehomer on its own: when this node plans a lost node, what of the plan it starts and
under which epoch floor, what a failed re-home leaves and when it is tried again, decided on a
given time line without a daemon, a broker or a worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from agent.node.fencing import READOPT_SETTLE
from agent.node.fleetview import FleetView
from agent.node.rehomer import Rehomer, RehomerCalls
from agent.node.rehoming import Rehoming
from agent.node.spawns import RPC_TIMEOUT
from pipelines import with_work
from test_node_core_gate import gate

TEXT = with_work("agent.operators.builtin:identity")
WALL = 1_700_000_000.5
PERIOD = 1.0  # [agent] state_period


def body(instance: str, function: str = "agent.operators.builtin:identity", **extra: Any) -> Dict[str, Any]:
    return {"instance": instance, "operator": "work", "pipeline": "p", "pipeline_toml": with_work(function),
            "node": "n9", "cluster": "c", "keeper": instance.endswith(".0"), "extra": dict(extra)}


class Node:
    """Node "me" as the re-homer, n9 lost since 0.0, every call recorded in order."""

    def __init__(self, tmp_path: Path, online: Optional[Dict[str, bool]] = None, dead_after: float = 10.0) -> None:
        self.did: List[Tuple[Any, ...]] = []
        self.asked: List[Tuple[Any, Any]] = []  # (spec, reply) of each createNode()
        self.connected = self.retained_in = True
        self.stopping = False
        self.local: Dict[str, Dict[str, Any]] = {}
        self.view = FleetView("me")
        self.view.online = dict(online if online is not None else {"n9": False, "n2": True})
        self.rehoming = Rehoming("me")
        self.rehoming.offline_since = {"n9": 0.0}

        def create_node(spec: Any, reply: Any, cause: str, now: float) -> None:
            assert cause == "rehome"
            self.did.append(("create", spec.instance))
            self.asked.append((spec, reply))

        self.rehomer = Rehomer("me", dead_after, PERIOD, self.rehoming, self.view, gate(tmp_path), RehomerCalls(
            create_node=create_node, publish_rehomed=lambda: self.did.append(("publish", dict(self.record))),
            moved=lambda i, n: self.did.append(("moved", i, n)), connected=lambda: self.connected,
            retained_in=lambda: self.retained_in, stopping=lambda: self.stopping, local=lambda: self.local,
            copies=lambda node: {}))

    @property
    def record(self) -> Dict[str, float]:
        return self.view.rehomed_by_node.get("me", {})

    def started(self) -> List[str]:
        return [s.instance for s, _ in self.asked]


def test_a_lost_node_is_planned_once_its_instances_start_under_one_floor_after_our_record(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.view.hosted_by_node["n9"] = [body("p.work.0"), body("p.work.1"), body("p.work.2")]
    n.view.fleet["n2"] = {"instances": [{"id": "p.work.2"}]}  # runs on an online node already
    n.rehomer.tick(9.9, WALL)
    assert n.asked == [] and n.did == []  # not offline for dead_after yet
    n.rehomer.tick(10.0, WALL)
    assert sorted(n.started()) == ["p.work.0", "p.work.1"]
    assert n.did[0] == ("publish", {"p.work.0": WALL, "p.work.1": WALL})  # the record goes first
    assert {s.extra["min_epoch"] for s, _ in n.asked} == {int(WALL)} and all(s.restart for s, _ in n.asked)
    assert set(n.rehoming.claims) == {"p.work.0", "p.work.1"}
    n.rehomer.tick(11.0, WALL + 1)
    assert len(n.asked) == 2  # planned once
    n.asked[0][1]({"ok": True, "node": "n2"})
    assert n.did[-1] == ("moved", n.asked[0][0].instance, "n2")  # the re-homer says where


def test_only_the_responsible_connected_agent_plans_and_never_on_the_last_connections_records(tmp_path: Path) -> None:
    lower = Node(tmp_path, online={"n9": False, "a1": True})  # a1 < me: a1 re-homes
    lower.view.hosted_by_node["n9"] = [body("p.work.1")]
    lower.rehomer.tick(100.0, WALL)
    assert lower.asked == []
    for what in ("retained_in", "connected", "stopping"):
        n = Node(tmp_path)
        n.view.hosted_by_node["n9"] = [body("p.work.1")]
        setattr(n, what, what == "stopping")
        n.rehomer.tick(100.0, WALL)
        assert n.asked == [] and "n9" not in n.rehoming.rehomed, what
    never = Node(tmp_path, dead_after=0.0)  # 0: never re-home
    never.view.hosted_by_node["n9"] = [body("p.work.1")]
    never.rehomer.tick(100.0, WALL)
    assert never.asked == []


def test_a_spec_the_gate_refuses_is_neither_started_nor_claimed(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.view.hosted_by_node["n9"] = [body("p.work.1"), body("p.work.2", function="builtins:exec"),
                                   body("p.work.3", min_epoch=2 ** 53)]
    n.rehomer.tick(100.0, WALL)
    assert n.started() == ["p.work.1"] and set(n.rehoming.claims) == {"p.work.1"}


def test_claims_last_until_a_node_lists_the_instance_or_their_time_is_over(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.view.hosted_by_node["n9"] = [body("p.work.1"), body("p.work.2")]
    n.rehomer.tick(100.0, WALL)
    n.view.fleet["n2"] = {"instances": [{"id": "p.work.1"}]}
    n.retained_in = False  # claims are dropped even then
    n.rehomer.tick(101.0, WALL)
    assert set(n.rehoming.claims) == {"p.work.2"}
    n.rehomer.tick(100.0 + RPC_TIMEOUT + 3 * PERIOD, WALL)
    assert n.rehoming.claims == {}


def test_a_failed_rehome_leaves_our_record_and_is_tried_again_under_a_new_floor_once_its_node_settled(
        tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.view.hosted_by_node["n9"] = [body("p.work.1")]
    n.rehomer.tick(100.0, WALL)
    n.view.online, n.rehoming.offline_since, n.rehoming.online_since = {"n9": True, "n2": True}, {}, {"n9": 105.0}
    n.asked[0][1]({"ok": False, "error": "no node has a free slot"})
    assert n.record == {} and n.did[-1] == ("publish", {}) and n.rehoming.claims == {}
    n.rehomer.tick(105.0 + READOPT_SETTLE + 2 * PERIOD - 0.01, WALL + 6)
    assert len(n.asked) == 1  # its state may not show what it re-adopted yet
    n.rehomer.tick(105.0 + READOPT_SETTLE + 2 * PERIOD, WALL + 7)
    (again, _) = n.asked[1]
    assert again.instance == "p.work.1" and again.extra["min_epoch"] == int(WALL + 7) > n.asked[0][0].extra["min_epoch"]
    assert n.record == {"p.work.1": float(int(WALL + 7))} and n.did[-2] == ("publish", n.record)


def test_only_the_failed_rehome_is_planned_again_and_a_failure_while_away_is_not_published(tmp_path: Path) -> None:
    """The next plan of a lost node after one of its re-homes failed must not place the others
    again, whose createNode() went elsewhere and which no state lists yet (CHANGELOG.md, "Two
    nodes ran, then both fenced, one copy")."""
    n = Node(tmp_path)
    n.view.hosted_by_node["n9"] = [body("p.work.1"), body("p.work.2")]
    n.rehomer.tick(100.0, WALL)
    publishes = len([d for d in n.did if d[0] == "publish"])
    n.connected = False
    dict((s.instance, reply) for s, reply in n.asked)["p.work.1"]({"ok": False, "error": "timed out"})
    assert n.record == {"p.work.2": WALL} and len([d for d in n.did if d[0] == "publish"]) == publishes
    assert "n9" not in n.rehoming.rehomed  # planned again at the next turn while it stays offline
    n.connected = True
    n.rehomer.tick(101.0, WALL + 1)
    assert sorted(n.started()[2:]) == ["p.work.1"]  # p.work.2 is on its way: still claimed
