"""The clairvoyant schedule bound: hand-computed cases and a brute-force cross-check with metrics_spec."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.metrics_spec import accuracy, cost_instance_minutes, reconfigurations, timeshare
from foglab.sim.policies_oracle import min_cost_schedule


def test_hand_computed_cases():
    assert min_cost_schedule([1, 3, 1], max_changes=0) == 9  # constant 3
    assert min_cost_schedule([1, 3, 1], max_changes=1) == 7  # 3 3 1 (or 1 3 3)
    assert min_cost_schedule([1, 3, 1], max_changes=2) == 5  # follow the demand
    assert min_cost_schedule([1, 3, 1], max_changes=0, max_under=2) == 3  # constant 1, 2 missing
    assert min_cost_schedule([1, 1, 1], max_changes=0, initial=2) == 6
    assert min_cost_schedule([1, 1, 1], max_changes=1, initial=2) == 4
    assert min_cost_schedule([5], max_changes=0, max_level=4) == float("inf")
    with pytest.raises(ValueError):
        min_cost_schedule([1], max_changes=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=6), st.integers(0, 3), st.integers(0, 3),
       st.sampled_from(["area", "periods"]))
def test_matches_brute_force_over_all_schedules(demand, k, u, under):
    """Every supply series of levels 1..3, scored with the metrics module's own definitions."""
    times = [60.0 * i for i in range(len(demand))]
    end = 60.0 * len(demand)
    best = float("inf")
    for supply in itertools.product((1, 2, 3), repeat=len(demand)):
        if under == "area":
            missing = accuracy(times, demand, supply, end)[0] * len(demand)  # instance-periods
        else:
            missing = timeshare(times, demand, supply, end)[0] * len(demand)  # periods
        if reconfigurations(supply) <= k and missing <= u + 1e-9:
            best = min(best, cost_instance_minutes(times, supply, end))
    assert min_cost_schedule(demand, k, u, max_level=3, under=under) == pytest.approx(best)


def test_under_periods_counts_minutes_not_instances():
    # constant 1 misses 2 instances in one period: area 2, periods 1
    assert min_cost_schedule([1, 3, 1], max_changes=0, max_under=1, under="periods") == 3
    assert min_cost_schedule([1, 3, 1], max_changes=0, max_under=1, under="area") == 6  # constant 2
    with pytest.raises(ValueError):
        min_cost_schedule([1], 0, under="seconds")


def test_nowcast_tracking_trades_margin_for_under_provisioning():
    from foglab.sim.policies_oracle import nowcast_tracking

    tight = nowcast_tracking([0], margin=0.0, days=0.5)
    wide = nowcast_tracking([0], margin=0.15, days=0.5)
    assert wide["cost"] > tight["cost"] and wide["accuracy_u"] < tight["accuracy_u"]
    assert 0 < wide["timeshare_u"] < tight["timeshare_u"] <= 100.0
