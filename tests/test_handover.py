"""The key-group hand-over state machines (agent.instance.handover), explored exhaustively: one
group moving from OLD to NEW while two predecessors send records of it (and of a group that stays)
over FIFO channels, in every order the channels allow, with the decision at any point. In every
final state each record was applied exactly once, each sender's records in the order it sent
them, and nothing was left buffered, in flight or owned twice."""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Set, Tuple

import pytest

from agent.instance.handover import (
    Apply,
    Eos,
    Forget,
    HandoverError,
    Install,
    Installed,
    NewOwner,
    OldOwner,
    Predecessor,
    Redirect,
    Send,
    StateChunk,
    chunks,
)

G, STAYS = 7, 3  # the moving group, a group that stays with OLD


class World:
    def __init__(self, emits: Dict[str, List[Tuple[int, str]]], max_chunk: int) -> None:
        self.preds = {p: Predecessor(p, {G: "OLD", STAYS: "OLD"}) for p in emits}
        self.old = OldOwner("OLD", max_chunk=max_chunk)
        self.new = NewOwner("NEW")
        self.emits = {p: list(e) for p, e in emits.items()}
        self.started = False
        self.chan: Dict[Tuple[str, str], List[Any]] = {}
        self.state: Dict[str, Dict[int, List[Any]]] = {"OLD": {G: [], STAYS: []}, "NEW": {}}
        self.log: List[str] = []

    def key(self) -> str:
        o, n = self.old, self.new
        return repr((self.started, sorted(self.emits.items()), sorted((k, v) for k, v in self.chan.items() if v),
                     sorted(self.state["OLD"].items()), sorted(self.state["NEW"].items()),
                     sorted((p, sorted(x.owners.items())) for p, x in self.preds.items()),
                     sorted((g, v[0], sorted(v[1])) for g, v in o.moving.items()), sorted(o.gone),
                     sorted(o.waiting_install), sorted(n.expected.items()), sorted((g, sorted(p.items())) for g, p in n.parts.items()),
                     sorted(n.buffer.items()), sorted(n.owned)))

    def send(self, src: str, dest: str, msg: Any) -> None:
        self.chan.setdefault((src, dest), []).append(msg)

    def perform(self, who: str, outs: List[Any]) -> None:
        for o in outs:
            if isinstance(o, Send):
                self.send(who, o.dest, o.message)
            elif isinstance(o, Apply):
                st = self.state[who]
                assert o.group in st, f"{who} applied records of group {o.group} it does not hold"
                st[o.group].extend(r for _, r in o.records)
            elif isinstance(o, Install):
                assert o.group not in self.state[who], f"{who} installed group {o.group} twice"
                self.state[who][o.group] = json.loads(o.data)
            elif isinstance(o, Forget):
                del self.state[who][o.group]
            else:
                raise AssertionError(f"unknown output {o!r}")

    def events(self) -> List[Tuple[str, Any]]:
        ev: List[Tuple[str, Any]] = []
        if not self.started:
            ev.append(("start", None))
        ev += [("emit", p) for p, e in sorted(self.emits.items()) if e]
        ev += [("deliver", k) for k, v in sorted(self.chan.items()) if v]
        return ev

    def step(self, kind: str, arg: Any) -> None:
        self.log.append(f"{kind} {arg}")
        if kind == "start":
            self.started = True
            self.new.expect(G, "OLD")
            self.perform("OLD", self.old.start(G, "NEW", sorted(self.preds)))
        elif kind == "emit":
            group, rec = self.emits[arg].pop(0)
            self.send(arg, self.preds[arg].route(group), ("rec", group, rec))
        else:
            src, dest = arg
            msg = self.chan[arg].pop(0)
            if dest in self.preds:
                assert isinstance(msg, Redirect)
                self.perform(dest, self.preds[dest].on_redirect(src, msg))
            elif dest == "OLD":
                if isinstance(msg, Eos):
                    self.perform("OLD", self.old.on_eos(msg, lambda g: json.dumps(self.state["OLD"][g]).encode()))
                elif isinstance(msg, Installed):
                    self.perform("OLD", self.old.on_installed(msg))
                else:
                    self.perform("OLD", self.old.on_record(src, msg[1], msg[2]))
            else:
                if isinstance(msg, StateChunk):
                    self.perform("NEW", self.new.on_chunk(src, msg))
                else:
                    self.perform("NEW", self.new.on_record(src, msg[1], msg[2]))


