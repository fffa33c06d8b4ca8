"""Lock-guarded scaling (coordination = "fgme"): neighbours never scale together, nothing lost.

The checker is the scaling checker (`foglab.sim.checker`: no stale route, no message to a
terminated instance, no operator lost, consistent views at quiescence) plus the guarded checks
(`foglab.sim.guarded_check`: no instances of stages s and s+1 in a round at once; at quiescence
no intent left unserved and no lock held).
"""

from __future__ import annotations

import random

import pytest

from agent.policy.decentralized import Action
from agent.protocol.gme_base import GmeState
from agent.protocol.guarded import GuardedCore, LockMessage, core_class
from agent.protocol.scaling import ScalingCore
from foglab.sim.checker import Plan, explore, random_runs
from foglab.sim.guarded_check import build_guarded


def _random_system(rng: random.Random, core_cls=GuardedCore):
    sizes = [rng.randint(1, 3) for _ in range(rng.randint(2, 4))]
    plans = []
    for s, n in enumerate(sizes):
        for k in range(n):
            if rng.random() < 0.5:
                act = Action.DUPLICATE if k == 0 or rng.random() < 0.5 else Action.TERMINATE
                plans.append(Plan(f"s{s}i{k}", act, rng.choice((1, 1, 2))))
    return build_guarded(sizes, plans, core_cls=core_cls)


def test_random_schedules_neighbours_never_scale_together_and_nothing_is_lost():
    # rounds planned on 50% of the instances + 4 more at random times on random active
    # instances, including instances created during the run (joins) and terminating ones (leaves)
    r = random_runs(_random_system, schedules=600, seed=1, extra_rounds=4)
    assert r.ok, r.violations[0]
    assert r.schedules == 600
    assert r.rounds_completed > 1800  # rounds did run (not everything blocked or dropped)


def test_the_same_checker_finds_neighbours_scaling_together_without_the_lock():
    r = random_runs(lambda rng: _random_system(rng, core_cls=ScalingCore), schedules=300, seed=1,
                    extra_rounds=4)
    assert not r.ok
    assert r.violations[0].kind == "neighbours_in_round"


@pytest.mark.parametrize("plans", [
    # a duplication next to a deletion (join on one side, leave on the other)
    (Plan("s0i0", Action.DUPLICATE), Plan("s1i1", Action.TERMINATE)),
    # both operators of a boundary duplicating: the second one must see the first one's new instance
    (Plan("s0i0", Action.DUPLICATE), Plan("s1i0", Action.DUPLICATE)),
    # two deletions on both sides of the boundary
    (Plan("s0i1", Action.TERMINATE), Plan("s1i1", Action.TERMINATE)),
])
def test_exhaustive_two_operators_two_instances(plans):
    r = explore(build_guarded([2, 2], plans), max_states=400_000)
    assert r.ok, r.violations[0]
    assert r.terminal_states >= 1 and r.states > 100


def test_exhaustive_three_operators_middle_one_waits_for_both_neighbours():
    plans = (Plan("s0i0", Action.DUPLICATE), Plan("s1i0", Action.DUPLICATE), Plan("s2i0", Action.DUPLICATE))
    r = explore(build_guarded([1, 1, 1], plans), max_states=400_000)
    assert r.ok, r.violations[0]


def test_new_instance_joins_the_neighbours_lock_and_a_leaving_one_is_awaited():
    """Unit view of the membership rules on one boundary (lock s0|s1)."""
    sysm = build_guarded([1, 1], [Plan("s0i0", Action.DUPLICATE)])
    a, b = sysm.cores["s0i0"], sysm.cores["s1i0"]
    # b (operator 1, the last one) needs only lock 0: it asks a and waits for a's Ack
    outs = b.start_round(Plan("s1i0", Action.DUPLICATE).decision())
    assert [type(o.message) for o in outs] == [LockMessage]
    assert b.locks[0].state is GmeState.REQUESTING and b.intent is not None
    # b learns of a new predecessor c while requesting: it must ask c too (join)
    join = b.locks[0].sync({"s0i0", "c"})
    assert [o.to for o in join] == ["c"]
    assert b.locks[0].competitors == frozenset({"s0i0", "c"})
    # c is removed from b's table (Deletion): b keeps waiting for c's exit message (leave)
    b.locks[0].sync({"s0i0"})
    assert "c" in b.locks[0].competitors and "c" in b.locks[0].leaving


def test_coordination_setting_selects_the_core():
    assert core_class("ack") is ScalingCore
    assert core_class("fgme") is GuardedCore
    assert core_class("fgme", True).damped and not core_class("fgme", False).damped
    assert GuardedCore.damped is True  # DEVIATION 4 unless [pipeline] fgme_damping = false
    with pytest.raises(ValueError):
        core_class("token")


