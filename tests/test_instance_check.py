"""The instance checker (agent.sim.instance_check): whole `Instance`s over a broker model, and
proof that it finds the three historic losses when they are switched back on."""

from __future__ import annotations

import dataclasses

import pytest

from agent.sim.instance_check import Config, describe, explore, random_runs

ROUNDS_1212 = (("op-0", "duplicate"), ("copy", "terminate"), ("op-0", "duplicate"))
SINK_12 = (("sink-0", "duplicate"),)


def test_random_schedules_with_every_fault_kind_keep_every_record_and_end_every_round() -> None:
    """Crash + restart from the last persisted state, re-homing of op-0, a refused publish and
    a duplicated delivery, op going 1 -> 2 -> 1 -> 2 (`fog-agent simulate instance` runs 10,000)."""
    cfg = Config(records=4, crashes=1, rehomes=1, refusals=1, dups=1, plans=ROUNDS_1212)
    rep = random_runs(cfg, schedules=120, seed=1000)
    assert rep.ok, describe(rep)
    assert rep.schedules == 120 and rep.steps > 120 * 20


def test_random_schedules_with_slow_nodes_keep_every_record() -> None:
    """The predecessor and the sink answer rarely: resends on silence and replays cross."""
    cfg = Config(records=4, crashes=1, slow=("source-0", "sink-0"))
    rep = random_runs(cfg, schedules=60, seed=2000)
    assert rep.ok, describe(rep)


def test_every_schedule_up_to_depth_three_is_settled_and_checked() -> None:
    """Exhaustive, bounded: every interleaving of the first 3 moves (deliveries, time, the
    rounds, a crash, a refused publish), each then run to its end. Depth 4: 826 states
    (docs/reliability.md, "Checking whole instances")."""
    rep = explore(Config(records=2, crashes=1, refusals=1), depth=3)
    assert rep.ok, describe(rep)
    assert rep.states >= 40 and rep.terminal_states >= 30


FOUND = [
    # a refused ack held back every later ack of a sink (retried only with data to flush)
    ("retry_only_with_data", Config(records=4, refusals=1, refuse_targets=("sink-0",)), 0,
     {"records_not_exactly_once", "round_not_ended", "record_to_terminated"}),
    # a repeated deletion ack at the head of a draining copy's queue held the data behind it.
    # The only data that followed the ack in the model was a silent-link replay, renumbered;
    # since a silent link resends under the batches' own numbers (docs/reliability.md "Found by
    # the testbed runs") the copy drops those as duplicates and the seeded fault no longer shows
    # (not found in 1,500-4,000 schedules, with or without a crash): strict, so that a model in
    # which it shows again says so.
    pytest.param("drain_holds_protocol", Config(records=4, slow=("source-0", "sink-0")), 0,
                 {"round_not_ended", "records_not_exactly_once"},
                 id="drain_holds_protocol", marks=pytest.mark.xfail(strict=True, reason="its only trigger in the model, a renumbered "
                                         "silent-link replay behind the repeated ack, is gone")),
    # a re-homed instance numbered its rounds from 1 again: neighbours took them as repeats
    ("rehome_rounds_from_one", Config(records=4, rehomes=1, plans=ROUNDS_1212), 0,
     {"views_disagree", "records_not_exactly_once", "record_to_terminated", "round_not_ended"}),
    # records op-0 processed again after its crash were routed afresh: the sink had scaled out
    # meanwhile, and the copy of a record sink-0 had recorded reached sink-1, which kept it
    # (docs/design.md invariant 8; each sink instance keeps its own ids)
    ("route_afresh", Config(records=4, crashes=1, crash_targets=("op-0",), plans=SINK_12), 0,
     {"records_not_exactly_once"}),
]


@pytest.mark.parametrize("fault,cfg,seed,kinds", FOUND, ids=[getattr(f, "id", None) or f[0] for f in FOUND])
def test_the_checker_finds_each_historic_loss_when_it_is_switched_back_on(  # type: ignore[no-untyped-def]
        fault, cfg, seed, kinds) -> None:
    faulty = random_runs(dataclasses.replace(cfg, faults=frozenset({fault})), schedules=400, seed=seed)
    assert not faulty.ok, f"{fault} not found in 400 schedules"
    assert faulty.violations[0].kind in kinds, describe(faulty)
    assert faulty.seconds < 60
    # the same schedules without the fault pass: the fault, not the model, is what fails
    clean = random_runs(cfg, schedules=faulty.schedules, seed=seed)
    assert clean.ok, describe(clean)
