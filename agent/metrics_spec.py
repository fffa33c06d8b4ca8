"""SPEC elasticity metrics (Herbst et al. 2016, as used by Gesscale section V-A), in one place.

Why one module: the policy simulator, the real runs (`fog-agent demo`) and the PySpark report
must compute the same numbers from the same kind of input, or their tables cannot be compared.
The input is a time series of *demand* (the instances an ideal, instantaneous auto-scaler would
run) and *supply* (the instances that actually ran). A sample holds from its time stamp until the
next one (a step function); the last sample holds until `end` (default: one median step later).

Definitions (T = measured duration, areas are instance-seconds):
- accuracy_U = sum of areas where demand > supply, / T   (average missing instances)
- accuracy_O = sum of areas where supply > demand, / T   (average surplus instances)
- timeshare_U = time spent with demand > supply, / T     (fraction; Gesscale's Table III prints %)
- timeshare_O = time spent with supply > demand, / T
- excess_time = (P_t - I_t) / T: time needed after the input stops to drain what was buffered
  (actual end P_t minus ideal end I_t), normalized by T.
- reconfigurations = number of supply changes (several instances added at once count once, as
  in Gesscale where one Flink restart applies any new parallelism).
- cost = instance-minutes (each instance charged one unit per minute of execution).

Pure functions of numbers: no clock, no I/O, no dependency beyond the standard library (the
PySpark job imports this module on the driver).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

__all__ = [
    "ElasticityMetrics",
    "step_durations",
    "accuracy",
    "timeshare",
    "reconfigurations",
    "cost_instance_minutes",
    "excess_time",
    "drain_time",
    "elasticity_metrics",
    "summarize",
]


@dataclass(frozen=True)
class ElasticityMetrics:
    accuracy_u: float
    accuracy_o: float
    timeshare_u: float
    timeshare_o: float
    excess_time: float
    reconfigurations: int
    cost: float  # instance-minutes
    duration: float  # T, seconds

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


def _check_series(times: Sequence[float], *series: Sequence[float]) -> None:
    n = len(times)
    if n == 0:
        raise ValueError("empty time series: need at least one sample")
    for s in series:
        if len(s) != n:
            raise ValueError(f"series lengths differ: {len(times)} time stamps, {len(s)} values")
    for i in range(1, n):
        if times[i] <= times[i - 1]:
            raise ValueError(f"time stamps must increase strictly: t[{i - 1}]={times[i - 1]} >= t[{i}]={times[i]}")


def step_durations(times: Sequence[float], end: Optional[float] = None) -> List[float]:
    """How long each sample holds: t[i+1] - t[i], and `end - t[-1]` for the last one.

    Without `end`, the last sample holds for the median step (one sample = one period), so that a
    regular series of k samples spans k periods.
    """
    _check_series(times)
    d = [times[i + 1] - times[i] for i in range(len(times) - 1)]
    if end is None:
        last = sorted(d)[len(d) // 2] if d else 1.0
    else:
        last = end - times[-1]
        if last <= 0:
            raise ValueError(f"end ({end}) must be after the last time stamp ({times[-1]})")
    d.append(last)
    return d


def accuracy(times: Sequence[float], demand: Sequence[float], supply: Sequence[float],
             end: Optional[float] = None) -> "tuple[float, float]":
    """(accuracy_U, accuracy_O): under- and over-provisioned areas divided by T."""
    _check_series(times, demand, supply)
    dts = step_durations(times, end)
    total = sum(dts)
    under = sum(max(d - s, 0.0) * dt for d, s, dt in zip(demand, supply, dts))
    over = sum(max(s - d, 0.0) * dt for d, s, dt in zip(demand, supply, dts))
    return under / total, over / total


def timeshare(times: Sequence[float], demand: Sequence[float], supply: Sequence[float],
              end: Optional[float] = None) -> "tuple[float, float]":
    """(timeshare_U, timeshare_O): fractions of T spent under- / over-provisioned."""
    _check_series(times, demand, supply)
    dts = step_durations(times, end)
    total = sum(dts)
    under = sum(dt for d, s, dt in zip(demand, supply, dts) if d > s)
    over = sum(dt for d, s, dt in zip(demand, supply, dts) if s > d)
    return under / total, over / total


def reconfigurations(supply: Sequence[float]) -> int:
    """Number of times the supply changes value (the initial deployment is not counted)."""
    return sum(1 for a, b in zip(supply, supply[1:]) if a != b)


def cost_instance_minutes(times: Sequence[float], supply: Sequence[float], end: Optional[float] = None) -> float:
    _check_series(times, supply)
    return sum(s * dt for s, dt in zip(supply, step_durations(times, end))) / 60.0


def excess_time(actual_end: float, ideal_end: float, duration: float) -> float:
    """(P_t - I_t) / T; never negative (finishing "early" is not possible for a real run)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, found {duration}")
    return max(0.0, actual_end - ideal_end) / duration


def drain_time(backlog: float, service_rate: float) -> float:
    """Seconds to process `backlog` records at `service_rate` records/s once the input stopped."""
    if backlog <= 0:
        return 0.0
    if service_rate <= 0:
        return float("inf")
    return backlog / service_rate


def elasticity_metrics(times: Sequence[float], demand: Sequence[float], supply: Sequence[float],
                       end: Optional[float] = None, actual_end: Optional[float] = None,
                       ideal_end: Optional[float] = None) -> ElasticityMetrics:
    """All metrics at once. `actual_end`/`ideal_end` default to the end of the series (excess 0)."""
    dts = step_durations(times, end)
    t_end = times[-1] + dts[-1]
    total = t_end - times[0]
    acc_u, acc_o = accuracy(times, demand, supply, t_end)
    ts_u, ts_o = timeshare(times, demand, supply, t_end)
    ex = excess_time(t_end if actual_end is None else actual_end,
                     t_end if ideal_end is None else ideal_end, total)
    return ElasticityMetrics(
        accuracy_u=acc_u,
        accuracy_o=acc_o,
        timeshare_u=ts_u,
        timeshare_o=ts_o,
        excess_time=ex,
        reconfigurations=reconfigurations(supply),
        cost=cost_instance_minutes(times, supply, t_end),
        duration=total,
    )


def summarize(runs: Sequence[ElasticityMetrics]) -> Dict[str, "tuple[float, float]"]:
    """Mean and sample standard deviation of every metric over several runs (seeds)."""
    if not runs:
        raise ValueError("no runs to summarize")
    out: Dict[str, "tuple[float, float]"] = {}
    for key in runs[0].as_dict():
        vals = [float(r.as_dict()[key]) for r in runs]
        mean = sum(vals) / len(vals)
        var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
        out[key] = (mean, var ** 0.5)
    return out