def check_final(w: World, emitted: Dict[str, List[Tuple[int, str]]]) -> None:
    assert not any(w.chan.values()) and w.started, w.log
    assert G not in w.state["OLD"] and G in w.state["NEW"] and w.new.owned == {G}, w.log
    assert not w.old.moving and not w.old.waiting_install and not w.new.buffer, w.log
    for group, where in ((G, "NEW"), (STAYS, "OLD")):
        applied = w.state[where][group]
        want = [r for e in emitted.values() for g, r in e if g == group]
        assert sorted(applied) == sorted(want), (group, applied, w.log)  # each record exactly once
        for p, e in emitted.items():  # each sender's records in its order
            mine = [r for g, r in e if g == group]
            assert [r for r in applied if r in mine] == mine, (group, p, applied, w.log)


def explore(emits: Dict[str, List[Tuple[int, str]]], max_chunk: int) -> Tuple[int, int]:
    """Depth-first over every interleaving (states seen once); returns (states, final states)."""
    seen: Set[str] = set()
    finals = 0
    stack = [World(emits, max_chunk)]
    while stack:
        w = stack.pop()
        k = w.key()
        if k in seen:
            continue
        seen.add(k)
        evs = w.events()
        if not evs:
            check_final(w, emits)
            finals += 1
            continue
        for kind, arg in evs:
            nxt = copy.deepcopy(w)
            nxt.step(kind, arg)
            stack.append(nxt)
    return len(seen), finals


def test_a_group_moves_exactly_once_in_order_under_every_interleaving_of_two_senders() -> None:
    emits = {"P1": [(G, "a1"), (STAYS, "c1"), (G, "a2")], "P2": [(G, "b1"), (G, "b2")]}
    states, finals = explore(emits, max_chunk=8)  # a state of a few records: two or more chunks
    assert finals >= 1 and states > 1000, (states, finals)  # the exploration really branched


def test_the_state_travels_in_chunks_under_the_limit_and_arrives_whole() -> None:
    data = bytes(range(256)) * 10
    parts = chunks(5, data, max_chunk=300)
    assert [len(c.data) for c in parts] == [300] * 8 + [160] and {c.total for c in parts} == {9}
    new = NewOwner("NEW")
    new.expect(5, "OLD")
    outs: List[Any] = []
    for c in reversed(parts):  # any order: chunks are put together by their index
        outs = new.on_chunk("OLD", c)
    assert outs[0] == Install(5, data) and outs[-1] == Send("OLD", Installed(5))
    assert chunks(5, b"") == [StateChunk(5, 0, 1, b"")]


def test_impossible_inputs_are_errors_that_name_the_role_and_group() -> None:
    old = OldOwner("OLD")
    old.start(G, "NEW", ["P1"])
    old.on_eos(Eos(G, "P1"), lambda g: b"[]")
    with pytest.raises(HandoverError, match="old owner OLD: record of group 7 from P1 after its Eos"):
        old.on_record("P1", G, "late")
    with pytest.raises(HandoverError, match="predecessor P1: Redirect of group 7 from X, which does not own it"):
        Predecessor("P1", {G: "OLD"}).on_redirect("X", Redirect(G, "NEW"))
    with pytest.raises(HandoverError, match="new owner NEW: record of group 7 from P1, not owned nor expected"):
        NewOwner("NEW").on_record("P1", G, "r")
