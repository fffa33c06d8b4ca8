"""The common policy interface: share mapping, adapters, threshold policy, latency-aware placement."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.node.placement import farthest, nd_max, rank_nodes_for_scale_out, sibling_rank
from agent.policy.base import ActionKind, Measurements, ScalingAction, share_of_delta
from agent.policy.registry import DecentralizedPolicy, make_policy
from agent.policy.threshold import ThresholdPolicy


def _m(**kw):
    base = dict(now=0.0, load=0.0, throughput=0.0, capacity=100.0)
    base.update(kw)
    return Measurements(**base)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(-39, 80))
def test_ranked_shares_add_up_to_the_operator_delta(n, delta):
    """With ranks, the instances' individual actions sum exactly to the operator-level change."""
    delta = max(delta, -(n - 1))
    acts = [share_of_delta(delta, _m(n_instances=n, rank=r, is_keeper=(r == n - 1))) for r in range(n)]
    created = sum(a.count for a in acts if a.kind is ActionKind.SCALE_OUT)
    removed = sum(1 for a in acts if a.kind is ActionKind.SCALE_IN)
    assert created - removed == delta
    assert not acts[n - 1].kind is ActionKind.SCALE_IN  # the keeper never terminates


def test_unranked_shares_add_up_in_expectation():
    n, delta, draws = 5, 3, [i / 1000 for i in range(1000)]
    total = sum(share_of_delta(delta, _m(n_instances=n, draw=d)).count for d in draws) / len(draws)
    assert total * n == pytest.approx(delta, rel=0.01)
    p_in = sum(share_of_delta(-2, _m(n_instances=n, draw=d)).scales for d in draws) / len(draws)
    assert p_in * (n - 1) == pytest.approx(2, rel=0.01)


def test_action_validation():
    with pytest.raises(ValueError):
        ScalingAction(ActionKind.SCALE_OUT, 0)
    with pytest.raises(ValueError):
        ScalingAction(ActionKind.NONE, 1)
    with pytest.raises(ValueError):
        _m(draw=1.0)
    with pytest.raises(ValueError):
        _m(capacity=0.0)


def test_decentralized_adapter_follows_the_paper_policy():
    pol = DecentralizedPolicy()  # C = 500, r = 0.7, up = 0.8, down = 0.6
    # l = 700 -> p = 700/350 - 1 = 1 -> exactly one copy
    a = pol.decide(_m(load=700.0, throughput=700.0, capacity=500.0, draw=0.99))
    assert (a.kind, a.count) == (ActionKind.SCALE_OUT, 1)
    # l = 175 -> terminate with probability 1 - 175/350 = 0.5
    assert pol.decide(_m(load=175.0, capacity=500.0, draw=0.49)).kind is ActionKind.SCALE_IN
    assert not pol.decide(_m(load=175.0, capacity=500.0, draw=0.51)).scales
    assert not pol.decide(_m(load=175.0, capacity=500.0, draw=0.1, is_keeper=True)).scales
    # capacity follows the measurement: same load, half the capacity -> scale out
    assert pol.decide(_m(load=300.0, capacity=250.0, draw=0.0)).kind is ActionKind.SCALE_OUT


def test_make_policy_by_name():
    assert make_policy("decentralized").name == "decentralized"
    assert make_policy("threshold").name == "threshold"
    assert make_policy("model").name == "model"
    with pytest.raises(ValueError, match="expected one of"):
        make_policy("magic")


def test_make_policy_from_a_scaling_section():
    from agent.config import ScalingSection

    sec = ScalingSection(policy="threshold", cooldown=30.0, max_instances=5, capacity=400.0)
    pol = make_policy(sec.policy, sec)
    assert (pol.cooldown, pol.max_instances) == (30.0, 5)
    dec = make_policy("decentralized", sec)
    assert dec.params.capacity == 400.0


def test_threshold_adds_one_removes_one_and_cools_down():
    pol = ThresholdPolicy(up=0.9, down=0.5, cooldown=100.0)
    acts = [ThresholdPolicy(cooldown=100.0).decide(_m(cpu=0.95, n_instances=4, rank=r)) for r in range(4)]
    assert sum(a.count for a in acts if a.scales) == 1 and all(a.kind is not ActionKind.SCALE_IN for a in acts)
    assert pol.decide(_m(now=0.0, cpu=0.95, n_instances=4, rank=3)).kind is ActionKind.SCALE_OUT
    assert not pol.decide(_m(now=50.0, cpu=0.99, n_instances=5, rank=4)).scales  # cooldown
    assert pol.decide(_m(now=150.0, cpu=0.2, n_instances=5, rank=0)).kind is ActionKind.SCALE_IN
    ins = [ThresholdPolicy().decide(_m(cpu=0.1, n_instances=6, rank=r)) for r in range(6)]
    assert [a.kind for a in ins].count(ActionKind.SCALE_IN) == 1  # one at a time, unlike the model
    assert not ThresholdPolicy().decide(_m(cpu=0.7, n_instances=3, rank=0)).scales
    assert not ThresholdPolicy(min_instances=2).decide(_m(cpu=0.1, n_instances=2, rank=0)).scales


def test_threshold_uses_processed_over_capacity_without_cpu():
    assert ThresholdPolicy().decide(_m(throughput=95.0, n_instances=1, rank=0)).kind is ActionKind.SCALE_OUT


def test_storm_halving_variant():
    ins = [ThresholdPolicy(storm_halving=True).decide(_m(cpu=0.1, n_instances=8, rank=r)) for r in range(8)]
    assert [a.kind for a in ins].count(ActionKind.SCALE_IN) == 4
    out = ThresholdPolicy(storm_halving=True).decide(_m(cpu=0.95, n_instances=8, rank=0))
    assert (out.kind, out.count) == (ActionKind.SCALE_OUT, 1)  # every overloaded instance adds one


# ---- placement ------------------------------------------------------------------------------------

MATRIX = {
    "a": {"b": 10.0, "c": 10.0, "d": 200.0},
    "b": {"c": 10.0, "d": 250.0},
    "c": {"d": 300.0},
}


def test_nd_max():
    assert nd_max(MATRIX, ["a"]) == 0.0
    assert nd_max(MATRIX, ["a", "b", "c"]) == 10.0
    assert nd_max(MATRIX, ["a", "d", "c"]) == 300.0


def test_scale_out_picks_the_lower_latency_node_when_only_latency_differs():
    # c and d are identical candidates except for their RTT to the operator's nodes
    assert rank_nodes_for_scale_out(MATRIX, ["a", "b"], ["d", "c"]) == ("c", "d")
    assert rank_nodes_for_scale_out(MATRIX, ["a"], ["d", "c", "b"])[0] in ("b", "c")


def test_scale_in_removes_the_farthest_instance_never_the_keeper():
    placement = {"i1": "a", "i2": "b", "i3": "d"}
    assert farthest(MATRIX, placement) == "i3"
    assert farthest(MATRIX, placement, keeper="i3") in ("i1", "i2")
    assert sibling_rank(MATRIX, placement, "i3") == 0
    assert sibling_rank(MATRIX, placement, "i3", keeper="i3") == 2


def test_unknown_link_is_an_error():
    with pytest.raises(KeyError, match="no latency"):
        nd_max({"a": {}}, ["a", "z"])
