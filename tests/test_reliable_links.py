"""ReliableLinks (agent.instance.recovery): exactly-once FIFO protocol channels over a bus that
loses and repeats messages, with crashes that restore the last persisted state.

The model mirrors the worker: a node's state (its links, what it delivered, its queued sends)
is one record written atomically; a send is queued (written) before it is performed and the
record is written again after; a crash restores the last record, so a send performed just
before the crash is performed again with the same number. The bus keeps each channel FIFO and
may drop any message (a broker killed before its autosave), duplicate one, or lose everything
in flight, and a crash loses the messages the node had taken but not processed.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any, Dict, List, Tuple

import pytest

from agent.instance.recovery import ACK_AFTER, LINK_ACK, RESEND_AFTER, LinkError, ReliableLinks


class Node:
    def __init__(self, name: str, peers: List[str], gen: int, cls: type = ReliableLinks) -> None:
        self.name = name
        self.peers = peers
        self.cls = cls
        self.links = cls(name, gen)
        self.delivered: Dict[str, List[int]] = {p: [] for p in peers}
        self.queued: List[Tuple[str, Dict[str, Any]]] = []  # write-ahead sends
        self.sent: Dict[str, List[int]] = {p: [] for p in peers}  # what the app asked to send
        self.counter = 0
        self.saved = ""
        self.save()

    def save(self) -> None:
        self.saved = json.dumps({"links": self.links.dump(), "delivered": self.delivered, "queued": self.queued,
                                 "sent": self.sent, "counter": self.counter})

    def crash(self, now: float) -> None:
        d = json.loads(self.saved)
        self.links = self.cls.load(self.name, d["links"], now)
        self.delivered = d["delivered"]
        self.queued = [(p, b) for p, b in d["queued"]]
        self.sent = d["sent"]
        self.counter = d["counter"]


class Bus:
    def __init__(self) -> None:
        self.chan: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}

    def put(self, src: str, dest: str, body: Dict[str, Any]) -> None:
        self.chan.setdefault((src, dest), []).append(copy.deepcopy(body))


def run(seed: int, steps: int = 400, nodes: int = 3, faults: bool = True, cls: type = ReliableLinks) -> Dict[str, Node]:
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(nodes)]
    net = {n: Node(n, [p for p in names if p != n], gen=100 + i, cls=cls) for i, n in enumerate(names)}
    bus = Bus()
    now = 0.0

    def perform(node: Node, pairs: List[Tuple[str, Dict[str, Any]]]) -> None:
        if pairs:
            node.save()  # the driver writes before any ack or resend leaves
        for dest, body in pairs:
            bus.put(node.name, dest, body)

    def step(node: Node, crash_ok: bool) -> None:
        nonlocal now
        r = rng.random()
        if r < 0.25:  # the app sends a new message: queued (written), then performed
            dest = rng.choice(node.peers)
            node.counter += 1
            node.sent[dest].append(node.counter)
            node.queued.append((dest, {"type": "m", "sender": node.name, "i": node.counter}))
            node.save()
        if node.queued and rng.random() < 0.7:
            dest, body = node.queued[0]
            bus.put(node.name, dest, node.links.stamp(dest, body, now))
            if crash_ok and rng.random() < 0.05:
                node.crash(now)  # performed but not written: performed again after the restart
                perform(node, node.links.resync(node.peers, now))
                return
            node.queued.pop(0)
            node.save()
        chans = [k for k, v in bus.chan.items() if k[1] == node.name and v]
        if chans:
            src, _ = rng.choice(chans)
            body = bus.chan[(src, node.name)].pop(0)
            msg, replies = node.links.receive(src, body, now)
            if msg is not None:
                node.delivered[src].append(msg["i"])
            node.save()
            perform(node, replies)
        perform(node, node.links.due(now))

    for _ in range(steps):
        now += rng.uniform(0.0, 1.5)
        node = net[rng.choice(names)]
        if faults:
            f = rng.random()
            if f < 0.02:  # the broker is killed: everything in flight is gone
                bus.chan.clear()
            elif f < 0.06:
                k = rng.choice(list(bus.chan) or [None])
                if k is not None and bus.chan[k]:
                    bus.chan[k].pop(rng.randrange(len(bus.chan[k])))  # one message lost
            elif f < 0.09:
                k = rng.choice(list(bus.chan) or [None])
                if k is not None and bus.chan[k]:
                    i = rng.randrange(len(bus.chan[k]))
                    bus.chan[k].insert(i, copy.deepcopy(bus.chan[k][i]))  # one message twice
            elif f < 0.11:  # the node crashes: restores its record, loses nothing it wrote
                node.crash(now)
                perform(node, node.links.resync(node.peers, now))
        step(node, crash_ok=faults)
    # faults over: the bus delivers, time passes, until nothing is left to do
    for _ in range(5000):
        now += 0.5
        busy = False
        for node in net.values():
            while node.queued:
                dest, body = node.queued.pop(0)
                bus.put(node.name, dest, node.links.stamp(dest, body, now))
                node.save()
            for (src, dest), q in list(bus.chan.items()):
                if dest == node.name:
                    while q:
                        busy = True
                        msg, replies = node.links.receive(src, q.pop(0), now)
                        if msg is not None:
                            node.delivered[src].append(msg["i"])
                        perform(node, replies)
            pairs = node.links.due(now)
            busy = busy or bool(pairs)
            perform(node, pairs)
        if not busy and all(n.links.settled and not n.links.ack_due for n in net.values()):
            break
    return net


@pytest.mark.parametrize("seed", range(60))
def test_every_message_delivered_once_in_order_despite_loss_repeats_and_crashes(seed: int) -> None:
    net = run(seed)
    for node in net.values():
        for peer in node.peers:
            assert net[peer].delivered[node.name] == node.sent[peer], (seed, node.name, peer)
        assert node.links.settled, node.links.dump()


class NoResend(ReliableLinks):
    def _resend(self, dest: str, now: float) -> List[Tuple[str, Dict[str, Any]]]:
        return []


def test_the_fault_model_is_not_vacuous() -> None:
    """Links that never resend lose messages under the same faults (the test above can fail),
    and links that do resend needed to in most schedules."""
    resent = sum(sum(n.links.counts["resent"] for n in run(seed).values()) > 0 for seed in range(10))
    assert resent >= 8
    broken = 0
    for seed in range(10):
        net = run(seed, steps=200, cls=NoResend)
        broken += any(net[p].delivered[n.name] != n.sent[p] for n in net.values() for p in n.peers)
    assert broken >= 5


def test_no_fault_costs_one_ack_per_unanswered_message_and_no_resend() -> None:
    a, b = ReliableLinks("a", 1), ReliableLinks("b", 2)
    m = a.stamp("b", {"type": "end", "sender": "a"}, 0.0)
    got, replies = b.receive("a", m, 0.1)
    assert got == {"type": "end", "sender": "a"} and replies == []
    assert b.due(0.1 + ACK_AFTER - 0.01) == [] and a.due(RESEND_AFTER - 0.01) == []
    (dest, ack), = b.due(0.1 + ACK_AFTER)
    assert dest == "a" and ack == {"type": LINK_ACK, "sender": "b", "ack": [1, 1], "sync": False}
    assert a.receive("b", ack, 6.0) == (None, [])
    assert a.settled and a.due(100.0) == [] and a.counts["resent"] == 0
    # a reply carries the ack: no ack alone
    m2 = a.stamp("b", {"type": "req", "sender": "a"}, 7.0)
    b.receive("a", m2, 7.1)
    reply = b.stamp("a", {"type": "ack", "sender": "b"}, 7.2)
    assert reply["link"] == [2, 1, 1, 2] and "a" not in b.ack_due
    a.receive("b", reply, 7.3)
    assert a.settled


def test_gap_asks_for_a_resend_and_the_resend_fills_it_in_order() -> None:
    a, b = ReliableLinks("a", 1), ReliableLinks("b", 2)
    m1, m2, m3 = (a.stamp("b", {"type": "x", "sender": "a", "i": i}, 0.0) for i in (1, 2, 3))
    assert b.receive("a", m1, 0.0)[0]["i"] == 1
    got, replies = b.receive("a", m3, 0.1)  # m2 lost
    assert got is None and [r[1]["sync"] for r in replies] == [True] and b.counts["gaps"] == 1
    resent = []
    for _, body in replies:
        resent += a.receive("b", body, 0.2)[1]
    assert [body["i"] for _, body in resent] == [2, 3]
    assert [b.receive("a", body, 0.3)[0]["i"] for _, body in resent] == [2, 3]
    assert b.receive("a", m3, 0.4) == (None, [])  # the late original: a repeat
    assert b.counts["duplicates"] == 1


def test_an_instance_leaving_acks_everything_it_delivered() -> None:
    a, b = ReliableLinks("a", 1), ReliableLinks("b", 2)
    b.receive("a", a.stamp("b", {"type": "start", "sender": "a"}, 0.0), 0.0)
    (dest, ack), = b.flush_acks()
    assert dest == "a" and a.receive("b", ack, 0.1) == (None, []) and a.settled and b.flush_acks() == []


def test_departed_peer_is_acked_at_once_and_forgotten() -> None:
    a, b = ReliableLinks("a", 1), ReliableLinks("b", 2)
    b.receive("a", a.stamp("b", {"type": "end", "sender": "a"}, 0.0), 0.0)
    (dest, ack), = b.forget("a")
    assert dest == "a" and ack["ack"] == [1, 1]
    a.receive("b", ack, 0.1)
    assert a.settled
    assert "a" not in b.dump()["in"] and b.due(100.0) == []
    late = {"type": "end", "sender": "a", "link": [1, 1, 0, 0]}  # a copy resent before the ack arrived
    assert b.receive("a", late, 1.0) == (None, []) and b.counts["stale"] == 1  # never answered


def test_a_new_generation_restarts_the_channel_and_a_lost_state_starts_at_the_first() -> None:
    a, b = ReliableLinks("a", 1), ReliableLinks("b", 2)
    for i in range(3):
        b.receive("a", a.stamp("b", {"type": "x", "sender": "a", "i": i}, 0.0), 0.0)
    a2 = ReliableLinks("a", 5)  # re-homed: no state, a later generation
    got, _ = b.receive("a", a2.stamp("b", {"type": "x", "sender": "a", "i": 9}, 1.0), 1.0)
    assert got is not None and got["i"] == 9
    assert b.receive("a", a.stamp("b", {"type": "x", "sender": "a", "i": 4}, 1.0), 1.0) == (None, [])  # old one
    assert b.counts["stale"] == 1
    c = ReliableLinks("c", 7, lost_state=True)  # re-homed receiver: a's channel is at 4
    got, _ = c.receive("a", {"type": "x", "sender": "a", "link": [1, 4, 0, 0]}, 0.0)
    assert got is not None
    fresh = ReliableLinks("d", 8)  # a brand-new instance: a channel starts at 1
    got, replies = fresh.receive("a", {"type": "x", "sender": "a", "link": [1, 4, 0, 0]}, 0.0)
    assert got is None and replies and replies[0][1]["sync"] is True


@pytest.mark.parametrize("body", [
    {"type": "x", "sender": "a", "link": [1, 0, 0, 0]},
    {"type": "x", "sender": "a", "link": [1, 1, 0]},
    {"type": "x", "sender": "a", "link": [1, "1", 0, 0]},
    {"type": "x", "sender": "a", "link": [1, True, 0, 0]},
    {"type": "x", "sender": "a", "link": [1, -1, 0, 0]},
    {"type": "x", "sender": "a", "link": "1,1,0,0"},
    {"type": LINK_ACK, "sender": "a", "ack": [1], "sync": False},
    {"type": LINK_ACK, "sender": "a", "ack": [1, 2], "sync": 1},
    {"type": LINK_ACK, "sender": "a", "ack": [1, 2], "sync": False, "more": 1},
])
def test_malformed_link_fields_are_refused_without_a_state_change(body: Dict[str, Any]) -> None:
    b = ReliableLinks("b", 2)
    before = b.dump()
    with pytest.raises(LinkError):
        b.receive("a", body, 0.0)
    assert b.dump() == before


def test_dump_load_round_trip_and_damaged_record() -> None:
    a = ReliableLinks("a", 3)
    a.stamp("b", {"type": "x", "sender": "a"}, 0.0)
    a.receive("c", {"type": "x", "sender": "c", "link": [9, 1, 0, 0]}, 0.0)
    again = ReliableLinks.load("a", json.loads(json.dumps(a.dump())), 5.0)
    assert again.dump() == a.dump()
    with pytest.raises(ValueError):
        ReliableLinks.load("a", {"generation": 1, "out": {"b": {"next": "x"}}, "in": {}}, 0.0)
