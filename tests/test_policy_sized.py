"""Sized forecast policy: bounds, sized scale-up, no scale-in under back pressure, hysteresis."""

from __future__ import annotations

from typing import Dict, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.policy.base import ActionKind, Measurements
from agent.policy.registry import make_policy
from agent.policy.sized import SizedPolicy

CAP = 100.0  # records/s per instance (linear platform in these unit tests: MST(n) = 100 n)


def _m(now: float, n: int, total_load: float, bp: float = 0.0, rank: int = 0, keeper: bool = False,
       cap: float = CAP) -> Measurements:
    """One instance's view of an operator of n instances receiving `total_load` records/s."""
    share = total_load / n
    done = min(share, cap)  # saturated instances process at most their capacity
    return Measurements(now=now, load=share if bp == 0 else done, throughput=done, capacity=cap,
                        upstream_backpressure=bp, n_instances=n, rank=rank, is_keeper=keeper)


def _ranked(policies: Dict[int, SizedPolicy]) -> List[int]:
    """Instance ids by rank: the oldest (id 0, the keeper) is ranked last, the others by age."""
    ids = sorted(policies)
    return ids[1:] + ids[:1]


def _operator_step(policies: Dict[int, SizedPolicy], n: int, now: float, total: float, bp: float = 0.0) -> int:
    """All n instances decide on the same numbers; returns the new instance count."""
    assert len(policies) == n
    delta = 0
    for rank, iid in enumerate(_ranked(policies)):
        act = policies[iid].decide(_m(now, n, total, bp, rank=rank, keeper=(rank == n - 1)))
        if act.kind is ActionKind.SCALE_OUT:
            delta += act.count
        elif act.kind is ActionKind.SCALE_IN:
            delta -= 1
    return n + delta


def test_scales_up_in_one_step_to_the_sized_target_when_the_input_exceeds_predicted_capacity():
    pol = SizedPolicy(margin_up=0.1, margin_up_target=0.15, cooldown_out=0.0)
    # 2 instances of 100/s each, 450/s arrive (not yet backlogged): 450 * 1.15 = 517.5 -> 6 instances
    act = pol.decide(_m(60.0, 2, 450.0, rank=1, keeper=True))  # the keeper is the closest: it adds first
    assert act.kind is ActionKind.SCALE_OUT and act.target == 6
    others = SizedPolicy(margin_up=0.1, margin_up_target=0.15, cooldown_out=0.0).decide(_m(60.0, 2, 450.0, rank=0))
    assert act.count + others.count == 4  # one reconfiguration of +4, shared by the two instances


def test_does_not_scale_up_while_the_forecast_fits_the_margin():
    pol = SizedPolicy(margin_up=0.1)
    assert not pol.decide(_m(60.0, 4, 350.0)).scales  # 350 * 1.1 = 385 <= 400


def test_rising_input_is_forecast_before_capacity_is_exceeded():
    """300, 330, 360 on 4 instances: 360 * 1.1 = 396 fits 400, but the trend (+30/period) does not."""
    pol = SizedPolicy(margin_up=0.1, horizon=1.0, trend_periods=2, cooldown_out=0.0)
    assert not pol.decide(_m(60.0, 4, 300.0)).scales
    assert not pol.decide(_m(120.0, 4, 330.0)).scales
    act = pol.decide(_m(180.0, 4, 360.0, rank=3, keeper=True))
    assert act.kind is ActionKind.SCALE_OUT and act.target >= 5
    flat = SizedPolicy(margin_up=0.1, horizon=1.0, trend_periods=2, cooldown_out=0.0)
    for t in (60.0, 120.0, 180.0):
        assert not flat.decide(_m(t, 4, 360.0)).scales  # the same level without a trend: no action


def test_back_pressure_adds_at_least_one_instance():
    pol = SizedPolicy(cooldown_out=0.0)
    act = pol.decide(_m(60.0, 3, 1000.0, bp=1.0, rank=2, keeper=True))
    assert act.kind is ActionKind.SCALE_OUT and act.target >= 4


@pytest.mark.parametrize("bp_period", [0, 1, 2])
def test_never_scales_in_while_backlogged(bp_period):
    """Input far below one instance, but a backlog in any of the last `hold` periods: stay."""
    pol = SizedPolicy(hold=3, cooldown_in=0.0)
    for k in range(3):
        act = pol.decide(_m(60.0 * (k + 1), 5, 50.0, bp=0.2 if k == bp_period else 0.0, rank=0))
        assert act.kind is not ActionKind.SCALE_IN, k


def test_scale_in_waits_hold_periods_then_removes_several_at_once():
    pols = [SizedPolicy(margin_down=0.2, hold=3, cooldown_in=0.0) for _ in range(8)]
    n = 8
    for k in range(2):
        assert _operator_step(dict(enumerate(pols)), n, 60.0 * (k + 1), 230.0) == n
    # third low period: 230 * 1.2 = 276 -> 3 instances, 5 removed in one reconfiguration
    assert _operator_step(dict(enumerate(pols)), n, 180.0, 230.0) == 3