def test_guarded_scaling_simulation_loses_nothing():
    from foglab.sim.scaling_sim import SimConfig, simulate

    r = simulate(SimConfig(seed=3, steps=120), core_cls=GuardedCore)
    assert r.lost_records == 0 and r.protocol_errors == 0 and r.messages_to_terminated == 0
    assert r.inconsistent_views == 0 and r.rounds_open_at_end == 0


def test_lock_messages_round_trip_and_bad_ones_are_remote_errors():
    """The worker decodes inbox bodies with `message_from_dict`: lock messages round-trip through
    JSON, and a malformed one is a RemoteProtocolError (counted by the worker), never a
    TypeError inside the 2-FGME node."""
    import json

    from agent.protocol.errors import RemoteProtocolError
    from agent.protocol.guarded import message_from_dict
    from agent.protocol.messages import Deletion

    sysm = build_guarded([1, 1, 1], [])
    b = sysm.cores["s1i0"]
    outs = b.start_round(Plan("s1i0", Action.DUPLICATE).decision())
    (req,) = [o.message for o in outs]
    assert message_from_dict(json.loads(json.dumps(req.to_dict()))) == req
    d = Deletion("x", 1, 2)
    assert message_from_dict(d.to_dict()) == d
    good = req.to_dict()
    for bad in (
        dict(good, boundary="0"),
        dict(good, inner=dict(good["inner"], clock="1")),
        dict(good, inner=dict(good["inner"], sender="other")),
        dict(good, inner=dict(good["inner"], kind="token")),
        dict(good, inner=dict(good["inner"], extra=1)),
        dict(good, extra=1),
        {"type": "lock"},
    ):
        with pytest.raises(RemoteProtocolError):
            message_from_dict(bad)


def test_guarded_snapshot_restores_a_waiting_lock_exactly():
    """A worker restart restores the core from its persisted snapshot (JSON): a request in
    flight, the held locks and the pending intent come back identical, so the restarted
    instance still answers and counts the Acks of its competitors."""
    import json

    from agent.policy.decentralized import ScalingParams

    sysm = build_guarded([1, 1, 1], [])
    b = sysm.cores["s1i0"]
    b.start_round(Plan("s1i0", Action.DUPLICATE).decision())
    data = json.loads(json.dumps(b.snapshot()))
    r = GuardedCore.restore(data, ScalingParams())
    assert r.key() == b.key() and r.lock_state is GmeState.REQUESTING
    # an "ack" snapshot (coordination changed) restores with idle locks synced to the tables
    plain = dict(data)
    del plain["fgme"]
    r2 = GuardedCore.restore(plain, ScalingParams())
    assert r2.lock_state is GmeState.IDLE and r2.locks[1].competitors == frozenset(b.succs)


def test_cancelled_guarded_round_releases_its_locks():
    """createNode() failed: the worker cancels the round; the locks must be released (else the
    neighbours wait forever), with the usual exit messages."""
    sysm = build_guarded([1, 1], [])
    a, b = sysm.cores["s0i0"], sysm.cores["s1i0"]
    outs = b.start_round(Plan("s1i0", Action.DUPLICATE).decision())
    (ack,) = a.handle(outs[0].message)
    outs = b.handle(ack.message)
    assert b.in_round and b.lock_state is GmeState.IN_CS
    released = b.cancel_duplication(created=())
    assert b.lock_state is GmeState.IDLE and not b.in_round
    assert [type(o.message.inner).__name__ for o in released] == ["End"]


def test_guarded_adoption_runs_inside_the_locks_and_survives_a_restart():
    """coordination = "fgme": adopting an orphaned copy is a round like any other, so it waits
    for the neighbours' lock; the intent (and which copy) survives a worker restart; once in the
    CS the round announces the copy (no CreateInstance) and releases the lock after Start."""
    import json

    from agent.policy.decentralized import ScalingParams
    from agent.protocol.scaling import CreateInstance, Send

    sysm = build_guarded([1, 1], [])
    a, b = sysm.cores["s0i0"], sysm.cores["s1i0"]
    outs = b.adopt("s1-orphan")
    assert b.lock_state is GmeState.REQUESTING and not b.in_round and b.adopting == "s1-orphan"
    b = GuardedCore.restore(json.loads(json.dumps(b.snapshot())), ScalingParams())
    assert b.adopting == "s1-orphan" and b.lock_state is GmeState.REQUESTING
    (ack,) = a.handle(outs[0].message)
    outs = b.handle(ack.message)
    assert b.in_round and b.lock_state is GmeState.IN_CS and b.adopting is None
    assert not [o for o in outs if isinstance(o, CreateInstance)]
    (dup,) = [o for o in outs if isinstance(o, Send) and o.message.type == "duplication"]
    assert dup.dest == "s0i0" and dup.message.new_instances == ("s1-orphan",)
    dup_outs = a.handle(dup.message)
    (dup_ack,) = [o for o in dup_outs if isinstance(o, Send) and o.message.type == "duplication_ack"]
    done = b.handle(dup_ack.message)
    assert [o.dest for o in done if isinstance(o, Send) and o.message.type == "start"] == ["s1-orphan"]
    assert b.lock_state is GmeState.IDLE and not b.in_round


