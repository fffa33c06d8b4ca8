"""Seasonal policy: the learned profile, the day plan, causality, determinism, and the goal's
inequalities against the threshold baseline on a small fixed trace (docs/measurement.md)."""

from __future__ import annotations

import itertools
from typing import List, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.policy.base import ActionKind, Measurements
from agent.policy.registry import make_policy
from agent.policy.seasonal import SeasonalPolicy, learn_profile, plan_day

CAP = 100.0  # records/s per instance (linear platform: MST(n) = 100 n)


def test_profile_is_the_mean_of_each_slot_over_the_training_days():
    day1 = [10.0] * 60 + [30.0] * 60
    day2 = [20.0] * 60 + [50.0] * 60
    assert learn_profile(day1 + day2, 60, 120) == [15.0, 40.0]
    with pytest.raises(ValueError, match="whole day"):
        learn_profile(day1[:100], 60, 120)


def _brute_plan_cost(profile: Sequence[float], segments: int) -> float:
    best = float("inf")
    s = len(profile)
    for k in range(0, min(segments, s)):
        for cuts in itertools.combinations(range(1, s), k):
            edges = (0,) + cuts + (s,)
            best = min(best, sum(max(profile[a:b]) * (b - a) for a, b in zip(edges, edges[1:])))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50).map(float), min_size=1, max_size=7), st.integers(1, 4))
def test_day_plan_covers_the_profile_with_few_pieces_at_least_cost(profile, segments):
    plan = plan_day(tuple(profile), segments)
    assert all(p >= x for p, x in zip(plan, profile))
    assert sum(1 for a, b in zip(plan, plan[1:]) if a != b) <= segments - 1
    assert sum(plan) == pytest.approx(_brute_plan_cost(profile, segments))


def _run(policy: SeasonalPolicy, totals: Sequence[float], n0: int = 2) -> List[tuple]:
    """One operator on a linear platform, the policy seen through one instance (n known, rank 0);
    returns (action kind, count, target) per period. Period = slot = 60 s."""
    n, out = n0, []
    for k, total in enumerate(totals):
        done = min(total, CAP * n)
        bp = 0.0 if total <= CAP * n else 0.6
        m = Measurements(now=60.0 * k + 59.0, load=done / n, throughput=done / n, capacity=CAP,
                         upstream_backpressure=bp, n_instances=n, rank=n - 1, is_keeper=True)
        a = policy.decide(m)
        out.append((a.kind, a.count, a.target))
        if a.target is not None and a.kind is not ActionKind.NONE:
            n = a.target
    return out


PROFILE = tuple(100.0 + 80.0 * (1 if 8 <= j < 16 else 0) + 10.0 * (j % 3) for j in range(24))


def _policy() -> SeasonalPolicy:
    return SeasonalPolicy(profile=PROFILE, segments=4, margin=0.05, margin_up=0.10, hold=3, cooldown_in=120.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 900.0), min_size=2, max_size=60), st.data())
def test_a_decision_does_not_depend_on_the_input_after_it(totals, data):
    cut = data.draw(st.integers(1, len(totals) - 1))
    other = totals[:cut] + data.draw(st.lists(st.floats(0.0, 900.0), min_size=0, max_size=30))
    assert _run(_policy(), totals)[:cut] == _run(_policy(), other)[:cut]


def test_same_input_same_decisions():
    totals = [PROFILE[k % 24] * (1.0 + 0.1 * ((k * 7919) % 11 - 5) / 5) for k in range(96)]
    assert _run(_policy(), totals) == _run(_policy(), totals)


def test_steps_up_ahead_of_the_daily_ramp_in_one_reconfiguration():
    # slot 7 (the one before the busy plateau 8..15): the plan of the next slot needs 196 * 1.05 -> 3
    pol = _policy()
    acts = _run(pol, [PROFILE[k] for k in range(9)], n0=2)
    ups = [(k, a) for k, a in enumerate(acts) if a[0] is ActionKind.SCALE_OUT]
    assert ups and ups[0][0] <= 7 and ups[0][1][2] >= 2


