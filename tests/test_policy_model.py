"""Gesscale MST model: calibration forms, parameter recovery, overload detection, scale-down."""

from __future__ import annotations

import random

import pytest

from agent.policy.base import ActionKind, Measurements
from agent.policy.model import (
    ModelPolicy,
    MstModel,
    MstPoint,
    fit_mst,
    is_overload_root,
    scale_down_target,
)

ALPHA, BETA, GAMMA = 400.0, 0.85, 0.6


def synthetic_points(seed: int, noise: float, ns=range(1, 9), nds=(0.0, 50.0, 150.0, 300.0)):
    rnd = random.Random(seed)
    return [MstPoint(n, nd, (ALPHA * n ** BETA - GAMMA * nd) * (1.0 + rnd.gauss(0.0, noise))) for n in ns for nd in nds]


@pytest.mark.parametrize("seed", range(20))
def test_full_model_recovers_parameters_within_5_percent(seed):
    """32 measurements, 0.5% multiplicative Gaussian noise (sigma): all three within 5%."""
    m = fit_mst(synthetic_points(seed, 0.005))
    assert m.points == 32
    assert m.alpha == pytest.approx(ALPHA, rel=0.05)
    assert m.beta == pytest.approx(BETA, rel=0.05)
    assert m.gamma == pytest.approx(GAMMA, rel=0.05)


def test_three_exact_points_fit_exactly():
    pts = [MstPoint(n, nd, ALPHA * n ** BETA - GAMMA * nd) for n, nd in ((1, 0.0), (3, 100.0), (6, 250.0))]
    m = fit_mst(pts)
    for p in pts:
        assert m.predict(p.n, p.nd_max_ms) == pytest.approx(p.mst, rel=1e-4)
    assert (m.alpha, m.beta, m.gamma) == (pytest.approx(ALPHA, rel=1e-3), pytest.approx(BETA, rel=1e-3),
                                           pytest.approx(GAMMA, rel=1e-2))


def test_one_measurement_form_is_alpha_times_n():
    m = fit_mst([MstPoint(4, 120.0, 1000.0)])
    assert (m.alpha, m.beta, m.gamma, m.points) == (250.0, 1.0, 0.0, 1)
    assert m.predict(2, 300.0) == 500.0  # eq. (2) ignores the delay


def test_two_measurement_form_fits_alpha_and_gamma_with_beta_one():
    # MST = 300 n - 0.5 ND, exactly
    pts = [MstPoint(2, 100.0, 550.0), MstPoint(5, 300.0, 1350.0)]
    m = fit_mst(pts)
    assert (m.beta, m.points) == (1.0, 2)
    assert m.alpha == pytest.approx(300.0)
    assert m.gamma == pytest.approx(0.5)


def test_two_measurements_without_delay_information_fall_back_to_alpha():
    m = fit_mst([MstPoint(1, 0.0, 300.0), MstPoint(3, 0.0, 900.0)])
    assert (m.alpha, m.beta, m.gamma) == (pytest.approx(300.0), 1.0, 0.0)


def test_fit_needs_a_point():
    with pytest.raises(ValueError):
        fit_mst([])


def test_overload_root_is_algorithm_1():
    assert is_overload_root(backpressure=0.0, upstream_backpressure=0.9)
    assert is_overload_root(0.5, 0.51)
    assert not is_overload_root(0.6, 0.9)  # blocked itself: the bottleneck is downstream
    assert not is_overload_root(0.0, 0.5)  # 0.5 is not "high"


def test_scale_down_removes_several_at_once_when_the_model_allows():
    model = MstModel(100.0)  # 100 records/s per instance, linear
    # 10 instances, demand 250/s, margin 15%: 3 instances give 300 (DT 16.7%) -> go to 3
    assert scale_down_target(model, 10, 250.0, 250.0, 0.0, 15.0) == 3
    # margin 20%: 3 gives 16.7% < 20 -> stop at 4 (DT 37.5%)
    assert scale_down_target(model, 10, 250.0, 250.0, 0.0, 20.0) == 4
    assert scale_down_target(model, 10, 250.0, 250.0, 0.0, 15.0, n_min=5) == 5
    assert scale_down_target(model, 3, 290.0, 290.0, 0.0, 15.0) == 3  # needed: keep


def _m(now, n, per_instance_rate, **kw):
    base = dict(now=now, load=per_instance_rate, throughput=per_instance_rate, capacity=100.0, n_instances=n)
    base.update(kw)
    return Measurements(**base)


def test_policy_scales_up_by_one_on_back_pressure_and_calibrates():
    pols = [ModelPolicy(cooldown=60.0) for _ in range(4)]  # one policy object per instance
    acts = [p.decide(_m(0.0, 4, 90.0, upstream_backpressure=0.9, rank=r)) for r, p in enumerate(pols)]
    pol = pols[0]
    assert not pol.decide(_m(30.0, 5, 90.0, upstream_backpressure=0.9, rank=0)).scales  # cooldown
    assert sum(a.count for a in acts if a.kind is ActionKind.SCALE_OUT) == 1  # exactly +1 overall
    assert pol.mst.points == [MstPoint(4, 0.0, 360.0)]
    assert pol.model().alpha == pytest.approx(90.0)


