"""agent.node.spawnshell's CreateNodes with a recording supervisor and client, no broker and no
process: where a createNode() of ours goes (the placement policy over this node and the fleet
view), what it starts here or asks of a peer, and that an agent that stops creates nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

from agent import topics
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import rpc, spawns, statexfer
from agent.node.contexts import PolicyContexts
from agent.node.fleetview import FleetView
from agent.node.placement import DEFAULT_POLICY, get_policy
from agent.node.spawnshell import CreateNodes, Here


class Supervisor:
    def __init__(self) -> None:
        self.workers: Dict[str, Any] = {}
        self.started: List[InstanceSpec] = []

    def __contains__(self, instance: object) -> bool:
        return instance in self.workers

    def get(self, instance: str) -> Optional[Any]:
        return self.workers.get(instance)

    def start(self, spec: InstanceSpec, now: float) -> None:
        self.started.append(spec)
        self.workers[spec.instance] = SimpleNamespace(spec=spec, status=SimpleNamespace(value="starting"))


def node(tmp_path: Path, slots: int = 2, stopping: bool = False) -> Tuple[CreateNodes, Supervisor, List[Any]]:
    sent: List[Tuple[str, Dict[str, Any]]] = []
    sup = Supervisor()
    view = FleetView("me")
    here = Here("me", "c", str(tmp_path), sup, None, view, statexfer.Staging(), {"spawned_local": 0,
                "spawned_remote": 0, "spawn_failed": 0}, lambda: True, lambda: slots - len(sup.workers),
                lambda spec, cause: False, lambda spec: None, lambda: None, lambda: None,
                lambda topic, payload, **kw: sent.append((topic, rpc.decode_request(payload))) or True,
                lambda *a: None)
    return CreateNodes(spawns.Spawns("me", "agent-me"), here, get_policy(DEFAULT_POLICY), PolicyContexts(), slots,
                       {}, lambda: stopping), sup, sent


def spec(instance: str = "p.work.1") -> InstanceSpec:
    return InstanceSpec(instance, "work", "me", "c", "p", "", BrokerSpec("h", 1))


def state(node: str, free: int) -> Dict[str, Any]:
    return {"version": 1, "node": node, "time": 1.0, "cpu": 0.0, "memory": 0.0, "slots": 4, "free_slots": free,
            "instances": []}


def test_a_free_slot_here_wins_and_the_answer_waits_for_ready(tmp_path: Path) -> None:
    creating, sup, sent = node(tmp_path)
    replies: List[Any] = []
    creating.create(spec(), replies.append, "spawn", 1.0)
    assert [s.instance for s in sup.started] == ["p.work.1"] and sent == [] and replies == []
    creating.handle(spawns.Ready("p.work.1"), 2.0)
    assert replies == [{"ok": True, "instance": "p.work.1", "node": "me"}]


def test_without_a_slot_here_the_online_node_with_free_slots_is_asked_on_its_peer_topic(tmp_path: Path) -> None:
    creating, sup, sent = node(tmp_path, slots=0)
    creating.here.view.fleet.update({"n2": state("n2", 3), "n3": state("n3", 0), "n4": state("n4", 4)})
    creating.here.view.online.update({"n2": True, "n3": True, "n4": False})
    assert creating.fleet_slots() == 0 + 4 + 4  # the online ones: n4 is offline
    assert [(v.node, v.free_slots) for v in creating.views()][0] == ("me", 0)
    creating.create(spec(), lambda r: None, "spawn", 1.0)
    assert sup.started == [] and [t for t, _ in sent] == [topics.agent_peer("c", "n2", "me")]
    assert sent[0][1]["op"] == "spawn" and sent[0][1]["spec"]["instance"] == "p.work.1"


def test_an_agent_that_stops_creates_nothing(tmp_path: Path) -> None:
    creating, sup, sent = node(tmp_path, stopping=True)
    replies: List[Any] = []
    creating.create(spec(), replies.append, "spawn", 1.0)
    assert replies == [{"ok": False, "error": "agent me is shutting down"}] and sup.started == [] and sent == []
