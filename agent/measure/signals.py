"""Per-period live signals of one operator instance: back pressure, rates, CPU, service time.

Why: the Gesscale policies (agent/policy/threshold.py, model.py, sized.py) and back-pressure root
detection (Gesscale Algorithm 1) decide from what an instance measured over its last period. The
worker owns the I/O and the clocks; this accumulator is sans-IO: every call brings the time (the
worker's monotonic clock) and the process CPU seconds (`time.process_time()`), so tests drive it
with any numbers. docs/measurement.md, "Live signals", says what each figure means.

- back-pressure ratio: the fraction of the period the instance could not take input because its
  successors gave no credit (the outbox at its high-water mark) or its sink spool was full. The
  worker calls `blocked(now, flag)` once per loop turn; the state only changes on events its loop
  handles, so the time between two calls belongs to the state seen at the first one.
- input rate: records/s that arrived in the inbox (the paper's l_t per second).
- processed rate: records/s that went through the operator (Gesscale's CT for this share).
- busy: seconds spent in the operator call plus the emulated service time, per record: the online
  service time that `LiveCapacity` (agent/measure/capacity.py) turns into records/s.
- cpu: process CPU seconds per wall second over the period (can exceed 1 with threads).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

__all__ = ["PeriodSignals", "Signals"]


@dataclass(frozen=True)
class Signals:
    """One period's figures (rates in records/s, ratios in [0, 1], seconds)."""

    period: float
    backpressure: float
    input_rate: float
    processed_rate: float
    cpu: Optional[float]
    busy: float  # busy seconds in the period (operator call + emulated service time)
    processed: int

    @property
    def busy_ratio(self) -> float:
        return min(1.0, self.busy / self.period) if self.period > 0 else 0.0

    def to_stats(self) -> Dict[str, Any]:
        d = asdict(self)
        out: Dict[str, Any] = {}
        for k, v in d.items():
            out[k] = round(v, 4) if isinstance(v, float) else v
        out["busy_ratio"] = round(self.busy_ratio, 4)
        return out


class PeriodSignals:
    """Accumulates one period; `take(now, cpu_seconds)` closes it and starts the next."""

    def __init__(self, now: float, cpu_seconds: Optional[float] = None) -> None:
        self._start = now
        self._cpu0 = cpu_seconds
        self._blocked_since: Optional[float] = None
        self._blocked = 0.0
        self._arrived = 0
        self._processed = 0
        self._busy = 0.0

    def blocked(self, now: float, is_blocked: bool) -> None:
        if is_blocked and self._blocked_since is None:
            self._blocked_since = now
        elif not is_blocked and self._blocked_since is not None:
            self._blocked += max(0.0, now - max(self._blocked_since, self._start))
            self._blocked_since = None

    def arrived(self, records: int) -> None:
        self._arrived += records

    def processed(self, records: int, busy_seconds: float) -> None:
        self._processed += records
        self._busy += max(0.0, busy_seconds)

    def take(self, now: float, cpu_seconds: Optional[float] = None) -> Signals:
        period = max(1e-9, now - self._start)
        blocked = self._blocked
        if self._blocked_since is not None:  # still blocked: the part in this period counts now
            blocked += max(0.0, now - max(self._blocked_since, self._start))
            self._blocked_since = now
        cpu = None
        if cpu_seconds is not None and self._cpu0 is not None:
            cpu = max(0.0, cpu_seconds - self._cpu0) / period
        sig = Signals(period=period, backpressure=min(1.0, blocked / period), input_rate=self._arrived / period,
                      processed_rate=self._processed / period, cpu=cpu, busy=self._busy, processed=self._processed)
        self._start = now
        self._cpu0 = cpu_seconds
        self._blocked = 0.0
        self._arrived = self._processed = 0
        self._busy = 0.0
        return sig
