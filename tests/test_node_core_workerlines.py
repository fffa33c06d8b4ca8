"""agent.node.workerlines on its own: what each control line of a worker makes the node do and in
which order (a "ready" is stored and our hosted record published before createNode() answers),
decided without a daemon, a broker or a worker process."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import spawns
from agent.node.fencing import Fencing
from agent.node.fleetview import FleetView
from agent.node.hosted import HostedSpecs
from agent.node.pins import Pins
from agent.node.workerlines import LineCalls, WorkerLines
from pipelines import taxi_in_zone
from test_node_core_gate import gate

TEXT = taxi_in_zone("hot", policy="decentralized", max_instances=2)
WALL = 1_700_000_000.0


@dataclass
class Running:
    spec: InstanceSpec
    started_at: float = 1.0
    stats: Dict[str, Any] = field(default_factory=dict)
    warm_age: Optional[float] = None


def spec(instance: str = "hot.in_zone.0", **kw: Any) -> InstanceSpec:
    return InstanceSpec(instance, "in_zone", "me", "c", "hot", TEXT, BrokerSpec("h", 1), keeper=True, **kw)


class Node:
    """The handlers with real cores and every call recorded, in order."""

    def __init__(self, tmp_path: Path, connected: bool = True) -> None:
        self.did: List[Tuple[Any, ...]] = []
        self.workers: Dict[str, Running] = {}
        self.undeploying: Set[str] = set()
        self.spawns = spawns.Spawns("me", "agent-me")
        self.stored = HostedSpecs(tmp_path / "state")
        self.fencing, self.pins = Fencing("me"), Pins()
        rec = self.did.append
        self.lines = WorkerLines(self.workers, self.spawns, gate(tmp_path), FleetView("me"), self.stored, self.fencing,
                                 self.pins, self.undeploying, LineCalls(
            observe=lambda w, wall: rec(("observe", w.spec.instance, wall)),
            send=lambda inst, event, **f: rec(("send", inst, event, f)),
            spawn=lambda e, now: rec(("spawn", e)),
            create_node=lambda s, reply, cause, now: rec(("create", s.instance, cause, reply)),
            event=lambda etype, inst, op, pipe, **d: rec((etype, inst, d)),
            publish_state=lambda now: rec(("state", now)),
            publish_hosted=lambda: rec(("hosted", [s.instance for s in self.stored.specs()])),
            saved=lambda i, gen, size: rec(("saved", i, gen, size)), replicate=lambda now: rec(("replicate",)),
            apply_pins=lambda: rec(("pins",)), changed=lambda: rec(("changed",)), connected=lambda: connected))

    def line(self, instance: str, event: str, now: float = 5.0, **fields: Any) -> None:
        self.lines.handle(instance, dict(fields, event=event), now, WALL)

    def kinds(self) -> List[Any]:
        return [d[0] for d in self.did]


def test_ready_stores_the_spec_and_publishes_our_hosted_record_before_createnode_answers(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.workers["hot.in_zone.0"] = Running(spec(extra={"handover_state": {"epoch": 3}}), started_at=1.0, warm_age=2.345)
    n.line("hot.in_zone.0", "ready", now=3.5)
    assert n.kinds() == ["changed", "hosted", "spawned", "spawn"]
    assert n.did[1] == ("hosted", ["hot.in_zone.0"])  # stored when published: a restart brings it back
    assert "handover_state" not in n.stored.specs()[0].extra  # a hand-over's state is not kept for a re-adoption
    assert n.did[2][2] == {"cause": "unknown", "warm": True, "warm_age_s": 2.35, "start_to_ready_s": 2.5}
    assert n.did[3][1] == spawns.Ready("hot.in_zone.0")


def test_ready_while_away_or_undeployed_or_pinned(tmp_path: Path) -> None:
    n = Node(tmp_path, connected=False)
    n.workers["hot.in_zone.0"] = Running(spec(restart=True))
    n.pins.pin(WALL, "hot", "in_zone", None)
    n.line("hot.in_zone.0", "ready")
    assert n.kinds() == ["changed", "pins", "spawned", "spawn"]  # the record goes at the next connect
    assert n.stored.dirty and n.did[2][2]["cause"] == "restart"
    gone = Node(tmp_path / "b")
    gone.workers["hot.in_zone.1"] = Running(spec("hot.in_zone.1"))
    gone.undeploying.add("hot.in_zone.1")
    gone.line("hot.in_zone.1", "ready")
    assert gone.kinds() == ["changed", "spawn"] and gone.stored.specs() == []  # never re-adopted


def test_a_workers_copy_is_admitted_then_placed_and_a_refusal_goes_back_to_it(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.workers["hot.in_zone.0"] = Running(spec())
    copy = json.loads(spec().to_json())
    copy.update(instance="hot.in_zone.1", keeper=False, active=False, succs=[], preds=[])
    n.lines.spawn("hot.in_zone.0", {"request": "r1", "spec": copy}, 5.0, WALL)
    [(_, inst, cause, reply)] = n.did
    assert (inst, cause) == ("hot.in_zone.1", "spawn")
    reply({"ok": True, "instance": "hot.in_zone.1", "node": "n2", "extra": "not for the worker"})
    assert n.did[-1] == ("send", "hot.in_zone.0", "spawned", {"request": "r1", "ok": True, "instance": "hot.in_zone.1",
                                                               "node": "n2"})
    n.undeploying.add("hot.in_zone.0")  # an undeploy stops it: it creates nothing more
    n.lines.spawn("hot.in_zone.0", {"request": "r2", "spec": dict(copy, instance="hot.in_zone.2")}, 6.0, WALL)
    assert n.did[-1][:3] == ("send", "hot.in_zone.0", "spawned") and n.did[-1][3]["ok"] is False
    assert n.did[-1][3]["request"] == "r2" and len([d for d in n.did if d[0] == "create"]) == 1


def test_the_other_lines(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.workers["hot.in_zone.0"] = Running(spec())
    n.line("hot.in_zone.0", "heartbeat")
    n.line("gone", "heartbeat")  # no worker: nothing
    assert n.did == [("observe", "hot.in_zone.0", WALL)]
    n.line("hot.in_zone.0", "may_reconnect", now=7.0)
    assert n.fencing.asks == {"hot.in_zone.0": 7.0} and n.did[-1] == ("state", 7.0)  # provokes the PUBACK
    n.line("hot.in_zone.0", "keyed_saved", gen=4, log=100, member="hot.in_zone.9")
    n.line("hot.in_zone.0", "keyed_saved", gen="4", log=100)  # not a number: nothing to copy
    assert n.did[-2:] == [("saved", "hot.in_zone.9", 4, 100), ("replicate",)]
    n.line("hot.in_zone.0", "round_cancelled", round=3, created=["x"], error="timeout")
    assert n.did[-1] == ("refused", "hot.in_zone.0", {"what": "round_cancelled", "round": 3, "created": ["x"],
                                                      "error": "timeout"})
    n.line("hot.in_zone.0", "exit", reason="drained")
    n.line("hot.in_zone.0", "no_such_event")
    assert n.did[-1] == ("changed",)
