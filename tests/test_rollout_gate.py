"""The health gate's verdict and wait loop (agent.fogctl.rollout_gate), sans IO: fogctl status
--json documents in, a verdict out; a fake clock, no broker, milliseconds."""

from __future__ import annotations

from typing import List, Optional

from agent.fogctl import rollout_gate as gate

T0 = 1_000.0


def doc(*rows: dict) -> dict:
    return {"cluster": "c", "nodes": list(rows), "pins": []}


def node(name: str, status: str = "online", ts: Optional[float] = T0 + 5, instances: List[str] = (),
         draining: bool = False, error: Optional[str] = None) -> dict:
    return {"node": name, "status": status, "ts": ts, "instances": list(instances), "draining": draining,
            "error": error}


def test_hosted_before_is_the_nodes_own_instances_and_nothing_for_a_fresh_node() -> None:
    d = doc(node("n1", instances=["b.0", "a.1"]), node("n2", instances=["c.0"]))
    assert gate.hosted_before(d, "n1") == ["a.1", "b.0"]
    assert gate.hosted_before(d, "n3") == [] and gate.hosted_before(None, "n1") == []


def test_a_replacement_of_a_lost_node_does_not_wait_for_what_the_dead_one_listed() -> None:
    """`chaos --testbed --faults lose-node`: the role installing a new disk under the name of a
    node lost after its instance had been re-homed onto it waited 300 s for that instance, which
    had ended since, and failed the reinstall."""
    d = doc(node("n1", instances=["a.0"]), node("n2", status="offline", instances=["in_zone-51369e1d426a"]))
    assert gate.hosted_before(d, "n2") == []


def test_ready_only_when_online_fresh_not_draining_and_every_instance_runs_again() -> None:
    before = ["a.0", "b.0"]
    assert not gate.verdict(None, "n1", before, T0).ready
    assert "no retained state" in gate.verdict(doc(node("n2")), "n1", before, T0).reason
    off = gate.verdict(doc(node("n1", status="offline", instances=before)), "n1", before, T0)
    assert not off.ready and "offline" in off.reason
    # the retained state of the process before the restart says nothing about the new one
    stale = gate.verdict(doc(node("n1", ts=T0 - 1, instances=before)), "n1", before, T0)
    assert not stale.ready and "since the restart" in stale.reason
    assert not gate.verdict(doc(node("n1", draining=True, instances=before)), "n1", before, T0).ready
    assert not gate.verdict(doc(node("n1", error="bad json", instances=before)), "n1", before, T0).ready
    missing = gate.verdict(doc(node("n1", instances=["a.0"])), "n1", before, T0)
    assert not missing.ready and "b.0" in missing.reason and "1 of 2" in missing.reason
    # re-homed by the drain to an online node counts; to an offline node it does not
    assert gate.verdict(doc(node("n1", instances=["a.0"]), node("n2", instances=["b.0"])), "n1", before, T0).ready
    assert not gate.verdict(doc(node("n1", instances=["a.0"]), node("n2", status="offline", instances=["b.0"])),
                            "n1", before, T0).ready
    assert gate.verdict(doc(node("n1", instances=before)), "n1", before, T0).ready
    assert gate.verdict(doc(node("n1")), "n1", [], T0).ready  # a fresh node: online is enough


def test_wait_returns_once_ready_and_gives_up_at_the_deadline() -> None:
    now = [T0]
    reads = iter([None, doc(node("n1", status="offline")), doc(node("n1", instances=["a.0"]))])

    def sleep(s: float) -> None:
        now[0] += s

    got = gate.wait(lambda: next(reads), "n1", ["a.0"], T0, timeout=60, period=2, clock=lambda: now[0], sleep=sleep)
    assert got.ready and now[0] == T0 + 4
    now[0] = T0
    never = gate.wait(lambda: doc(node("n1", status="offline")), "n1", [], T0, timeout=10, period=3,
                      clock=lambda: now[0], sleep=sleep)
    assert not never.ready and "n1: offline" in never.reason and now[0] == T0 + 10
