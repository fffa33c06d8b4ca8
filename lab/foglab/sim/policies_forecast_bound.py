"""The perfect-forecast bound: the cheapest few-changes schedule a causal forecast could plan at best.

Why: the clairvoyant bound (lab/foglab/sim/policies_oracle.py) re-sizes at each of its K changes to the
exact future minute demand, the day's noise and bursts included, which no causal policy can know
(docs/measurement.md, "The policy goal against the bound"). This bound grants a policy the most a
forecast of the day can know on this trace, the smooth part of each test day (the generator's
diurnal shape x that day's level, `smooth_trace`: a perfect profile and level forecast) and
nothing of the noise or the bursts, and asks what a plan made from it costs:

- the plan for budget K and margin m is the least-cost supply series with <= K changes that covers
  the forecast demand needed(smooth x (1 + m)) in every minute (`cover_plans`, exact DP);
- it is scored on the REAL minute demand and kept only if it under-provisions no more than the
  threshold baseline did on that seed (area and periods, as the clairvoyant bound);
- the bound at K is the least cost over the margins 0..`max_margin` of the kept plans, per seed
  (the margin is tuned per seed and per K on the real trace: generous to the plan), then the mean
  over the seeds.

What it does not grant: a causal policy also sees the noise of the minutes just past (correlated
over about 5 periods) and may react to it, which an open-loop plan does not; every reaction costs
changes (docs/measurement.md has the numbers). Every kept plan is a schedule the clairvoyant
bound could pick, so this bound is never below it (tests/test_policy_forecast_bound.py).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

from foglab.sim.policies import Platform, RunResult, SimConfig, _demand, _ideal_mst
from foglab.sim.policies_oracle import cover_plans
from foglab.sim.policies_pareto import under_limits

__all__ = ["plan_bound", "forecast_bound_curve", "forecast_of_test_days", "MARGINS"]

# margins of the forecast tried for every budget: 0 .. 100 % by 1 %
MARGINS = tuple(i / 100.0 for i in range(0, 101))


def under_of(supply: Sequence[int], demand: Sequence[int]) -> Tuple[int, int]:
    """(missing instance-periods, under-provisioned periods) of a supply series against a demand."""
    return (sum(max(0, d - s) for d, s in zip(demand, supply)), sum(1 for d, s in zip(demand, supply) if d > s))


def plan_bound(real: Sequence[int], forecast: Sequence[float], mst: Sequence[float], max_area: int, max_periods: int,
               max_changes: int, initial: int, margins: Sequence[float] = MARGINS) -> List[Tuple[float, float]]:
    """Per budget k = 0..max_changes: (least cost, its margin) of the plans on `forecast` (records/s
    per period) that under-provision `real` (instances per period) by at most max_area
    instance-periods and max_periods periods; (inf, nan) where no margin gives one."""
    best: List[Tuple[float, float]] = [(float("inf"), float("nan"))] * (max_changes + 1)
    seen: Dict[Tuple[int, ...], None] = {}
    n_max = len(mst) - 1
    for m in margins:
        need = tuple(_demand(x * (1.0 + m), mst) for x in forecast)
        if need in seen:  # a margin that changes no period's forecast demand plans the same
            continue
        seen[need] = None
        for k, plan in enumerate(cover_plans(need, max_changes, initial, n_max)):
            if plan is None:
                continue
            area, periods = under_of(plan, real)
            cost = float(sum(plan))
            if area <= max_area and periods <= max_periods and cost < best[k][0]:
                best[k] = (cost, m)
    for k in range(1, max_changes + 1):  # a plan with <= k - 1 changes has <= k
        if best[k - 1][0] < best[k][0]:
            best[k] = best[k - 1]
    return best


def forecast_of_test_days(seed: int, days: float, train_days: int, day_sigma: float, period: int = 60) -> List[float]:
    """The smooth part of the test days of `compare(seed, ...)`, mean records/s per period."""
    from foglab.sim.policies_trace import DAY_SECONDS, smooth_trace

    smooth = smooth_trace(seed, days=train_days + days, day_sigma=day_sigma)[train_days * DAY_SECONDS:]
    return [sum(smooth[i:i + period]) / len(smooth[i:i + period]) for i in range(0, len(smooth), period)]


def forecast_bound_curve(threshold_runs: Sequence[RunResult], budgets: Sequence[int], days: float,
                         train_days: int = 0, day_sigma: float = 0.0,
                         matrix: "Mapping[str, Mapping[str, float]] | None" = None,
                         margins: Sequence[float] = MARGINS) -> List[Tuple[int, float]]:
    """(K, mean perfect-forecast cost over the seeds) for each budget, against the same threshold
    runs (and so the same under-provisioning limits and real demand) as `policies_pareto.bound_curve`."""
    from foglab.sim.policies_trace import fog_testbed_matrix

    matrix = matrix if matrix is not None else fog_testbed_matrix()
    mst = _ideal_mst(Platform(), matrix, sorted(matrix))
    top = max(budgets)
    per_seed = []
    for r in threshold_runs:
        real, area, periods = under_limits(r)
        forecast = forecast_of_test_days(r.seed, days, train_days, day_sigma)[:len(real)]
        per_seed.append(plan_bound(real, forecast, mst, area, periods, top, SimConfig().initial, margins))
    return [(k, sum(b[k][0] for b in per_seed) / len(per_seed)) for k in budgets]
