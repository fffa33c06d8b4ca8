"""The per-instance scaling core: message costs, ordering contract, error contract, snapshots."""

from __future__ import annotations

import json
import random

import pytest

from agent.policy.decentralized import Action, Decision, ScalingParams, decide, r_secure
from agent.protocol.errors import LocalProtocolError, RemoteProtocolError
from agent.protocol.messages import DataBatch, Deletion, DeletionAck, Duplication, DuplicationAck, Start
from agent.protocol.scaling import (
    Activate,
    CreateInstance,
    Drain,
    InstanceState,
    RoutesChanged,
    ScalingCore,
    Send,
    Terminate,
)
from foglab.sim.checker import Plan, build_pipeline

P = ScalingParams()


def run_to_quiescence(system, seed=0):
    """Deliver messages in a seeded random FIFO order until nothing moves; count protocol sends."""
    rng = random.Random(seed)
    sent = 0
    while True:
        moves = system.moves(frozenset())
        if not moves:
            return sent
        move = rng.choice(moves)
        before = sum(len(q) for q in system.channels.values())
        assert system.apply(move) is None
        assert system.safety() is None
        after = sum(len(q) for q in system.channels.values())
        sent += after - before + (1 if move[0] == "deliver" else 0)


@pytest.mark.parametrize("sizes,stage", [([1, 1, 1], 1), ([3, 2, 4], 1), ([5, 3, 1], 1), ([2, 3], 0), ([4, 2], 1)])
@pytest.mark.parametrize("copies", [1, 3])
def test_one_duplication_costs_2_neighbours_plus_copies(sizes, stage, copies):
    system = build_pipeline(sizes, [Plan(f"s{stage}i0", Action.DUPLICATE, copies)])
    core = system.cores[f"s{stage}i0"]
    neighbours = len(core.succs) + len(core.preds)
    assert run_to_quiescence(system) == 2 * neighbours + copies
    assert system.quiescence() is None
    assert sum(1 for c in system.cores.values() if c.stage == stage) == sizes[stage] + copies


@pytest.mark.parametrize("sizes,stage", [([1, 2, 1], 1), ([3, 2, 4], 1), ([2, 3], 1), ([2, 3], 0)])
def test_one_deletion_costs_2_neighbours(sizes, stage):
    system = build_pipeline(sizes, [Plan(f"s{stage}i1", Action.TERMINATE)])
    core = system.cores[f"s{stage}i1"]
    neighbours = len(core.succs) + len(core.preds)
    assert run_to_quiescence(system) == 2 * neighbours
    assert system.cores[f"s{stage}i1"].terminated
    assert system.quiescence() is None


