"""The keyless outbox keeps each channel in input order when some records are pinned to a successor
(agent.dataplane.routing, `Outbox._pinned_fronts`), alone and inside the sans-IO instance. Pure:
no broker, no clock.

Why: a restarted source regenerates from its resume position; the records it had sent before are
pinned to their successor (docs/design.md invariant 8), the newer ones go to the shared buffer.
Each buffer left when it was full, so newer records overtook older ones on the same channel, and
the keyed window downstream dropped the older ones as late: the CI failure of
test_chaos_stateful (docs/reliability.md, "Replays in order")."""

from __future__ import annotations

import json
from typing import Dict, List, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from agent import topics
from agent.config import load_pipeline_text
from agent.dataplane.envelope import Kind, decode, encode_data
from agent.dataplane.routing import Outbox, Router
from agent.instance.commands import Persist, Publish, SaveRoutes
from agent.instance.core import Instance
from agent.instance.events import EnvelopeReceived, PubAcked, PublishAccepted, Restarted, Started, Tick
from agent.instance.spec import InstanceSpec
from foglab.sim.instance_check import BROKER, CLUSTER, WALL0, MemoryMap, pipeline_text


def recs(*seqs: int):  # type: ignore[no-untyped-def]
    return [("source-0", s, {"v": s}) for s in seqs]


def test_a_restarted_sources_regenerated_records_reach_its_successor_in_order() -> None:
    """One poll of a restarted source: 0-6 were sent before (pinned to v), 7-9 are new. The new
    ones fill a batch first; they must still leave after the older ones."""
    box = Outbox(Router(("v",)), batch_size=3, linger=0.05)
    box.add_to("v", recs(0, 1, 2, 3, 4, 5, 6), index=1, now=0.0)
    box.add(recs(7, 8, 9), index=1, now=0.0)
    sent: List[int] = []
    for now in (0.0, 0.01, 0.1, 0.2):
        for dest, items, low in box.take(now, lambda d: 2):
            assert dest == "v" and low == 1
            sent += [it[1] for it in items]
    assert sent == list(range(10))
    assert box.pending == 0 and box.lowest_index() is None


def test_a_pinned_record_waits_for_an_older_shared_one_on_the_same_channel_only() -> None:
    """Shared record 1 (input 1) comes before pinned record 2 (input 2): v gets 1 first. A
    record pinned to v never holds back shared records that go to w."""
    box = Outbox(Router(("v",)), batch_size=10, linger=1.0)
    box.add(recs(1), index=1, now=0.0)
    box.add_to("v", recs(2), index=2, now=0.0)
    out = box.take(0.0, lambda d: 5) + box.take(1.0, lambda d: 5)
    assert [(d, [it[1] for it in items]) for d, items, _ in out] == [("v", [1]), ("v", [2])]

    box = Outbox(Router(("v", "w")), batch_size=2, linger=1.0)
    box.add_to("v", recs(1), index=1, now=0.0)
    box.add(recs(2, 3), index=1, now=0.0)
    credit = {"v": 0, "w": 5}
    out = box.take(0.0, lambda d: credit[d])
    assert [(d, [it[1] for it in items]) for d, items, _ in out] == [("w", [2, 3])]
    credit["v"] = 5
    out = box.take(1.0, lambda d: credit[d])  # its linger: alone, a pinned record waits for a batch
    assert [(d, [it[1] for it in items]) for d, items, _ in out] == [("v", [1])]