def test_min_step_batches_removals():
    pol = SizedPolicy(margin_down=0.0, hold=1, min_step=2, cooldown_in=0.0)
    assert not pol.decide(_m(60.0, 4, 290.0, rank=0)).scales  # only one could go: wait
    assert pol.decide(_m(120.0, 4, 190.0, rank=0)).kind is ActionKind.SCALE_IN  # two can go


def test_scale_in_waits_the_longer_cooldown_after_a_scale_out():
    pol = SizedPolicy(hold=1, cooldown_out=0.0, cooldown_in=300.0)
    assert pol.decide(_m(60.0, 2, 500.0, rank=1, keeper=True)).kind is ActionKind.SCALE_OUT
    assert not pol.decide(_m(120.0, 6, 50.0, rank=0)).scales  # 60 s after: too early
    assert not pol.decide(_m(300.0, 6, 50.0, rank=0)).scales  # 240 s after: too early
    assert pol.decide(_m(360.0, 6, 50.0, rank=0)).kind is ActionKind.SCALE_IN


def test_the_keeper_never_scales_in():
    pol = SizedPolicy(hold=1, cooldown_in=0.0)
    for k in range(3):
        assert not pol.decide(_m(60.0 * (k + 1), 4, 10.0, rank=3, keeper=True)).scales


def test_model_follows_the_online_capacity():
    """A throttled node (capacity halved) needs twice the instances for the same input."""
    pol = SizedPolicy(margin_up=0.0, margin_up_target=0.0, cooldown_out=0.0)
    act = pol.decide(_m(60.0, 2, 390.0, rank=1, keeper=True, cap=50.0))
    assert act.target == 8


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 3000.0), st.sampled_from([0.0, 0.0, 0.3, 1.0])), min_size=1, max_size=40),
       st.integers(1, 10), st.integers(1, 3))
def test_operator_instance_count_stays_within_bounds(steps, max_instances, min_instances):
    """Whatever the input, the instances' combined actions keep min <= n <= max (ranked shares,
    fresh policy objects for new instances, as in the simulator)."""
    min_instances = min(min_instances, max_instances)

    def factory() -> SizedPolicy:
        return SizedPolicy(min_instances=min_instances, max_instances=max_instances, hold=2,
                           cooldown_out=0.0, cooldown_in=0.0)

    n = min_instances
    policies: Dict[int, SizedPolicy] = {i: factory() for i in range(n)}
    next_id = n
    for k, (total, bp) in enumerate(steps):
        n_new = _operator_step(policies, n, 60.0 * (k + 1), total, bp)
        assert min_instances <= n_new <= max_instances, (k, n, n_new)
        if n_new < n:  # ranks 0.. (the farthest first) left
            for iid in _ranked(policies)[:n - n_new]:
                del policies[iid]
        for _ in range(n_new - n):
            policies[next_id] = factory()
            next_id += 1
        n = n_new


def test_decisions_are_deterministic():
    def run() -> List[object]:
        pol = SizedPolicy(cooldown_out=0.0)
        loads = (100, 400, 800, 50, 20, 20, 20)
        return [pol.decide(_m(60.0 * (k + 1), 3, load, rank=0)) for k, load in enumerate(loads)]

    assert run() == run()


def test_make_policy_builds_it():
    assert make_policy("sized").name == "sized"


def test_invalid_parameters_are_refused():
    with pytest.raises(ValueError):
        SizedPolicy(margin_up=0.3, margin_up_target=0.1)
    with pytest.raises(ValueError):
        SizedPolicy(hold=0)
    with pytest.raises(ValueError):
        SizedPolicy(min_instances=5, max_instances=4)
    with pytest.raises(ValueError):
        SizedPolicy(horizon_target=-1.0)
    with pytest.raises(ValueError):
        SizedPolicy(cooldown_in=-1.0)


def test_back_pressure_from_successors_does_not_add_instances():
    """Blocked by its successors, the operator is not the bottleneck (Gesscale Algorithm 1)."""
    pol = SizedPolicy(cooldown_out=0.0)
    m = Measurements(now=60.0, load=50.0, throughput=50.0, capacity=CAP, backpressure=1.0,
                     upstream_backpressure=1.0, n_instances=3, rank=2, is_keeper=True)
    assert not pol.decide(m).scales
    low = Measurements(now=120.0, load=5.0, throughput=5.0, capacity=CAP, backpressure=0.3,
                       n_instances=3, rank=0)
    assert not SizedPolicy(hold=1, cooldown_in=0.0).decide(low).scales  # nor removes any