@pytest.mark.parametrize("n,k", [(3, 2), (3, 3), (2, 5), (4, 1)])
def test_k_new_instances_by_n_siblings(n, k):
    """k copies spread over min(k, n) siblings cost 2*min(k,n)*(|succs|+|preds|) + k."""
    sizes = [2, n, 3]
    doers = min(k, n)
    counts = [k // doers + (1 if i < k % doers else 0) for i in range(doers)]
    plans = [Plan(f"s1i{i}", Action.DUPLICATE, c) for i, c in enumerate(counts)]
    system = build_pipeline(sizes, plans)
    assert run_to_quiescence(system, seed=n * 10 + k) == 2 * doers * (2 + 3) + k
    assert system.quiescence() is None


def test_duplication_orders_effects_before_dependent_sends():
    core = ScalingCore.initial("b0", "B", 1, P, succs=["c0"], preds=["a0"])
    out = core.start_duplication(2)
    creates = [i for i, o in enumerate(out) if isinstance(o, CreateInstance)]
    sends = [i for i, o in enumerate(out) if isinstance(o, Send)]
    assert creates and sends and max(creates) < min(sends)  # subscribe before announce
    assert core.state is InstanceState.DUPLICATING
    # a neighbour changes its routes before it acks
    c0 = ScalingCore.initial("c0", "C", 2, P, preds=["b0"])
    reply = c0.handle(out[-2].message if out[-2].dest == "c0" else out[-1].message)
    assert isinstance(reply[0], RoutesChanged) and isinstance(reply[1], Send)
    assert isinstance(reply[1].message, DuplicationAck)
    assert set(reply[0].preds) == {"b0"} | {o.instance_id for o in out if isinstance(o, CreateInstance)}


def test_copy_ids_are_never_reused_by_a_later_incarnation():
    """Copy ids are a pure function of (instance, incarnation, round, k): the same incarnation
    replays a round with the same ids (the idempotent createNode() after a crash), while a later
    incarnation that restarted from a rebuilt state (re-homed: round back at 0) gets new ids.
    Regression: a re-homed keeper's first copy took the id of a copy its dead incarnation had
    created and that had since terminated, restored that copy's final state, and stalled."""

    def first_copies(incarnation: int) -> set:
        core = ScalingCore.initial("b0", "B", 1, P, succs=["c0"], preds=["a0"], incarnation=incarnation)
        return {o.instance_id for o in core.start_duplication(2) if isinstance(o, CreateInstance)}

    assert first_copies(3) == first_copies(3) and len(first_copies(3)) == 2
    assert not first_copies(3) & first_copies(4) and not first_copies(0) & first_copies(4)
    restored = ScalingCore.restore(ScalingCore.initial("b0", "B", 1, P, succs=["c0"], preds=["a0"]).snapshot(),
                                   P, incarnation=9)
    assert {o.instance_id for o in restored.start_duplication(2) if isinstance(o, CreateInstance)} == first_copies(9)


def test_terminate_only_after_every_deletion_ack_and_after_drain():
    core = ScalingCore.initial("b1", "B", 1, P, succs=["c0", "c1"], preds=["a0", "a1"])
    out = core.start_deletion()
    assert [o.dest for o in out] == ["a0", "a1"]  # phase 1: predecessors only
    assert core.handle(DeletionAck("a0", 0, 1)) == []
    out = core.handle(DeletionAck("a1", 0, 1))
    assert isinstance(out[0], Drain) and [o.dest for o in out[1:]] == ["c0", "c1"]
    assert not any(isinstance(o, Terminate) for o in out)
    assert core.handle(DeletionAck("c1", 2, 2)) == []
    assert core.handle(DeletionAck("c0", 2, 2)) == [Terminate("b1")]
    assert core.terminated


def test_new_instance_parks_changes_until_start():
    create = CreateInstance("b9", "B", 1, "b0")
    core = ScalingCore.from_create(create, P)
    assert core.state is InstanceState.IDLE
    core.handle(Duplication("c0", 2, 1, ("c5",)))
    core.handle(Deletion("c1", 2, 4))
    core.handle(Duplication("a0", 0, 1, ("a5",)))
    with pytest.raises(RemoteProtocolError):
        core.handle(Start("bX", 1, ("c0",), ("a0",)))  # not from the creator
    out = core.handle(Start("b0", 1, ("c0", "c1"), ("a0",)))
    assert out == [Activate(("c0", "c5"), ("a0", "a5"))]
    assert core.state is InstanceState.ACTIVE


UNEXPECTED = [
    DuplicationAck("c0", 2, 1),  # no round in progress
    DeletionAck("c0", 2, 1),
    Start("b0", 1, (), ()),  # already active
    Duplication("z0", 5, 1, ("z1",)),  # not a neighbouring stage
    Deletion("b7", 1, 1),  # a sibling
    DataBatch("a0", 0, 1, 10),  # data is not for the core
]


@pytest.mark.parametrize("msg", UNEXPECTED, ids=lambda m: m.type)
def test_unexpected_messages_raise_and_leave_state_unchanged(msg):
    core = ScalingCore.initial("b0", "B", 1, P, succs=["c0"], preds=["a0"], keeper=True)
    before = core.snapshot()
    with pytest.raises(RemoteProtocolError):
        core.handle(msg)
    assert core.snapshot() == before


def test_wrong_or_late_acks_raise_and_leave_state_unchanged():
    core = ScalingCore.initial("b0", "B", 1, P, succs=["c0", "c1"], preds=["a0"])
    core.start_duplication(1)
    before = core.snapshot()
    for bad in (DuplicationAck("c0", 2, 0), DuplicationAck("c9", 2, 1), DeletionAck("c0", 2, 1)):
        with pytest.raises(RemoteProtocolError):
            core.handle(bad)
        assert core.snapshot() == before
    core.handle(DuplicationAck("c0", 2, 1))
    with pytest.raises(RemoteProtocolError):  # the same ack twice
        core.handle(DuplicationAck("c0", 2, 1))


def test_terminated_instance_rejects_everything():
    core = ScalingCore.initial("b1", "B", 1, P)
    assert core.start_deletion() == [Drain(), Terminate("b1")]
    with pytest.raises(RemoteProtocolError):
        core.handle(Deletion("a0", 0, 1))


def test_local_misuse_raises_local_protocol_error():
    keeper = ScalingCore.initial("b0", "B", 1, P, keeper=True, succs=["c0"])
    with pytest.raises(LocalProtocolError):
        keeper.start_deletion()
    keeper.start_duplication(1)
    with pytest.raises(LocalProtocolError):
        keeper.start_duplication(1)
    assert keeper.tick(load=10_000, draw=0.0) == []  # no decision while in a round


def test_snapshot_restore_round_trip_mid_round():
    core = ScalingCore.initial("b0", "B", 1, P, succs=["c0", "c1"], preds=["a0"])
    core.start_duplication(2)
    core.handle(DuplicationAck("c1", 2, 1))
    import json

    snap = json.loads(json.dumps(core.snapshot()))
    again = ScalingCore.restore(snap, P)
    assert again.snapshot() == core.snapshot()
    assert again.handle(DuplicationAck("c0", 2, 1)) == []
    starts = again.handle(DuplicationAck("a0", 0, 1))
    assert sorted(o.dest for o in starts) == sorted(snap["new_siblings"])
    assert all(isinstance(o.message, Start) and o.message.succs == ("c0", "c1") for o in starts)
    assert again.state is InstanceState.ACTIVE


def test_decide_and_start_round_are_separate_for_lock_guarded_scaling():
    core = ScalingCore.initial("b1", "B", 1, P, succs=["c0"], preds=["a0"])
    before = core.snapshot()
    decision = core.decide(load=2000.0, draw=0.5)
    assert decision.action is Action.DUPLICATE and core.snapshot() == before  # deciding is pure
    out = core.start_round(decision)
    assert sum(isinstance(o, CreateInstance) for o in out) == decision.count


# ---- policy ---------------------------------------------------------------------------------


def test_policy_expected_instance_count_matches_ideal():
    """Over many draws, n instances at load L end up at L / (r*C) on average (the paper's claim)."""
    rng = random.Random(7)
    for per_instance in (600.0, 1000.0, 1700.0, 100.0, 250.0):
        n = 20
        total = 0
        trials = 400
        for _ in range(trials):
            after = n
            for k in range(n):
                d = decide(P, per_instance, is_keeper=(k == 0), draw=rng.random())
                after += d.count if d.action is Action.DUPLICATE else (-1 if d.action is Action.TERMINATE else 0)
            total += after
        ideal = n * per_instance / (P.target_ratio * P.capacity)
        assert abs(total / trials - ideal) < 0.06 * ideal + 0.6, (per_instance, total / trials, ideal)


def test_policy_thresholds_and_keeper():
    assert decide(P, 350.0, False, 0.0).action is Action.NONE  # ratio 0.7: between down and up
    assert decide(P, 100.0, True, 0.0).action is Action.NONE  # keeper never terminates
    assert decide(P, 100.0, False, 0.0).action is Action.TERMINATE
    assert decide(P, 100.0, False, 0.99).action is Action.NONE
    d = decide(P, 1050.0, False, 0.99)  # p = 1050/350 - 1 = 2 exactly
    assert d == Decision(Action.DUPLICATE, 2, pytest.approx(2.0))


def test_r_secure_never_leaves_capacity_exceeded():
    """With r_secure, duplicating instances always add enough copies that load per instance <= C."""
    secure = ScalingParams(use_r_secure=True)
    for load in [410.0, 520.0, 700.0, 999.0, 1001.0, 1600.0, 2400.0, 5000.0]:
        for draw in (0.0, 0.5, 0.999):
            d = decide(secure, load, False, draw)
            copies = d.count if d.action is Action.DUPLICATE else 0
            assert load / (copies + 1) <= secure.capacity + 1e-9, (load, draw, d)
        assert r_secure(500.0, load) <= 1.0
    plain = decide(P, 550.0, False, 0.99)  # p = 0.571: without the guarantee, no copy this time
    assert plain.action is Action.NONE


def test_adopt_announces_an_existing_copy_without_creating_it_and_starts_it_after_the_acks():
    """Re-homing: a creator that lost the round its copy belongs to announces that copy again
    (no CreateInstance); a neighbour that already routes to it acks without a route change, one
    that did not know it adds it; Start follows the last ack, with the creator's tables."""
    core = ScalingCore.initial("b0", "b", 1, P, succs=("c0",), preds=("a0",), keeper=True)
    outs = core.adopt("b-old")
    assert not [o for o in outs if isinstance(o, CreateInstance)]
    assert [(o.dest, o.message) for o in outs] == [
        (d, Duplication("b0", 1, 1, ("b-old",))) for d in ("c0", "a0")]
    assert core.state is InstanceState.DUPLICATING and core.pending == {"a0", "c0"}
    knows = ScalingCore.initial("a0", "a", 0, P, succs=("b0", "b-old"))
    (ack_a,) = knows.handle(outs[1].message)  # already routes to it: just the ack
    new = ScalingCore.initial("c0", "c", 2, P, preds=("b0",))
    changed, ack_c = new.handle(outs[0].message)
    assert isinstance(changed, RoutesChanged) and changed.preds == ("b-old", "b0")
    assert core.handle(ack_a.message) == []
    (start,) = core.handle(ack_c.message)
    assert start == Send("b-old", Start("b0", 1, ("c0",), ("a0",))) and core.state is InstanceState.ACTIVE
    copy = ScalingCore.from_create(CreateInstance("b-old", "b", 1, "b0"), P)
    assert copy.handle(start.message) == [Activate(("c0",), ("a0",))]
    with pytest.raises(LocalProtocolError):
        core.adopt("b0")
    core.start_duplication(1)
    with pytest.raises(LocalProtocolError):  # one round at a time, as any round
        core.adopt("b-other")


def test_a_round_message_sent_again_also_reaches_the_copies_a_silent_neighbour_started_without_it():
    """Concurrent duplications of neighbours with the first round message lost (CHANGELOG.md,
    "A Duplication resent after a loss"): k0's Duplication to o0 is lost; o0 duplicates, k0 adds
    o0's copy and acks, o0 starts the copy with tables that lack k0's copy. k0's resend to o0
    (`widen_round`) must reach the copy too, and k0's copy starts only once the copy knows it."""
    k0 = ScalingCore.initial("k0", "k", 2, P, succs=("s0",), preds=("o0",), keeper=True)
    o0 = ScalingCore.initial("o0", "o", 1, P, succs=("k0",), preds=("src",), keeper=True)
    kout = k0.start_duplication(1)
    c = next(o.instance_id for o in kout if isinstance(o, CreateInstance))
    k_dup = next(o.message for o in kout if isinstance(o, Send))  # the one to o0 is lost
    oout = o0.start_duplication(1)
    o_copy = next(o.instance_id for o in oout if isinstance(o, CreateInstance))
    o_dup = next(o.message for o in oout if isinstance(o, Send) and o.dest == "k0")
    assert k0.widen_round("o0") == ()  # nothing announced yet: the resend goes to o0 alone
    changed, ack = k0.handle(o_dup)
    assert changed.preds == tuple(sorted(("o0", o_copy))) and ack.dest == "o0"
    assert k0.handle(DuplicationAck("s0", 3, 1)) == []
    assert o0.handle(DuplicationAck("src", 0, 1)) == []
    (start,) = o0.handle(ack.message)
    copy = ScalingCore.from_create(CreateInstance(o_copy, "o", 1, "o0"), P)
    assert copy.handle(start.message) == [Activate(("k0",), ("src",))]  # k0's copy unknown to it
    snap = ScalingCore.restore(json.loads(json.dumps(k0.snapshot())), P)
    assert snap.unsure == {"o0": {o_copy}} and snap.key() == k0.key()
    assert k0.widen_round(o_copy) == () and k0.widen_round("s0") == ()  # not pending: nothing
    assert k0.widen_round("o0") == (o_copy,) and k0.pending == {"o0", o_copy}
    assert k0.widen_round("o0") == ()  # once
    assert o0.handle(k_dup)[-1] == Send("k0", DuplicationAck("o0", 1, 1))
    changed, ack_copy = copy.handle(k_dup)
    assert changed.succs == tuple(sorted(("k0", c)))
    assert k0.handle(DuplicationAck("o0", 1, 1)) == []
    (kstart,) = k0.handle(ack_copy.message)
    assert kstart.dest == c and set(kstart.message.preds) == {"o0", o_copy}


def test_a_neighbour_acking_in_order_or_a_copy_leaving_leaves_nothing_unsure():
    """Without a loss the neighbour acks our round (it knew it before its own ended): nothing to
    widen; a copy that leaves needs no news of our round (and may be gone before a resend)."""
    k0 = ScalingCore.initial("k0", "k", 2, P, succs=("s0",), preds=("o0",), keeper=True)
    k0.start_duplication(1)
    k0.handle(Duplication("o0", 1, 1, ("o-1", "o-2")))
    assert k0.unsure == {"o0": {"o-1", "o-2"}}
    k0.handle(Deletion("o-2", 1, 1))
    assert k0.unsure == {"o0": {"o-1"}}
    k0.handle(DuplicationAck("o0", 1, 1))
    assert k0.unsure == {} and k0.widen_round("o0") == ()
    k0.handle(Duplication("s0", 3, 1, ("s-1",)))  # s0 pending: unsure until it acks or the round ends
    assert k0.unsure == {"s0": {"s-1"}}
    k0.handle(DuplicationAck("s0", 3, 1))
    assert k0.state is InstanceState.ACTIVE and k0.unsure == {}


def test_a_round_stops_waiting_for_a_pending_neighbour_that_left_only_when_it_would_resend():
    """A neighbour whose Deletion we applied while it had not acked our round (our Duplication to
    it lost, our ack of its Deletion not) may be gone: at the resend we stop waiting for it
    (`release`), so our copy starts; a neighbour that did not leave gets the message again."""
    s0 = ScalingCore.initial("s0", "s", 2, P, preds=("o0", "o-1"), keeper=True)
    outs = s0.start_duplication(1)
    copy = next(o.instance_id for o in outs if isinstance(o, CreateInstance))
    assert s0.release("o-1") is None and s0.release("o0") is None  # neither left: resend
    changed, ack = s0.handle(Deletion("o-1", 1, 2))  # o-1's second phase: drained, leaving
    assert changed.preds == ("o0",) and ack.dest == "o-1" and s0.pending == {"o0", "o-1"}
    assert s0.release("o0") is None
    assert s0.release("o-1") == [] and s0.pending == {"o0"}
    assert ScalingCore.restore(json.loads(json.dumps(s0.snapshot())), P).key() == s0.key()
    (start,) = s0.handle(DuplicationAck("o0", 1, 1))
    assert start == Send(copy, Start("s0", 2, (), ("o0",))) and s0.state is InstanceState.ACTIVE
    assert s0.release("o-1") is None  # no round
    # the last one pending: releasing it ends the round (a deletion round here: drain, depart)
    d0 = ScalingCore.initial("d0", "d", 2, P, preds=("o0",), succs=("t0",))
    d0.start_deletion()
    d0.handle(Deletion("o0", 1, 3))
    assert d0.release("o0") == [Drain(), Send("t0", Deletion("d0", 2, 2))] and d0.state is InstanceState.DEPARTING


def test_a_copy_starts_knowing_a_neighbour_that_left_after_it_acked_our_duplication():
    """A neighbour that acked our Duplication knows our copy and will send it its Deletion: when
    we apply that neighbour's Deletion before our round ends, the copy's Start still names it (so
    the copy, leaving first, tells it; CHANGELOG.md, "A departing copy waited for a copy that
    ended"). One
    whose Deletion came before its ack (pending) never learnt of the copy: left out, as before."""
    s0 = ScalingCore.initial("s0", "s", 2, P, preds=("o0", "o1", "o2"), succs=("t0",), keeper=True)
    outs = s0.start_duplication(1)
    copy = next(o.instance_id for o in outs if isinstance(o, CreateInstance))
    s0.handle(DuplicationAck("o1", 1, 1))
    s0.handle(DuplicationAck("t0", 3, 1))
    changed, ack = s0.handle(Deletion("o1", 1, 2))  # acked, then left: knows the copy
    assert changed.preds == ("o0", "o2") and ack.dest == "o1" and s0.leavers == {"o1": "pred"}
    s0.handle(Deletion("o2", 1, 2))  # pending: left before it could know the copy
    s0.handle(Duplication("o0", 1, 1, ("o3",)))  # joined during our round, never heard of it
    s0.handle(Deletion("o3", 1, 2))  # (if kept, the copy would wait for it for ever)
    assert s0.leavers == {"o1": "pred"}
    assert ScalingCore.restore(json.loads(json.dumps(s0.snapshot())), P).key() == s0.key()
    assert s0.clone().key() == s0.key()
    assert s0.release("o2") == [] and "o2" not in s0.leavers  # at the resend: not waited for
    (start,) = s0.handle(DuplicationAck("o0", 1, 1))
    assert start == Send(copy, Start("s0", 2, ("t0",), ("o0", "o1"))) and s0.routes() == (("t0",), ("o0",))
    assert s0.leavers == {}