def test_published_lock_nodes_random_schedules_neighbours_never_scale_together():
    """[pipeline] fgme_damping = false: the same random check as above (whose default lock nodes
    are damped, DEVIATION 4) with the published line 79 in every lock node: no two neighbours in
    a round, every intent served, nothing lost."""
    from agent.protocol.guarded import PublishedGuardedCore

    r = random_runs(lambda rng: _random_system(rng, core_cls=PublishedGuardedCore), schedules=400, seed=2,
                    extra_rounds=4)
    assert r.ok, r.violations[0]
    assert r.rounds_completed > 1000


def test_lock_nodes_of_both_variants_in_one_pipeline_never_let_neighbours_scale_together():
    """A fleet that upgrades to the damped default while running: a restored lock node keeps the
    variant it was created with (published), instances created since are damped, so one lock can
    have nodes of both variants. Each node's variant only decides when its own authorization
    ends, so pairwise exclusion and the liveness argument hold node by node (docs/gme.md); this
    checks it: instances alternate between the variants by id."""
    import zlib

    class Mixed(GuardedCore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            damped = zlib.crc32(self.instance_id.encode()) >> 1 & 1 == 0  # mixes inside an operator too
            for node in self.locks.values():
                node.damped = damped

    r = random_runs(lambda rng: _random_system(rng, core_cls=Mixed), schedules=400, seed=4, extra_rounds=4)
    assert r.ok, r.violations[0]
    assert r.rounds_completed > 1000


def test_damped_snapshot_keeps_the_variant_and_whom_it_authorizes():
    """A restarted damped lock node must still know whom its authorization was granted for
    (else an End from that node would not end it, or any End would)."""
    import json

    from agent.policy.decentralized import ScalingParams
    from agent.protocol.gme_fgme import Req
    from agent.protocol.guarded import DampedGuardedCore, PublishedGuardedCore

    sysm = build_guarded([1, 2], [], core_cls=DampedGuardedCore)
    b = sysm.cores["s1i0"]
    b.start_round(Plan("s1i0", Action.DUPLICATE).decision())  # requests lock 0 (clock 1)
    node = b.locks[0]
    # a higher-priority Req from the other group while b requests: b acks and authorizes it
    outs = node.receive(Req("s0i0", 0, 1))
    assert node.competitors_authorized and node.authorized_for == frozenset({"s0i0"}), outs
    r = PublishedGuardedCore.restore(json.loads(json.dumps(b.snapshot())), ScalingParams())
    assert r.locks[0].damped and r.locks[0].authorized_for == frozenset({"s0i0"}) and r.key() == b.key()


def test_a_lock_dump_written_before_the_damped_variant_existed_restores_published():
    """The damped flag was persisted from the commit that introduced the damping, so a dump
    without it is a published node's (its authorized_for was never written): it stays published
    now that the damped variant is the default, and a dump with the flag keeps its variant."""
    import json

    from agent.policy.decentralized import ScalingParams

    sysm = build_guarded([1, 2], [])
    b = sysm.cores["s1i0"]
    b.start_round(Plan("s1i0", Action.DUPLICATE).decision())
    assert b.locks[0].damped  # the default
    snap = json.loads(json.dumps(b.snapshot()))
    assert GuardedCore.restore(snap, ScalingParams()).locks[0].damped
    for d in snap["fgme"]["locks"].values():
        del d["damped"], d["authorized_for"]
    assert not any(n.damped for n in GuardedCore.restore(snap, ScalingParams()).locks.values())


def test_compare_damping_counts_rounds_and_lock_messages_for_both_variants():
    from foglab.sim.guarded_check import compare_damping

    rows = compare_damping(10, seed=3, sim_seeds=(3,), sim_steps=60)
    assert [r["damped"] for r in rows] == [False, True, False, True]
    for r in rows:
        assert r["violations"] == 0 and r["rounds"] > 10 and r["lock_messages"] >= 2 * r["rounds"], r
