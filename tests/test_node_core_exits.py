"""agent.node.exits on its own: what a worker's exit makes the node forget, whether the instance
moves, starts again or is gone, and which restarts start together, decided on a given time line
without a daemon, a broker or a process."""

from __future__ import annotations

from typing import Any, Dict, List, Set, Tuple

from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import chains, spawns
from agent.node.drain import COPIES_FIRST_WAIT, Drain
from agent.node.exits import ExitCalls, Exited, Exits
from agent.node.fencing import Facts, Fencing, Running
from agent.node.hostsync import HostSync
from agent.node.pins import Pins
from agent.node.restarts import MAX_RESTARTS, Restarts


def spec(instance: str = "p.work.0", keeper: bool = False) -> InstanceSpec:
    return InstanceSpec(instance, instance.split(".")[1], "me", "c", "p", "", BrokerSpec("h", 1), keeper=keeper)


def crash(s: InstanceSpec, **kw: Any) -> Exited:
    return Exited(s, {"in": 3}, -9, "exit status -9", clean=False, crashed=True, **kw)


class Node:
    """The exits part with real cores and every call recorded, in order."""

    def __init__(self) -> None:
        self.did: List[Tuple[Any, ...]] = []
        self.stopping = False
        self.running: Set[str] = set()
        self.spawns = spawns.Spawns("me", "agent-me")
        self.drain, self.fencing, self.restarts = Drain(), Fencing("me"), Restarts()
        self.hosts = HostSync("me")
        self.counters: Dict[str, int] = {"restarts": 0}
        rec = self.did.append
        self.exits = Exits("me", self.spawns, self.drain, self.fencing, Pins(), self.restarts, self.hosts,
                           self.running, self.counters,
                           ExitCalls(unhost=lambda i: rec(("unhost", i)), forget=lambda i: rec(("forget", i)),
                                     spawn=lambda e, now: rec(("spawn", e)),
                                     event=lambda etype, inst, op, pipe, **d: rec((etype, inst, d.get("cause"))),
                                     hand_over=lambda s, stats, now: rec(("hand_over", s.instance, dict(stats))),
                                     start=lambda group, now: rec(("start", [s.instance for s in group], now)),
                                     stop=lambda i, now: rec(("stop", i)), stopping=lambda: self.stopping))

    def of(self, kind: str) -> List[Tuple[Any, ...]]:
        return [d for d in self.did if d[0] == kind]


def test_a_crash_starts_again_with_the_same_identity_then_with_backoff_and_never_while_stopping() -> None:
    n = Node()
    for k in range(MAX_RESTARTS + 1):
        n.exits.reaped(crash(spec()), 10.0 + k)
    assert [d[1] for d in n.of("start")] == [["p.work.0"]] * MAX_RESTARTS  # the next one waits
    assert n.counters["restarts"] == MAX_RESTARTS and ("terminated", "p.work.0", "crash") in n.did
    assert n.of("unhost") == [] and n.of("forget") == []  # still hosted: it comes back
    n.stopping = True
    n.exits.tick(100.0)  # its backoff is over, but the agent stops: not now
    assert len(n.of("start")) == MAX_RESTARTS and "p.work.0" in n.restarts.delayed
    n.stopping = False
    n.exits.tick(100.0)
    assert n.of("start")[-1] == ("start", ["p.work.0"], 100.0) and n.counters["restarts"] == MAX_RESTARTS + 1


def test_a_worker_that_left_for_good_or_had_a_bad_spec_is_never_re_adopted() -> None:
    n = Node()
    n.exits.reaped(Exited(spec("p.a.0"), {}, 0, "drained", clean=True, crashed=False, said_final=True), 1.0)
    assert n.of("unhost") == [("unhost", "p.a.0")] and n.of("start") == []
    assert ("terminated", "p.a.0", "scale_in") in n.did
    n.exits.reaped(Exited(spec("p.b.0"), {}, 3, "exit status 3", clean=False, crashed=True, bad_spec=True), 2.0)
    assert n.of("unhost")[-1] == ("unhost", "p.b.0")  # its stored spec goes: an agent restart cannot help


def test_an_undeployed_instance_is_forgotten_at_its_exit_and_never_restarted_even_after_a_crash() -> None:
    n = Node()
    n.exits.undeployed("p.work.0")
    n.exits.reaped(crash(spec()), 1.0)
    assert n.of("forget") == [("forget", "p.work.0")] and n.of("start") == []
    assert ("terminated", "p.work.0", "undeploy") in n.did and n.exits.undeploying == set()
    n.exits.reaped(crash(spec()), 2.0)  # the same identity again later, not undeployed: a crash
    assert n.of("start") == [("start", ["p.work.0"], 2.0)]


