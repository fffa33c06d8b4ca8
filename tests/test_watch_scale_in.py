"""`fogctl watch` shows scale decisions in and out, with their reason, sans-IO (a fake connection).

A scale-in that a worker records only in its heartbeat stats (a forced one: `fogctl scale -1`,
a drain; a keyed instance leaving once its groups are handed over) reaches fogctl through the
agent's state. It used to be hidden: watch took any decision event of the instance (every
instance publishes "nothing to do" every few seconds) as the sign that its events were the
source, and a forced decision, recorded without a load, was skipped when the state was read.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, List

from agent import events
from agent.mqtt.requester import Message

CLUSTER = "c"
T0 = 1_700_000_000.0


def state(instances: List[Any]) -> Message:
    doc = {"version": 1, "node": "n1", "time": T0 + 10, "slots": 4, "free_slots": 2, "instances": instances}
    return Message(f"fog/{CLUSTER}/agents/n1/state", json.dumps(doc).encode(), retain=False)


def instance(iid: str, decisions: List[Any]) -> Any:
    return {"id": iid, "operator": "work", "pipeline": "p", "keeper": False, "status": "terminating",
            "load": 3.0, "capacity": 100.0, "stats": {"decisions": decisions}}


class FakeConn:
    def __init__(self, messages: List[Message]) -> None:
        self.messages = messages

    def __enter__(self) -> "FakeConn":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def stream(self, filters: Any, duration: Any = None, include_retained: bool = False) -> Iterator[Message]:
        return iter(self.messages)


def watch(capsys: Any, messages: List[Message], *more: str) -> List[str]:
    from agent.cli.fogctl import main

    assert main(["--broker", "127.0.0.1:1", "--cluster", CLUSTER, "watch", *more],
                connect=lambda cfg: FakeConn(messages)) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line]


def idle(iid: str, ts: float) -> Message:
    ev = events.decision(ts=ts, node="n1", instance=iid, operator="work", pipeline="p", load=3.0, capacity=100.0,
                         action="none", draw=0.5)
    return Message(f"fog/{CLUSTER}/events", ev.to_json().encode())


def test_a_scale_in_recorded_only_in_the_state_is_shown_with_its_reason(capsys: Any) -> None:
    msgs = [
        idle("p.work.1", T0), idle("p.work.2", T0),  # both publish their periodic decisions
        state([instance("p.work.1", [{"at": T0 + 5, "kind": "scale_in", "load": 3.0, "new": []}]),  # a keyed leaver
               instance("p.work.2", [{"at": T0 + 6, "kind": "scale_in", "forced": True, "new": []}])]),  # fogctl scale -1
    ]
    lines = watch(capsys, msgs)
    assert [line.split(" ", 1)[1] for line in lines] == [
        "n1 p.work.1 scale_in load=3.0 cap=100.0 ratio=0.03 -> terminate source=state",
        "n1 p.work.2 scale_in cause=forced action=terminate source=state"], lines

    # a decision the instance published itself is not shown twice (its state carries it too)
    ev = events.decision(ts=T0 + 5, node="n1", instance="p.work.1", operator="work", pipeline="p", load=150.0,
                         capacity=100.0, probability=0.5, draw=0.2, action="duplicate", count=1, type="scale_out",
                         detail={"new": ["p.work.3"]})
    msgs = [Message(f"fog/{CLUSTER}/events", ev.to_json().encode()),
            state([instance("p.work.1", [{"at": T0 + 5, "kind": "scale_out", "load": 150.0, "new": ["p.work.3"]}])])]
    lines = watch(capsys, msgs)
    assert len(lines) == 1 and "scale_out" in lines[0] and "p=0.500" in lines[0] and "source=state" not in lines[0]
    # nor a policy scale-out read from the state of an instance that publishes events (its own comes)
    lines = watch(capsys, [idle("p.work.1", T0),
                           state([instance("p.work.1", [{"at": T0 + 5, "kind": "scale_out", "load": 150.0,
                                                         "new": ["p.work.3"]}])])])
    assert lines == []