# One input: (records pinned per successor, free records); then a take (time step, credit, force).
SUCCS = ("a", "b", "c")
inputs = st.tuples(st.lists(st.tuples(st.sampled_from(SUCCS), st.integers(1, 4)), max_size=2), st.integers(0, 5))
takes = st.tuples(st.floats(0.0, 0.2), st.dictionaries(st.sampled_from(SUCCS), st.integers(0, 3)), st.booleans())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(inputs, takes), min_size=1, max_size=25), st.integers(1, 5))
def test_every_successor_gets_its_records_in_the_order_the_inputs_were_taken(steps, batch_size) -> None:  # type: ignore[no-untyped-def]
    """Any mix of pinned and free records over three successors, any credit, batch size and
    time: on each channel the records come in the order they were added (as Instance._forward
    adds them: per input, the pinned ones, then the free ones), and none is lost or doubled."""
    box = Outbox(Router(SUCCS), batch_size=batch_size, linger=0.1)
    got: Dict[str, List[int]] = {d: [] for d in SUCCS}
    pinned_to: Dict[int, str] = {}
    seq, now = 0, 0.0

    def take(credit: Dict[str, int], force: bool) -> None:
        for dest, items, low in box.take(now, lambda d: credit.get(d, 0), force=force):
            got[dest] += [it[1] for it in items]

    for index, ((pins, free), (dt, credit, force)) in enumerate(steps, start=1):
        for dest, n in pins:
            box.add_to(dest, recs(*range(seq, seq + n)), index, now)
            pinned_to.update({s: dest for s in range(seq, seq + n)})
            seq += n
        box.add(recs(*range(seq, seq + free)), index, now)
        seq += free
        now += dt
        take(credit, force)
    for _ in range(seq + 1):  # each forced take with credit sends at least one record
        if not box.pending:
            break
        take({d: 1 for d in SUCCS}, True)
    every: List[Tuple[int, str]] = sorted((s, d) for d, ss in got.items() for s in ss)
    assert [s for s, _ in every] == list(range(seq)), "lost or doubled"
    for dest, ss in got.items():
        assert ss == sorted(ss), (dest, ss)
    assert all(pinned_to.get(s, d) == d for s, d in every)
    assert box.pending == 0 and box.lowest_index() is None


def test_a_restarted_instance_forwards_the_records_sent_before_and_the_new_ones_in_their_order() -> None:
    """The same through the instance (agent.instance.core): op-0 forwarded records 0-5 to
    sink-0 and was killed; restarted, it gets 0-9 in one batch (a restarted source's first poll
    regenerates from its resume position). 0-5 are pinned to sink-0 by the route memory, 6-9
    are free; sink-0 must get 0-9 in this order (before the fix: 0-3, 6-9, 4-5)."""
    toml = pipeline_text(batch=4, window=16).replace("linger_ms = 0", "linger_ms = 50")
    pipeline = load_pipeline_text(toml, "test pipeline")
    spec = InstanceSpec("op-0", "op", "n1", CLUSTER, "chk", toml, BROKER, succs=("sink-0",), preds=("source-0",),
                        keeper=True, state_dir="/nonexistent", heartbeat_period=3600.0)
    inbox, to_sink = topics.inbox(CLUSTER, "op-0", "n1"), topics.inbox(CLUSTER, "sink-0", "n1")

    def run(inst: Instance, cmds: List[object], now: float) -> List[int]:
        """Perform the publishes (each accepted and PUBACKed); the record numbers sent to sink-0."""
        seqs: List[int] = []
        for c in cmds:
            if isinstance(c, Publish):
                env = decode(c.payload)
                if c.topic == to_sink and env.kind is Kind.DATA:
                    seqs += [it[1] for it in env.body]
                inst.handle(PublishAccepted(c.token, c.token), now)
                inst.handle(PubAcked(c.token), now)
        return seqs

    op = Instance(spec, pipeline, MemoryMap())
    cmds = op.handle(Started(WALL0), 0.0)
    cmds += op.handle(EnvelopeReceived(inbox, encode_data("source-0", 0, 1, recs(*range(6)))), 0.1)
    cmds += op.handle(Tick(WALL0 + 0.2), 0.2)
    cmds += op.handle(Tick(WALL0 + 0.3), 0.3)  # after the linger
    assert run(op, cmds, 0.3) == list(range(6))
    saved = [c.state for c in cmds if isinstance(c, Persist)][-1]  # then kill -9, before sink-0 acks
    snapshot, log = None, ""
    for c in cmds:
        if isinstance(c, SaveRoutes):
            snapshot, log = (c.snapshot, "") if c.snapshot is not None else (snapshot, log)
            log += c.log

    again = Instance(spec, pipeline, MemoryMap())
    run(again, again.handle(Restarted(WALL0 + 1, json.loads(json.dumps(saved)), routes=(snapshot, log)), 1.0), 1.0)
    cmds = again.handle(EnvelopeReceived(inbox, encode_data("source-0", 1, 1, recs(*range(10)))), 1.0)
    sent: List[int] = []
    for t in (1.0, 1.01, 1.02, 1.2):
        cmds += again.handle(Tick(WALL0 + t), t)
        sent += run(again, cmds, t)
        cmds = []
    assert again.outputs.routes.pinned == 6
    assert sent == list(range(10))