def test_registered_for_the_simulator_and_the_daemon():
    from agent.config import RUNTIME_POLICIES
    from agent.policy.live import LIVE_POLICIES
    from foglab.sim.policies import POLICIES

    assert isinstance(make_policy("seasonal"), SeasonalPolicy)
    assert "seasonal" in RUNTIME_POLICIES and "seasonal" in LIVE_POLICIES and "seasonal" in POLICIES


@pytest.fixture(scope="module")
def clean_days():
    """Two noiseless days of the weekday taxi shape (about 6 s to simulate both policies): the first
    only teaches the profile, the second is measured."""
    from dataclasses import replace

    from foglab.sim.policies import SimConfig, simulate
    from foglab.sim.policies_trace import DAY_SECONDS, _diurnal, fog_testbed_matrix

    trace = [2000.0 * _diurnal(s * 10 / 3600.0) for s in range(2 * DAY_SECONDS)]
    cfg = replace(SimConfig(), profile=tuple(learn_profile(trace[:DAY_SECONDS], 60, DAY_SECONDS)))
    m = fog_testbed_matrix()
    return {p: simulate(p, trace[DAY_SECONDS:], m, 0, cfg).metrics for p in ("threshold", "seasonal")}


def test_halves_the_thresholds_reconfigurations_with_no_more_under_provisioning(clean_days):
    thr, sea = clean_days["threshold"], clean_days["seasonal"]
    assert sea.reconfigurations <= 0.5 * thr.reconfigurations
    assert sea.accuracy_u <= thr.accuracy_u and sea.timeshare_u <= thr.timeshare_u


@pytest.mark.xfail(strict=True, reason="goal not met: +3.7 % cost on this trace (docs/measurement.md, "
                                       "'The policy goal against the bound')")
def test_costs_no_more_than_the_threshold(clean_days):
    assert clean_days["seasonal"].cost <= clean_days["threshold"].cost


