"""SPEC elasticity metrics against values computed by hand on small constructed series."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent import metrics_spec as M

# t:      0    10   20   30   40   (end 50)
# demand: 2    4    4    1    1
# supply: 2    2    5    5    1
# under:  0    2*10            -> 20 instance-s, 10 s
# over:             1*10 4*10  -> 50 instance-s, 20 s
T = [0.0, 10.0, 20.0, 30.0, 40.0]
D = [2, 4, 4, 1, 1]
S = [2, 2, 5, 5, 1]


def test_accuracy_by_hand():
    acc_u, acc_o = M.accuracy(T, D, S, end=50.0)
    assert acc_u == pytest.approx(20 / 50)
    assert acc_o == pytest.approx(50 / 50)


def test_timeshare_by_hand():
    ts_u, ts_o = M.timeshare(T, D, S, end=50.0)
    assert ts_u == pytest.approx(10 / 50)
    assert ts_o == pytest.approx(20 / 50)


def test_reconfiguration_count_exact():
    assert M.reconfigurations([2, 2, 5, 5, 1]) == 2
    assert M.reconfigurations([1, 2, 3, 2, 2, 1]) == 4
    assert M.reconfigurations([3]) == 0


def test_cost_instance_minutes_by_hand():
    # supply area = 2*10 + 2*10 + 5*10 + 5*10 + 1*10 = 150 instance-s = 2.5 instance-minutes
    assert M.cost_instance_minutes(T, S, end=50.0) == pytest.approx(2.5)
    # one instance for one hour = 60 units
    assert M.cost_instance_minutes([0.0, 1800.0], [1, 1], end=3600.0) == pytest.approx(60.0)


def test_excess_time_by_hand():
    # input stopped at 3600 s, the buffered records were processed by 3960 s; ideal end 3600
    assert M.excess_time(3960.0, 3600.0, 3600.0) == pytest.approx(0.1)
    assert M.excess_time(3500.0, 3600.0, 3600.0) == 0.0
    assert M.drain_time(1000.0, 250.0) == pytest.approx(4.0)
    assert M.drain_time(0.0, 0.0) == 0.0
    assert math.isinf(M.drain_time(1.0, 0.0))


def test_elasticity_metrics_all_at_once():
    m = M.elasticity_metrics(T, D, S, end=50.0, actual_end=55.0, ideal_end=50.0)
    assert (m.accuracy_u, m.accuracy_o) == (pytest.approx(0.4), pytest.approx(1.0))
    assert (m.timeshare_u, m.timeshare_o) == (pytest.approx(0.2), pytest.approx(0.4))
    assert m.excess_time == pytest.approx(0.1)
    assert m.reconfigurations == 2
    assert m.cost == pytest.approx(2.5)
    assert m.duration == 50.0


def test_default_end_is_one_median_step():
    m = M.elasticity_metrics(T, D, S)
    assert m.duration == 50.0


def test_rejects_bad_series():
    with pytest.raises(ValueError, match="lengths differ"):
        M.accuracy([0, 1], [1], [1, 1])
    with pytest.raises(ValueError, match="increase strictly"):
        M.accuracy([0, 0], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="end"):
        M.accuracy([0, 10], [1, 1], [1, 1], end=5)


def test_summarize_mean_and_spread():
    a = M.ElasticityMetrics(1.0, 2.0, 0.1, 0.2, 0.0, 2, 10.0, 60.0)
    b = M.ElasticityMetrics(3.0, 2.0, 0.3, 0.2, 0.0, 4, 20.0, 60.0)
    s = M.summarize([a, b])
    assert s["accuracy_u"] == (pytest.approx(2.0), pytest.approx(math.sqrt(2.0)))
    assert s["accuracy_o"] == (pytest.approx(2.0), pytest.approx(0.0))
    assert s["reconfigurations"][0] == pytest.approx(3.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20), st.floats(0.5, 100.0)), min_size=1, max_size=30))
def test_invariants(samples):
    """Under + over areas equal the absolute gap; timeshares add up to at most 1; perfect supply scores 0."""
    times, t = [], 0.0
    for _, _, dt in samples:
        times.append(t)
        t += dt
    demand = [d for d, _, _ in samples]
    supply = [s for _, s, _ in samples]
    m = M.elasticity_metrics(times, demand, supply, end=t)
    gap = sum(abs(d - s) * dt for d, s, dt in samples) / t
    assert m.accuracy_u + m.accuracy_o == pytest.approx(gap)
    assert m.timeshare_u + m.timeshare_o <= 1.0 + 1e-9
    perfect = M.elasticity_metrics(times, demand, demand, end=t)
    assert perfect.accuracy_u == perfect.accuracy_o == perfect.timeshare_u == perfect.timeshare_o == 0.0
    assert m.cost == pytest.approx(sum(s * dt for _, s, dt in samples) / 60.0)
