"""agent.node.reconcile on its own: which of our workers are fenced and which stored specs forgotten
after a connect, what the first connect re-adopts and with which settings, what a pipeline's
record stops, decided on stored spec files without a daemon, a broker or a process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

from agent.control.records import GENERATION_KEY, PipelineRecord
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import chains
from agent.node.fencing import Fencing
from agent.node.fleetview import FleetView
from agent.node.hosted import HostedSpecs
from agent.node.reconcile import ReconcileCalls, Reconciler
from pipelines import with_work
from test_node_core_gate import gate

WALL = 1_700_000_000.0
OURS = BrokerSpec("broker.local", 1883)  # this node's, as test_node_core_gate.gate has it


@dataclass
class Running:
    spec: InstanceSpec
    started_at: float


def spec(instance: str, function: str = "agent.operators.builtin:identity", **extra: Any) -> InstanceSpec:
    return InstanceSpec(instance, "work", "old-node", "c", "p", with_work(function), BrokerSpec("elsewhere", 1),
                        state_dir="/old/state", extra=dict(extra))


class Node:
    """Node "me" with its stored specs in `tmp_path`, every call recorded in order."""

    def __init__(self, tmp_path: Path, slots: int = 4) -> None:
        self.did: List[Tuple[Any, ...]] = []
        self.workers: Dict[str, Running] = {}
        self.undeploying: Set[str] = set()
        self.counters: Dict[str, int] = {}
        self.state = tmp_path / "state"
        self.stored = HostedSpecs(self.state)
        self.view = FleetView("me")
        self.fencing = Fencing("me")
        rec = self.did.append

        def forget(i: str) -> None:
            rec(("forget", i))
            self.stored.forget(i)

        def start(group: List[InstanceSpec], now: float) -> None:
            rec(("start", [s.instance for s in group]))
            self.started.extend(group)

        self.started: List[InstanceSpec] = []
        self.reconciler = Reconciler("me", slots, self.fencing, gate(tmp_path), self.view, self.stored, self.workers,
                                     self.undeploying, self.counters, ReconcileCalls(
            forget=forget, undeploy=lambda i: (rec(("undeploy", i)), self.undeploying.add(i)),
            kill=lambda i, now, why: rec(("kill", i, why)), stop=lambda i, now: rec(("stop", i)), start=start,
            local_spec=lambda s: dataclasses.replace(s, extra={**s.extra, "spill": {"on": 1}}),
            changed=lambda: rec(("changed",))))

    def run(self, instance: str, at: float, **extra: Any) -> None:
        self.workers[instance] = Running(spec(instance, **extra), at)

    def of(self, kind: str) -> List[Tuple[Any, ...]]:
        return [d for d in self.did if d[0] == kind]


def test_after_a_connect_our_copies_that_run_elsewhere_are_fenced_and_their_specs_forgotten(tmp_path: Path) -> None:
    n = Node(tmp_path)
    for inst in ("p.work.0", "p.work.1", "p.work.2"):
        n.stored.remember(spec(inst))
    n.run("p.work.0", 5.0)  # ran before the connect
    n.run("p.work.1", 15.0)  # placed here since: its old node's state may still list it
    n.fencing.connected(10.0)
    n.view.online = {"n2": True}
    n.view.fleet["n2"] = {"instances": [{"id": "p.work.0"}, {"id": "p.work.1"}, {"id": "p.work.2"}]}
    n.reconciler.reconcile(20.0, WALL)
    assert n.of("kill") == [("kill", "p.work.0", "re-homed elsewhere")]
    assert n.of("forget") == [("forget", "p.work.0"), ("forget", "p.work.2")]  # p.work.2: stored, not running
    assert [s.instance for s in n.stored.specs()] == ["p.work.1"]


def test_the_first_connect_readopts_admitted_specs_with_this_nodes_settings_and_chains_as_one(tmp_path: Path) -> None:
    n = Node(tmp_path, slots=2)
    a, b = chains.with_chain([spec("p.a.0"), spec("p.b.0")])
    for s in (a, b, spec("p.work.1"), spec("p.bad.0", function="builtins:exec"), spec("p.run.0")):
        n.stored.remember(s)
    n.fencing.started(n.stored.specs())
    n.run("p.run.0", 1.0)  # runs already: not started twice
    n.stored.dirty = False
    n.fencing.connected(0.0)
    n.reconciler.reconcile(1.0, WALL)
    assert sorted(d[1] for d in n.of("start")) == [["p.a.0", "p.b.0"], ["p.work.1"]]  # the chain as one
    assert all(s.restart and s.broker.host == OURS.host and s.state_dir == str(n.state) for s in n.started)
    assert all(s.extra["spill"] == {"on": 1} for s in n.started)  # this node's spool settings
    assert n.counters["readopted"] == 3 and n.did[-1] == ("changed",)
    assert (n.state / "p.bad.0.spec.json.refused").exists() and n.stored.dirty  # set aside, record changed
    assert "p.bad.0" not in {s.instance for s in n.stored.specs()}
    n.fencing.connected(30.0)
    n.reconciler.reconcile(31.0, WALL)  # a reconnect: no second re-adoption
    assert len(n.of("start")) == 2


def test_a_stored_spec_its_pipelines_record_rules_out_is_forgotten_not_readopted(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.stored.remember(spec("p.work.0", **{GENERATION_KEY: "g1"}))
    n.stored.remember(spec("p.work.1", **{GENERATION_KEY: "g2"}))
    n.fencing.started(n.stored.specs())
    n.view.records["p"] = PipelineRecord("deployed", "g2")
    n.reconciler.readopt(0.0, WALL)
    assert n.of("forget") == [("forget", "p.work.0")] and n.of("start") == [("start", ["p.work.1"])]


def test_an_undeploy_while_we_were_away_stops_what_runs_and_forgets_what_is_stored(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.stored.remember(spec("p.work.0"))
    n.stored.remember(spec("p.work.1"))  # runs: forgotten by its undeploy, once it is stopped
    n.run("p.work.1", 1.0)
    n.run("p.work.2", 1.0)
    n.undeploying.add("p.work.2")  # stopping for an undeploy already
    other = spec("q.work.0")
    n.workers["q.work.0"] = Running(InstanceSpec("q.work.0", "work", "me", "c", "q", other.pipeline_toml, OURS), 1.0)
    n.view.records["p"] = PipelineRecord("undeployed", None)
    n.reconciler.drop_stale("p", 5.0)
    assert n.did == [("forget", "p.work.0"), ("undeploy", "p.work.1"), ("stop", "p.work.1")]
    n.reconciler.drop_stale("q", 6.0)  # no record of q: kept
    assert len(n.did) == 3