def test_policy_respects_cooldown_then_scales_down_by_several():
    pol = ModelPolicy(threshold_dt=15.0, cooldown=60.0)
    pol.mst.record(MstPoint(4, 0.0, 400.0))  # alpha = 100
    pol.last_action_at = 0.0
    assert not pol.decide(_m(30.0, 8, 20.0, rank=0)).scales  # in cooldown
    # 8 instances, operator throughput 160/s: 2 instances give 200 (DT 20%) -> remove 6
    acts = [ModelPolicy(15.0, 60.0) for _ in range(8)]
    for p in acts:
        p.mst.record(MstPoint(4, 0.0, 400.0))
    out = [p.decide(_m(100.0, 8, 20.0, rank=r, is_keeper=(r == 7))) for r, p in enumerate(acts)]
    assert [a.kind for a in out].count(ActionKind.SCALE_IN) == 6
    assert all(a.target == 2 for a in out if a.scales)
    assert not out[7].scales  # the keeper (ranked last) stays


def test_policy_never_scales_down_under_back_pressure():
    pol = ModelPolicy()
    pol.mst.record(MstPoint(1, 0.0, 1000.0))
    assert not pol.decide(_m(0.0, 8, 10.0, backpressure=0.9, upstream_backpressure=0.9)).scales


def test_policy_uses_the_calibrated_capacity_before_any_online_point():
    pol = ModelPolicy(threshold_dt=15.0)
    # capacity 100, 4 instances at 20/s each = 80/s: one instance (100, DT 20%) is enough
    out = pol.decide(_m(0.0, 4, 20.0, rank=0))
    assert out.kind is ActionKind.SCALE_IN and out.target == 1


def test_extensions_sized_and_early_scale_up_and_demand_window():
    # sized: 4 instances saturated at 400/s (alpha 100); margin 20% -> need 500/s -> 5 instances
    pols = [ModelPolicy(threshold_dt=20.0, sized_scale_up=True) for _ in range(4)]
    for p in pols:
        p.mst.record(MstPoint(1, 0.0, 100.0))
    acts = [p.decide(_m(0.0, 4, 100.0, upstream_backpressure=0.9, rank=r)) for r, p in enumerate(pols)]
    assert sum(a.count for a in acts if a.scales) == 1 and acts[-1].target == 5
    pols = [ModelPolicy(threshold_dt=40.0, sized_scale_up=True) for _ in range(4)]
    acts = [p.decide(_m(0.0, 4, 100.0, capacity=100.0, upstream_backpressure=0.9, rank=r)) for r, p in enumerate(pols)]
    assert sum(a.count for a in acts if a.scales) == 3  # 400 / 0.6 = 667/s -> 7 instances
    # early: 92% of the predicted MST without back pressure
    early = ModelPolicy(early_up=0.9)
    early.mst.record(MstPoint(1, 0.0, 100.0))
    assert early.decide(_m(0.0, 2, 92.0, rank=1)).kind is ActionKind.SCALE_OUT
    assert not ModelPolicy().decide(_m(0.0, 2, 92.0, capacity=100.0, rank=1)).scales  # published: waits for BP
    # demand window: a peak 2 periods ago blocks the scale-down
    win = ModelPolicy(threshold_dt=15.0, cooldown=0.0, demand_window=3)
    win.mst.record(MstPoint(1, 0.0, 100.0))
    assert not win.decide(_m(0.0, 4, 80.0, rank=0)).scales  # 320/s needs 4
    assert not win.decide(_m(60.0, 4, 20.0, rank=0)).scales  # 80/s now, but the window remembers 320
    fresh = ModelPolicy(threshold_dt=15.0, cooldown=0.0)
    fresh.mst.record(MstPoint(1, 0.0, 100.0))
    assert fresh.decide(_m(60.0, 4, 20.0, rank=0)).kind is ActionKind.SCALE_IN


def test_min_scale_down_batches_removals():
    pol = ModelPolicy(threshold_dt=15.0, cooldown=0.0, min_scale_down=2)
    pol.mst.record(MstPoint(1, 0.0, 100.0))
    # 4 instances at 70/s each = 280/s: 3 instances suffice (300, DT 6.7% < 15 -> no); keep 4
    assert not pol.decide(_m(0.0, 4, 70.0, rank=0)).scales
    # 4 at 55/s = 220/s: 3 give DT 26.7% -> one removable only: wait
    assert not pol.decide(_m(60.0, 4, 55.0, rank=0)).scales
    # 4 at 40/s = 160/s: 2 give DT 20% -> two removable: go
    out = pol.decide(_m(120.0, 4, 40.0, rank=0))
    assert out.kind is ActionKind.SCALE_IN and out.target == 2
    # never blocked by the batch size when only the minimum is left to remove
    last = ModelPolicy(threshold_dt=15.0, cooldown=0.0, min_scale_down=3)
    last.mst.record(MstPoint(1, 0.0, 100.0))
    assert last.decide(_m(0.0, 2, 10.0, rank=0)).target == 1
