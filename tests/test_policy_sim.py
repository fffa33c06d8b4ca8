"""Policy simulator: repeatable, consistent with the metrics, and the policies behave as published."""

from __future__ import annotations

import pytest

from agent.metrics_spec import cost_instance_minutes, reconfigurations
from foglab.sim.policies import POLICIES, Platform, SimConfig, format_table, simulate
from foglab.sim.policies_trace import NODES, taxi_trace, fog_testbed_matrix


@pytest.fixture(scope="module")
def trace():
    return taxi_trace(3, days=1.0)


@pytest.fixture(scope="module")
def runs(trace):
    m = fog_testbed_matrix()
    return {p: simulate(p, trace, m, seed=3) for p in POLICIES}


def test_trace_has_the_diurnal_shape_and_is_repeatable(trace):
    assert trace == taxi_trace(3, days=1.0)
    assert trace != taxi_trace(4, days=1.0)
    per_hour = [sum(trace[h * 360:(h + 1) * 360]) / 360 for h in range(24)]  # speed factor 10
    # bursts may make any single hour the maximum; the night trough and evening peak are structural
    night, morning, evening = (sum(per_hour[a:b]) / (b - a) for a, b in ((3, 6), (7, 12), (18, 23)))
    assert night < 0.4 * evening and morning < evening
    assert min(range(24), key=per_hour.__getitem__) in (2, 3, 4, 5, 6)


def test_matrix_is_symmetric_and_within_0_300_ms():
    m = fog_testbed_matrix()
    assert sorted(m) == sorted(NODES)
    vals = [v for row in m.values() for v in row.values()]
    assert max(vals) == 300.0 and min(vals) > 0
    assert all(m[a][b] == m[b][a] for a in m for b in m[a])


def test_runs_are_repeatable(trace, runs):
    again = simulate("decentralized", trace, fog_testbed_matrix(), seed=3)
    assert again.supply == runs["decentralized"].supply
    assert again.metrics == runs["decentralized"].metrics


def test_metrics_are_consistent_with_the_series(runs):
    for name, r in runs.items():
        assert all(1 <= s <= len(NODES) for s in r.supply), name
        assert r.metrics.reconfigurations == reconfigurations(r.supply)
        assert r.metrics.cost == pytest.approx(cost_instance_minutes(list(map(float, range(len(r.supply)))), r.supply,
                                                                       end=float(len(r.supply))))
        assert r.operations >= r.metrics.reconfigurations  # one reconfiguration moves >= 1 instance


def test_threshold_moves_one_at_a_time_the_model_removes_several(runs):
    def max_drop(s):
        return max(a - b for a, b in zip(s, s[1:]))

    assert max_drop(runs["threshold"].supply) == 1
    assert max_drop(runs["model"].supply) >= 2  # Gesscale: "may remove more than one replica at a time"
    ups = [b - a for a, b in zip(runs["model"].supply, runs["model"].supply[1:]) if b > a]
    assert ups and max(ups) == 1  # Algorithm 3: one at a time


def test_model_is_cheaper_than_threshold_on_this_trace(runs):
    assert runs["model"].metrics.cost < runs["threshold"].metrics.cost
    assert runs["model"].metrics.accuracy_o < runs["threshold"].metrics.accuracy_o


def test_perfect_platform_knowledge_keeps_the_backlog_bounded(trace):
    """With a huge cluster headroom nothing stays buffered at the end (excess time 0)."""
    r = simulate("threshold", trace[:3600], fog_testbed_matrix(), seed=1, cfg=SimConfig(platform=Platform(alpha=5000.0)))
    assert r.metrics.excess_time == 0.0 and r.metrics.accuracy_u == 0.0


def test_table_lists_every_policy_and_gesscale(runs):
    text = format_table({p: [r] for p, r in runs.items()})
    for p in POLICIES:
        assert f"| {p} |" in text
    assert "Gesscale" in text and "999.5" in text


def test_cli_simulate_policies_json(capsys):
    import json

    from agent.cli.main import main

    assert main(["simulate", "policies", "--trace", "taxi", "--seeds", "2", "--days", "0.25", "--json",
                 "--policies", "threshold,model"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["summary"]) == ["model", "threshold"]
    assert len(doc["runs"]["model"]) == 2
    assert set(doc["summary"]["model"]) >= {"accuracy_u", "accuracy_o", "timeshare_u", "timeshare_o",
                                            "excess_time", "reconfigurations", "cost"}
    assert main(["simulate", "policies", "--policies", "nope"]) == 1


def test_sized_changes_several_instances_per_reconfiguration(runs):
    """`sized` scales up to its target in one step and removes at least min_step (2) at once."""
    s = runs["sized"].supply
    ups = [b - a for a, b in zip(s, s[1:]) if b > a]
    drops = [(a, b) for a, b in zip(s, s[1:]) if b < a]
    assert ups and max(ups) >= 2
    assert drops and all(a - b >= 2 or b == 1 for a, b in drops)
    assert runs["sized"].operations > runs["sized"].metrics.reconfigurations


def test_sized_operating_points_against_threshold(runs):
    """On this one-day run: `sized` is cheaper than threshold with no more under-provisioning;
    `sized-few` trades cost for fewer reconfigurations than `sized`, and under-provisions less.
    (Reconfiguration counts against threshold vary per seed, e.g. 19 vs 17 here: the 10-seed means
    are in docs/measurement.md.)"""
    sized, few, thr = runs["sized"].metrics, runs["sized-few"].metrics, runs["threshold"].metrics
    assert sized.cost < thr.cost
    assert sized.accuracy_u <= thr.accuracy_u and sized.timeshare_u <= thr.timeshare_u
    assert few.reconfigurations < sized.reconfigurations and few.cost > sized.cost
    assert few.accuracy_u <= thr.accuracy_u and few.timeshare_u <= thr.timeshare_u
