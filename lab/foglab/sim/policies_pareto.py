"""The policy goal against the clairvoyant bound: reconfigurations vs cost, per policy and per budget.

Why: issue 25 item 6 restates the goal against the limit. A policy's point (mean reconfigurations,
mean cost, mean under-provisioning over the seeds) is compared with the clairvoyant schedule
(lab/foglab/sim/policies_oracle.py) that knows every minute's demand in advance, may change supply at
most K times and under-provisions no more than the threshold baseline did on the same seed (area
and periods, the larger of the two optima: a lower bound for both constraints at once). The
bound at several K draws the front no causal policy can pass (docs/measurement.md).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from foglab.sim.policies import RunResult, SimConfig
from foglab.sim.policies_oracle import min_cost_by_budget, min_cost_schedule

__all__ = ["bound_at", "bound_curve", "under_limits", "points", "plot_pareto"]


def under_limits(threshold_run: RunResult) -> Tuple[List[int], int, int]:
    """(demand per minute, missing instance-minutes, under-provisioned minutes) of a threshold run:
    the real demand and the under-provisioning a bound's schedule may not exceed."""
    demand = threshold_run.demand[::60]
    minutes = len(demand)
    return (demand, int(threshold_run.metrics.accuracy_u * minutes + 1e-9),
            int(threshold_run.metrics.timeshare_u * minutes + 1e-9))


def bound_at(threshold_runs: Sequence[RunResult], max_changes: int, n_max: int = 10) -> float:
    """Mean over the seeds of the clairvoyant cost with <= max_changes supply changes and no more
    under-provisioning than the threshold run of that seed (instance-minutes)."""
    costs = []
    for r in threshold_runs:
        demand, area, periods = under_limits(r)
        costs.append(max(min_cost_schedule(demand, max_changes, area, n_max, SimConfig().initial, under="area"),
                         min_cost_schedule(demand, max_changes, periods, n_max, SimConfig().initial, under="periods")))
    return sum(costs) / len(costs)


def bound_curve(threshold_runs: Sequence[RunResult], budgets: Sequence[int], n_max: int = 10) -> List[Tuple[int, float]]:
    """`bound_at` for each budget, with one DP per seed and constraint for all of them."""
    if not budgets:
        return []
    top = max(budgets)
    per_seed = []
    for r in threshold_runs:
        demand, area, periods = under_limits(r)
        by_area = min_cost_by_budget(demand, top, area, n_max, SimConfig().initial, under="area")
        by_periods = min_cost_by_budget(demand, top, periods, n_max, SimConfig().initial, under="periods")
        per_seed.append([max(a, b) for a, b in zip(by_area, by_periods)])
    return [(k, sum(c[k] for c in per_seed) / len(per_seed)) for k in budgets]


def points(results: Mapping[str, Sequence[RunResult]]) -> Dict[str, Tuple[float, float, float]]:
    """policy -> (mean reconfigurations, mean cost, mean accuracy_U)."""
    out = {}
    for p, runs in results.items():
        k = len(runs)
        out[p] = (sum(r.metrics.reconfigurations for r in runs) / k, sum(r.metrics.cost for r in runs) / k,
                  sum(r.metrics.accuracy_u for r in runs) / k)
    return out


def plot_pareto(pts: Mapping[str, Tuple[float, float, float]], bound: Sequence[Tuple[int, float]], path: str,
                title: str = "", forecast: Optional[Sequence[Tuple[int, float]]] = None) -> None:
    """Reconfigurations vs cost; colour = accuracy_U (under-provisioning); the bound as a line, and
    the perfect-forecast bound (lab/foglab/sim/policies_forecast_bound.py) as a second one if given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5.2))
    ks, cs = zip(*bound) if bound else ((), ())
    ax.plot(ks, cs, "k--o", markersize=4, label="clairvoyant bound (under <= threshold's)")
    if forecast:
        fks, fcs = zip(*forecast)
        ax.plot(fks, fcs, "--s", color="C3", markersize=3,
                label="perfect-forecast plan (smooth day known, noise not; same under limit)")
        ax.plot(ks, [1.1 * c for c in cs], ":", color="grey", label="1.1 x clairvoyant bound (the goal's cost clause)")
    xs = [v[0] for v in pts.values()]
    ys = [v[1] for v in pts.values()]
    us = [v[2] for v in pts.values()]
    sc = ax.scatter(xs, ys, c=us, cmap="viridis_r", s=60, zorder=3)
    for name, (x, y, _) in pts.items():
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    fig.colorbar(sc, ax=ax, label="accuracy_U (missing instances, mean)")
    ax.set_xlabel("reconfigurations (mean)")
    ax.set_ylabel("cost, instance-minutes (mean)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    ax.margins(x=0.12, y=0.08)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