def test_a_fenced_worker_is_not_started_again() -> None:
    n = Node()
    n.fencing.connected(10.0)
    facts = Facts({"p.work.0": Running(1.0)}, set(), {}, {"n2": {"instances": [{"id": "p.work.0"}]}},
                  {"n2": True}, {})
    assert n.fencing.reconcile(facts).fence == ("p.work.0",)
    n.exits.reaped(crash(spec()), 11.0)
    assert n.of("start") == [] and n.counters["restarts"] == 0


def test_a_worker_that_exits_before_its_spawn_is_answered_moves_the_walk_on_and_does_not_come_back() -> None:
    n = Node()
    s = spec()
    (start,) = n.spawns.handle(spawns.SpawnRequest(s, "adm", "deploy", "adm"), 1.0)
    n.spawns.handle(spawns.LocalStart(start.job, None), 1.0)
    n.exits.reaped(crash(s, asked_to_stop=False), 5.0)
    assert n.of("unhost") == [("unhost", "p.work.0")]
    (spawned,) = n.of("spawn")
    assert isinstance(spawned[1], spawns.Exited) and spawned[1].instance == "p.work.0"
    assert n.of("start") == [] and not n.restarts.delayed  # one identity never on two nodes


def test_a_drained_keeper_moves_with_its_stats_and_during_a_shutdown_stays() -> None:
    n = Node()
    n.drain.set(True)
    assert n.drain.hand_over("p.k.0", set(), 1.0)
    stopped = Exited(spec("p.k.0", keeper=True), {"epoch": 4}, 0, "stopped", clean=True, crashed=False)
    n.exits.reaped(stopped, 2.0)
    assert n.of("hand_over") == [("hand_over", "p.k.0", {"epoch": 4})] and n.of("start") == []
    assert ("terminated", "p.k.0", "handover") in n.did
    n.stopping = True
    n.drain.hand_over("p.k.0", set(), 3.0)
    n.exits.reaped(stopped, 4.0)
    assert len(n.of("hand_over")) == 1 and ("terminated", "p.k.0", "shutdown") in n.did


def test_a_waiting_keeper_is_stopped_once_its_copies_left_and_only_if_it_still_runs() -> None:
    n = Node()
    n.running.update({"p.k.0", "p.j.0"})
    n.drain.set(True)
    n.drain.hand_over("p.k.0", {"p.c.1"}, 10.0)
    n.drain.hand_over("p.j.0", {"p.c.1"}, 10.0)
    n.running.discard("p.j.0")  # exited meanwhile (then `exited` took it, not a stop)
    n.exits.release_keepers(11.0)
    assert n.of("stop") == []
    n.exits.reaped(Exited(spec("p.c.1"), {}, 0, "left", clean=True, crashed=False, said_final=True), 12.0)
    assert n.of("stop") == [("stop", "p.k.0")]
    n.drain.hand_over("p.x.0", {"p.c.2"}, 20.0)
    n.running.add("p.x.0")
    n.exits.release_keepers(20.0 + COPIES_FIRST_WAIT)  # the copy never left: the wait is over
    assert n.of("stop")[-1] == ("stop", "p.x.0")


def test_the_members_of_a_crashed_chain_start_again_together_at_the_end_of_the_turn() -> None:
    n = Node()
    a, b, c = chains.with_chain([spec("p.a.0"), spec("p.b.0"), spec("p.c.0")])
    for member in (c, a, b):
        n.exits.reaped(crash(member, chained=True), 1.0)
    assert n.of("start") == []  # held: not one process per member
    n.exits.tick(1.0)
    assert n.of("start") == [("start", ["p.a.0", "p.b.0", "p.c.0"], 1.0)] and n.counters["restarts"] == 3


def test_a_chain_member_stopped_only_because_another_was_asked_to_starts_again() -> None:
    n = Node()
    a, b = chains.with_chain([spec("p.a.0"), spec("p.b.0")])
    n.exits.reaped(Exited(a, {}, 0, "stopped", clean=False, crashed=False, chained=True, asked_to_stop=True), 1.0)
    n.exits.reaped(Exited(b, {}, 0, "stopped", clean=False, crashed=False, chained=True), 1.0)
    n.exits.tick(1.0)
    assert n.of("start") == [("start", ["p.b.0"], 1.0)]
