"""Planned policy (agent/policy/planned.py): the priced instance plan is the cheapest, the policy
follows the learned day and not the noise, and it is registered for the simulator and the daemon
(docs/measurement.md, "Session 13")."""

from __future__ import annotations

import itertools
from typing import List, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.policy.base import ActionKind, Measurements, make_policy
from agent.policy.planned import PLANNED_POINT, PlannedPolicy, plan_instances

CAP = 100.0  # records/s per instance (linear platform: MST(n) = 100 n)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3), st.lists(st.integers(0, 4), min_size=1, max_size=5), st.sampled_from([0.0, 0.5, 1.5, 4.0]))
def test_plan_is_the_cheapest_covering_series_with_priced_changes(start, need, price):
    plan = plan_instances(start, need, price, top=3)

    def cost(series: Sequence[int]) -> float:
        return sum(series) + price * sum(1 for a, b in zip((start,) + tuple(series), series) if a != b)

    best = min(cost(s) for s in itertools.product((1, 2, 3), repeat=len(need))
               if all(x >= min(max(1, d), 3) for x, d in zip(s, need)))
    assert all(x >= min(max(1, d), 3) for x, d in zip(plan, need))
    assert cost(plan) == pytest.approx(best)


def _run(policy: PlannedPolicy, totals: Sequence[float], n0: int = 2) -> List[tuple]:
    """One operator on a linear platform seen through one instance that takes part in every change
    (no rank, draw 0, not the keeper); (kind, target) per 60 s period."""
    n, out = n0, []
    for k, total in enumerate(totals):
        done = min(total, CAP * n)
        bp = 0.0 if total <= CAP * n else 0.6
        m = Measurements(now=60.0 * k + 59.0, load=done / n, throughput=done / n, capacity=CAP,
                         upstream_backpressure=bp, n_instances=n, is_keeper=False, draw=0.0)
        a = policy.decide(m)
        out.append((a.kind, a.target))
        if a.target is not None and a.kind is not ActionKind.NONE:
            n = a.target
    return out


PROFILE = tuple(150.0 + 250.0 * (1 if 8 <= j < 16 else 0) for j in range(24))  # 2 instances, then 5 (x 1.2)


def test_steps_up_one_period_before_the_busy_slots_and_back_after_them():
    acts = _run(PlannedPolicy(profile=PROFILE, **PLANNED_POINT), [PROFILE[k] for k in range(24)])
    changes = [(k, a[1]) for k, a in enumerate(acts) if a[0] is not ActionKind.NONE]
    # decided at the end of slot 7 for slot 8 (needs ceil(400 x 1.2 / 100) = 5), back at the end of 15
    assert changes == [(7, 5), (15, 2)]


def test_rides_out_a_burst_the_profile_does_not_forecast():
    """Open loop at its operating point: an hour-long burst at +80 % costs no reconfiguration
    (the margin and back pressure absorb it); with `react` it costs two."""
    totals = [PROFILE[k] * (1.8 if 2 <= k < 5 else 1.0) for k in range(7)]  # slot 7 would step up
    open_loop = _run(PlannedPolicy(profile=PROFILE, **PLANNED_POINT), totals)
    assert all(a[0] is ActionKind.NONE for a in open_loop)
    reacting = _run(PlannedPolicy(profile=PROFILE, **dict(PLANNED_POINT, react=True)), totals)
    assert any(a[0] is ActionKind.SCALE_OUT for a in reacting)


def test_registered_for_the_simulator_and_the_daemon():
    from agent.config import RUNTIME_POLICIES, ScalingSection
    from agent.policy.live import LIVE_POLICIES
    from agent.sim.policies import POLICIES

    assert isinstance(make_policy("planned"), PlannedPolicy)
    assert "planned" in RUNTIME_POLICIES and "planned" in LIVE_POLICIES and "planned" in POLICIES
    live = make_policy("planned", ScalingSection(policy="planned", period=60.0, profile=PROFILE, profile_slot=60.0))
    assert isinstance(live, PlannedPolicy) and live.clock == "wall" and live.change_cost == PLANNED_POINT["change_cost"]


def test_halves_the_thresholds_reconfigurations_on_two_clean_days_with_no_more_under_provisioning():
    """Two noiseless days of the weekday taxi shape (about 10 s): the first teaches the profile."""
    from dataclasses import replace

    from agent.policy.seasonal import learn_profile
    from agent.sim.policies import SimConfig, simulate
    from agent.sim.policies_trace import DAY_SECONDS, _diurnal, fog_testbed_matrix

    trace = [2000.0 * _diurnal(s * 10 / 3600.0) for s in range(2 * DAY_SECONDS)]
    cfg = replace(SimConfig(), profile=tuple(learn_profile(trace[:DAY_SECONDS], 60, DAY_SECONDS)))
    m = fog_testbed_matrix()
    thr, pl = (simulate(p, trace[DAY_SECONDS:], m, 0, cfg).metrics for p in ("threshold", "planned"))
    assert pl.reconfigurations <= 0.5 * thr.reconfigurations
    assert pl.accuracy_u <= thr.accuracy_u and pl.timeshare_u <= thr.timeshare_u
