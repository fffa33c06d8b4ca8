"""agent.node.fencing on its own: which of our instances another node runs after a connect, what
the first connect re-adopts, and when a worker may reconnect, decided on a given time line without
a daemon, a broker or a process."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from agent.control.records import GENERATION_KEY, PipelineRecord
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node.fencing import READOPT_SETTLE, Facts, Fencing, Readopt, Reconcile, Running, rehomed_by_others


def spec(instance: str, **extra: Any) -> InstanceSpec:
    return InstanceSpec(instance, "work", "me", "c", instance.split(".")[0], "", BrokerSpec("h", 1), extra=extra)


def facts(running: Mapping[str, Running], fleet: Optional[Dict[str, Any]] = None,
          online: Optional[Dict[str, bool]] = None, rehomed: Optional[Dict[str, Dict[str, float]]] = None,
          stored: Any = (), since: Optional[Dict[str, float]] = None) -> Facts:
    return Facts(running, set(stored), since or {}, fleet or {}, online or {}, rehomed or {})


def lists(*instances: str) -> Dict[str, Any]:
    return {"instances": [{"id": i} for i in instances]}


def connected(at: float = 10.0) -> Fencing:
    f = Fencing("me")
    f.connected(at)
    return f


def test_the_reconcile_is_due_once_per_connect_after_the_settle_with_the_records_in_and_not_while_stopping() -> None:
    f = Fencing("me")
    assert not f.reconcile_due(100.0, retained_in=True, stopping=False)  # never connected
    f.connected(10.0)
    assert not f.reconcile_due(10.0 + READOPT_SETTLE - 0.01, retained_in=True, stopping=False)
    assert not f.reconcile_due(20.0, retained_in=False, stopping=False)  # the retained records are not in
    assert not f.reconcile_due(20.0, retained_in=True, stopping=True)
    assert f.reconcile_due(10.0 + READOPT_SETTLE, retained_in=True, stopping=False)
    assert not f.reconcile_due(30.0, retained_in=True, stopping=False)  # once
    f.connected(40.0)  # a reconnect: again
    assert f.reconcile_due(41.5, retained_in=True, stopping=False)


def test_a_worker_that_an_online_node_lists_is_fenced_only_if_it_ran_before_the_connect() -> None:
    f = connected(10.0)
    running = {"p.old.0": Running(5.0), "p.new.0": Running(15.0), "p.mine.0": Running(5.0)}
    decided = f.reconcile(facts(running, fleet={"n2": lists("p.old.0", "p.new.0"), "n3": lists("p.mine.0")},
                                online={"n2": True, "n3": False}))  # n3's state is that of an offline node
    assert decided.fence == ("p.old.0",)  # p.new.0 was placed here since the connect
    assert f.gone("p.old.0") and not f.gone("p.old.0")  # fenced: said once, at its reaping
    assert not f.gone("p.new.0") and not f.gone("p.mine.0")


def test_when_two_nodes_ran_one_identity_the_copy_of_the_latest_rehome_stays_on_both_sides() -> None:
    rehomed = {"n3": {"work-a": 1000.4, "work-b": 990.7}}  # n3 re-homed work-a twice (the second at 1000)
    online = {"n1": True, "n2": True, "n3": True}

    def fences(node: str, floors: Dict[str, Optional[int]]) -> Reconcile:
        f = Fencing(node)
        f.connected(10.0)
        other = "n2" if node == "n1" else "n1"
        running = {i: Running(5.0, floor) for i, floor in floors.items()}
        return f.reconcile(facts(running, fleet={other: lists(*floors)}, online=online, rehomed=rehomed))

    assert fences("n1", {"work-a": 1000, "work-b": 990, "work-c": None}).fence == ("work-c",)
    assert fences("n2", {"work-a": 995, "work-b": 900, "work-c": None}).fence == ("work-a", "work-b", "work-c")


def test_an_instance_another_node_rehomed_after_we_hosted_it_is_fenced_and_its_stored_spec_forgotten() -> None:
    f = connected(10.0)
    rehomed = {"n2": {"p.a.0": 500.0, "p.b.0": 500.0, "p.c.0": 500.0}, "me": {"p.d.0": 500.0}}
    assert rehomed_by_others("me", rehomed) == {"p.a.0", "p.b.0", "p.c.0"}
    since = {"p.a.0": 400.0, "p.b.0": 400.0, "p.c.0": 600.0}  # p.c.0 hosted here after that re-home
    decided = f.reconcile(facts({"p.a.0": Running(5.0)}, rehomed=rehomed, online={"n2": False},
                                stored={"p.a.0", "p.b.0", "p.c.0", "p.d.0"}, since=since))
    assert decided.fence == ("p.a.0",)  # it may have terminated there since: it never runs here again
    assert decided.forget == ("p.b.0",)  # stored, not running: not re-adopted


def test_the_first_reconcile_readopts_what_is_still_stored_not_running_and_not_ruled_out() -> None:
    f = Fencing("me")
    f.started([spec("p.a.0"), spec("p.b.0"), spec("p.c.0"), spec("q.d.0", **{GENERATION_KEY: "g1"}),
               spec("r.e.0", **{GENERATION_KEY: "g1"})])
    f.connected(10.0)
    assert f.reconcile(facts({})).readopt
    records = {"q": PipelineRecord("undeployed", "g1"), "r": PipelineRecord("deployed", "g1")}
    todo = f.readopt(running={"p.b.0"}, stored={"p.a.0", "p.b.0", "q.d.0", "r.e.0"}, pipeline_records=records)
    assert [s.instance for s in todo.adopt] == ["p.a.0", "r.e.0"]  # p.c.0 was forgotten since
    assert [(s.instance, bool(why)) for s, why in todo.stale] == [("q.d.0", True)]
    f.connected(50.0)
    assert not f.reconcile(facts({})).readopt  # a reconnect fences, it never re-adopts again
    assert Fencing("me").readopt(set(), {"p.a.0"}, {}) == Readopt()  # nothing hosted at the start


def test_a_reconnect_is_granted_after_a_newer_puback_and_never_while_the_reconcile_is_pending() -> None:
    f = Fencing("me")
    f.asked("p.a.0", 5.0)
    f.asked("p.a.0", 9.0)  # its first ask counts
    assert f.grants({"p.a.0"}, connected=True, last_puback=8.0) == ["p.a.0"]
    assert f.grants({"p.a.0"}, connected=True, last_puback=8.0) == []  # granted once
    f.asked("p.b.0", 20.0)
    assert f.grants({"p.b.0"}, connected=True, last_puback=20.0) == []  # no PUBACK newer than the ask
    assert f.grants({"p.b.0"}, connected=False, last_puback=21.0) == []
    f.connected(22.0)
    assert f.grants({"p.b.0"}, connected=True, last_puback=23.0) == []  # the reconcile first
    assert f.reconcile_due(23.0, retained_in=True, stopping=False)
    assert f.grants({"p.b.0"}, connected=True, last_puback=23.0) == ["p.b.0"]


def test_the_ask_of_a_worker_that_left_or_was_fenced_is_dropped_not_granted() -> None:
    f = connected(10.0)
    f.reconcile_due(20.0, retained_in=True, stopping=False)
    f.asked("p.gone.0", 1.0)
    f.asked("p.fenced.0", 1.0)
    f.reconcile(facts({"p.fenced.0": Running(5.0)}, fleet={"n2": lists("p.fenced.0")}, online={"n2": True}))
    assert f.grants({"p.fenced.0"}, connected=True, last_puback=30.0) == []
    assert f.asks == {}
