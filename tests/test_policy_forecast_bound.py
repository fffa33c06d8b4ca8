"""The perfect-forecast bound (lab/foglab/sim/policies_forecast_bound.py): its covering plans are the
least-cost ones, its forecast is the generator's smooth part, and knowing less never costs less
than the clairvoyant bound (docs/results.md, M9)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foglab.sim.policies_oracle import cover_plans


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=6), st.integers(1, 3), st.integers(0, 3))
def test_cover_plans_are_the_cheapest_covering_series_of_each_budget(demand, initial, budget):
    plans = cover_plans(demand, budget, initial, max_level=3)
    for k, plan in enumerate(plans):
        best = None
        for supply in itertools.product((1, 2, 3), repeat=len(demand)):
            if supply[0] != initial or any(s < d for s, d in zip(supply[1:], demand[1:])):
                continue
            if sum(1 for a, b in zip(supply, supply[1:]) if a != b) <= k:
                best = sum(supply) if best is None else min(best, sum(supply))
        if best is None:
            assert plan is None
            continue
        assert plan is not None and sum(plan) == best and plan[0] == initial
        assert all(s >= d for s, d in zip(plan[1:], demand[1:]))
        assert sum(1 for a, b in zip(plan, plan[1:]) if a != b) <= k


def test_cover_plans_hand_computed():
    assert cover_plans([1, 3, 1, 1], 1, initial=1, max_level=3)[1] == [1, 3, 3, 3]
    assert cover_plans([1, 3, 1, 1], 2, initial=1, max_level=3)[2] == [1, 3, 1, 1]
    assert cover_plans([1, 3, 1], 0, initial=1, max_level=3)[0] is None  # must rise once
    assert cover_plans([1, 5, 1], 1, initial=1, max_level=3)[1] == [1, 3, 3]  # demand clipped to max_level


def test_smooth_trace_is_the_trace_without_noise_and_bursts_with_the_same_day_levels():
    """Scaling a day's level scales the trace and its smooth part alike, second by second: the
    smooth part draws the same day levels, and the noise and bursts do not depend on them."""
    from foglab.sim.policies_trace import DAY_SECONDS, _diurnal, smooth_trace, taxi_trace

    flat, levelled = smooth_trace(3, days=2, day_sigma=0.0), smooth_trace(3, days=2, day_sigma=0.3)
    assert flat[:100] == pytest.approx([2400.0 * _diurnal(s * 10 / 3600.0) for s in range(100)])
    raw, raw_levelled = taxi_trace(3, days=2, day_sigma=0.0), taxi_trace(3, days=2, day_sigma=0.3)
    day_ratio = [levelled[d * DAY_SECONDS] / flat[d * DAY_SECONDS] for d in range(2)]
    assert any(abs(r - 1.0) > 0.05 for r in day_ratio)  # sigma 0.3: the levels matter
    for s in range(0, 2 * DAY_SECONDS, 97):
        r = day_ratio[s // DAY_SECONDS]
        assert levelled[s] / flat[s] == pytest.approx(r)
        if raw[s] > 0:
            assert raw_levelled[s] / raw[s] == pytest.approx(r)


@pytest.fixture(scope="module")
def small_runs():
    """Threshold on one seed's half test day after one training day (about a second)."""
    from foglab.sim.policies import compare

    return compare([0], ["threshold"], days=0.5, train_days=1, day_sigma=0.05)["threshold"]


def test_perfect_forecast_bound_is_never_below_the_clairvoyant_bound(small_runs):
    from foglab.sim.policies_forecast_bound import forecast_bound_curve
    from foglab.sim.policies_pareto import bound_curve

    budgets = list(range(0, 13))
    clair = dict(bound_curve(small_runs, budgets))
    fore = dict(forecast_bound_curve(small_runs, budgets, days=0.5, train_days=1, day_sigma=0.05))
    finite = [k for k in budgets if fore[k] < float("inf")]
    assert len(finite) >= 6  # not vacuous: most budgets have a plan meeting threshold's under-provisioning
    assert all(fore[k] >= clair[k] for k in budgets)
    assert any(fore[k] > clair[k] for k in finite)  # the noise it does not know costs something
    assert all(fore[a] >= fore[b] for a, b in zip(budgets, budgets[1:]))  # a larger budget never costs more