def test_cli_reports_seasonal_with_the_bound_and_draws_the_pareto_plot(tmp_path, capsys):
    import json

    from agent.cli.main import main

    png = tmp_path / "pareto.png"
    assert main(["simulate", "policies", "--seeds", "1", "--days", "0.5", "--train-days", "1", "--json",
                 "--policies", "threshold,seasonal", "--pareto", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["summary"]) == ["seasonal", "threshold"]
    costs = [b["cost"] for b in doc["bound"]]
    assert costs and all(a >= b for a, b in zip(costs, costs[1:]))  # more changes allowed never cost more
    thr = doc["runs"]["threshold"][0]
    bound_at_thr = {b["max_changes"]: b["cost"] for b in doc["bound"]}[int(round(thr["reconfigurations"]))]
    assert bound_at_thr <= thr["cost"]  # threshold's own schedule is one the bound could pick
    fore = {b["max_changes"]: b["cost"] for b in doc["forecast_bound"]}
    assert sorted(fore) == sorted(b["max_changes"] for b in doc["bound"])
    assert all(fore[b["max_changes"]] >= b["cost"] for b in doc["bound"])  # knowing less never costs less
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _live_pipeline(extra: str, policy: str = "seasonal") -> str:
    """The `bench policies` pipeline (source -> in_zone -> sink) with in_zone under `policy`."""
    from foglab.tools.policies_bench import PIPELINE

    return PIPELINE.format(seed=0, steps=[[0.0, 10.0]], service_ms=4.0, policy=policy, period=1.0, cooldown=0.0,
                           capacity=250.0, n_max=4, extra_scaling=extra)


def _scaling(extra: str):
    from agent.config import load_pipeline_text

    return load_pipeline_text(_live_pipeline(extra)).scaling_for("in_zone")


def test_a_live_seasonal_operator_plans_its_profile_on_unix_time():
    """A pipeline's `profile` (slot 10 s, 4 slots: quiet 100/s then busy 400/s, starting at unix
    time 1000) reaches the live policy: at the same input and the same monotonic time, an instance
    whose wall clock is in the slot before the busy ones scales out ahead of the load, and one in
    the first quiet slot does not. Every sibling reads the slot from unix time, so they agree."""
    from agent.policy.live import LivePolicy, PeriodInputs

    sc = _scaling("profile = [100.0, 100.0, 400.0, 400.0]\nprofile_slot = 10.0\nprofile_start = 1000.0")
    assert sc.policy == "seasonal" and sc.profile == (100.0, 100.0, 400.0, 400.0)
    # the simulator's operating point in periods (60 s / 240 s at its 60 s periods), not seconds
    pol = LivePolicy("seasonal", sc).policy
    assert (pol.cooldown_out, pol.cooldown_in, pol.hold) == (1.0, 4.0, 6)

    def first(wall):
        live = LivePolicy("seasonal", sc)
        return live.decide(PeriodInputs(now=5.0, input_rate=100.0, processed_rate=100.0, capacity=250.0,
                                        backpressure=0.0, is_keeper=True, draw=0.5, wall=wall)), live.last

    before_busy, why = first(1000.0 + 40 * 1000 + 15.0)  # slot 1 of a later day: slot 2 plans 400/s
    assert before_busy.scales and why["target"] == 2 and why["action"] == "scale_out", why
    quiet, why = first(1000.0 + 5.0)  # slot 0: this slot and the next plan 100/s
    assert not quiet.scales and why["action"] == "none", why
    # without a profile: hysteresis on the recent input, no step ahead of the load
    plain = LivePolicy("seasonal", _scaling(""))
    d = plain.decide(PeriodInputs(5.0, 100.0, 100.0, 250.0, 0.0, True, 0.5, 1000.0 + 15.0))
    assert not d.scales and plain.policy.plan is None


@pytest.mark.parametrize("line, key", [
    ("profile = [100.0, -1.0]", "profile"),
    ('profile = [100.0, "x"]', "profile[1]"),
    ("profile = [100.0, inf]", "profile"),
    ("profile_slot = 0.0", "profile_slot"),
    ("profile_start = nan", "profile_start"),
])
def test_a_malformed_live_profile_is_one_message_naming_its_key(line, key):
    from agent.schema import ConfigError

    with pytest.raises(ConfigError, match=r"\[operator\[1\]\.scaling\]\." + key.replace("[", r"\[").replace("]", r"\]")):
        _scaling(line)


def test_a_live_profile_is_bounded_and_read_by_seasonal_only():
    from agent.config import MAX_PROFILE_SLOTS
    from agent.schema import ConfigError

    too_long = "profile = [" + ", ".join(["1.0"] * (MAX_PROFILE_SLOTS + 1)) + "]"
    with pytest.raises(ConfigError, match="at most 10080"):
        _scaling(too_long)
    with pytest.raises(ConfigError, match="seasonal"):
        from agent.config import load_pipeline_text

        load_pipeline_text(_live_pipeline("profile = [1.0]", policy="threshold"))


def test_every_runtime_policy_is_accepted_by_the_pipeline_config():
    """RUNTIME_POLICIES is what the worker runs; the config's own list must not lag behind it
    (`seasonal` was registered in the worker but refused by check-config and deploy)."""
    from agent.config import RUNTIME_POLICIES, load_pipeline_text

    for p in RUNTIME_POLICIES:
        assert load_pipeline_text(_live_pipeline("", policy=p)).scaling_for("in_zone").policy == p


def test_patience_rides_out_a_burst_shorter_than_itself():
    """Plan mode on a flat profile (the plan needs 2 instances): input 280/s (3 instances' worth)
    for 2 periods is ridden out with patience 3 and answered in the first period with patience 1;
    3 periods of it are answered in the third period with patience 3."""
    flat = tuple([150.0] * 24)

    def outs(patience, totals):
        pol = SeasonalPolicy(profile=flat, segments=2, margin=0.05, margin_up=0.05, hold=3, patience=patience)
        return [k for k, a in enumerate(_run(pol, totals)) if a[0] is ActionKind.SCALE_OUT]

    burst2 = [150.0] * 4 + [280.0] * 2 + [150.0] * 4
    burst3 = [150.0] * 4 + [280.0] * 3 + [150.0] * 4
    assert outs(1, burst2) == [4]
    assert outs(3, burst2) == []
    assert outs(3, burst3) == [6]
    with pytest.raises(ValueError, match="patience"):
        SeasonalPolicy(patience=0)
