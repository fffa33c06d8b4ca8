"""A synthetic taxi trace (records/s per second) and the emulated latency matrix of the policy study.

Why synthetic: the NYC taxi data set is not available here (docs/design.md section 6). Gesscale replays
the first two days of May 2013 (a Wednesday and a Thursday) with SpeedFactor = 10 (10 s of
real-world events per second), three records per ride. We rebuild that shape from a seed:

  rate(t) = peak * diurnal(hour of the real-world clock) * slow noise(t) * fast noise(t) * bursts

- diurnal: the well-known weekday profile of NYC yellow-cab pickups per hour (night low at 5 am
  at ~17% of the 7 pm peak, morning plateau, evening peak), linearly interpolated;
- slow noise: a log-AR(1) process with a 5-minute (experiment time) correlation, sigma 0.10;
- fast noise: independent per-second jitter, sigma 0.03;
- bursts: Poisson arrivals (about 4 per day) of +20..+50% lasting 2..6 minutes (events, rain);
- day level (`day_sigma` > 0): each real-world day's traffic scaled by exp(N(0, day_sigma)), drawn
  from its own generator so that day_sigma = 0 gives the same trace as before. The daily pattern
  repeats for any number of days; the noise, bursts and day levels do not, which is what a
  seasonal forecast learned from earlier days must live with (docs/measurement.md).

Everything is drawn from `random.Random(seed)`: one seed = one trace, repeatable.

The latency matrix: ten fog nodes at fixed positions; RTT = distance scaled into 0-300 ms, as in
Gesscale's tc-emulated testbed. It is the same for every seed (the platform does not change).
"""

from __future__ import annotations

import math
import random
from typing import Dict, List

__all__ = ["DIURNAL", "DAY_SECONDS", "taxi_trace", "smooth_trace", "fog_testbed_matrix", "NODES"]

# one real-world day of the trace at the default speed factor 10, in trace seconds
DAY_SECONDS = 8640

# relative pickups per hour of day (weekday, NYC yellow cabs), 0h..23h
DIURNAL = (0.62, 0.45, 0.33, 0.24, 0.18, 0.17, 0.33, 0.55, 0.68, 0.70, 0.66, 0.68,
           0.72, 0.71, 0.74, 0.72, 0.62, 0.76, 0.93, 1.00, 0.93, 0.91, 0.90, 0.78)


def _diurnal(hour: float) -> float:
    h = hour % 24.0
    i = int(h)
    f = h - i
    return DIURNAL[i] * (1 - f) + DIURNAL[(i + 1) % 24] * f


def _day_levels(seed: int, days: float, start_hour: float, day_sigma: float) -> List[float]:
    """Each real-world day's traffic level, exp(N(0, day_sigma)) with mean 1, from its own generator."""
    day_rnd = random.Random(seed * 7919 + 101)
    return [math.exp(day_rnd.gauss(0.0, day_sigma) - day_sigma * day_sigma / 2) if day_sigma > 0 else 1.0
            for _ in range(int(math.ceil(days + start_hour / 24.0)) + 1)]


def smooth_trace(seed: int, days: float = 2.0, speed_factor: float = 10.0, peak: float = 2400.0,
                 start_hour: float = 0.0, day_sigma: float = 0.0) -> List[float]:
    """The predictable part of `taxi_trace` with the same arguments: peak x day level x diurnal, per
    second, without the slow noise, the jitter and the bursts (their mean factor is 1 but for the
    bursts). It is the best a forecast of the day's shape and level can know (the perfect-forecast
    bound of lab/foglab/sim/policies_forecast_bound.py)."""
    day_level = _day_levels(seed, days, start_hour, day_sigma)
    out: List[float] = []
    for s in range(int(days * 86400 / speed_factor)):
        hour = start_hour + s * speed_factor / 3600.0
        out.append(peak * day_level[int(hour // 24.0)] * _diurnal(hour))
    return out


def taxi_trace(seed: int, days: float = 2.0, speed_factor: float = 10.0, peak: float = 2400.0,
               start_hour: float = 0.0, day_sigma: float = 0.0) -> List[float]:
    """Records/s for each second of the experiment (days * 86400 / speed_factor samples)."""
    rnd = random.Random(seed)
    day_level = _day_levels(seed, days, start_hour, day_sigma)
    n = int(days * 86400 / speed_factor)
    tau, sigma = 300.0, 0.10
    phi = math.exp(-1.0 / tau)
    innov = sigma * math.sqrt(1 - phi * phi)
    x = rnd.gauss(0.0, sigma)
    bursts: List[List[float]] = []  # [start, end, gain]
    t = 0.0
    per_day_bursts = 4.0
    rate_per_s = per_day_bursts / (86400 / speed_factor)
    while True:
        t += rnd.expovariate(rate_per_s)
        if t >= n:
            break
        bursts.append([t, t + rnd.uniform(120, 360), rnd.uniform(0.2, 0.5)])
    out: List[float] = []
    bi = 0
    for s in range(n):
        x = phi * x + rnd.gauss(0.0, innov)
        hour = start_hour + s * speed_factor / 3600.0
        v = peak * day_level[int(hour // 24.0)] * _diurnal(hour) * math.exp(x - sigma * sigma / 2) * (1.0 + rnd.gauss(0.0, 0.03))
        while bi < len(bursts) and bursts[bi][1] < s:
            bi += 1
        for b in bursts[bi:bi + 3]:
            if b[0] <= s < b[1]:
                v *= 1.0 + b[2]
        out.append(max(0.0, v))
    return out


NODES = tuple(f"pi{i}" for i in range(1, 11))
_POS = ((0.0, 0.0), (0.1, 0.05), (0.15, -0.1), (0.35, 0.2), (-0.3, 0.25), (0.5, -0.4),
        (-0.55, -0.3), (0.7, 0.5), (-0.8, 0.4), (0.9, -0.7))


def fog_testbed_matrix(max_ms: float = 300.0) -> Dict[str, Dict[str, float]]:
    """Symmetric RTT matrix (ms) over NODES, distances scaled so the largest RTT is `max_ms`."""
    dist = {(a, b): math.dist(_POS[i], _POS[j]) for i, a in enumerate(NODES) for j, b in enumerate(NODES)}
    far = max(dist.values())
    return {a: {b: round(max_ms * dist[(a, b)] / far, 1) for b in NODES if b != a} for a in NODES}
