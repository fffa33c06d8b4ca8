"""Capacity C of one operator instance on this node: calibration, online estimate, stored results.

Why both: the thesis (section 4.3.1) measures the capacity once, "by increasing the input rate
until the output rate experienced is lower" and warns that it changes with the platform and its
conditions (a hot Pi throttles). So `fog-agent calibrate` measures it once per (node, operator),
and every running instance keeps an online estimate from its measured service time (busy seconds
per record); the policy uses the calibrated value corrected by the ratio of the two.

Parts:
- `Calibrator`: the sans-IO search. It proposes input rates (x `growth` each step from
  `start_rate`), is told how many records were offered and processed in the window, and stops at
  the first rate where the output lags (backlog > max(`min_lag`, `tolerance` * offered)). The
  capacity is the throughput measured at that saturated step (output rate while the input exceeds
  what the instance sustains: the thesis's "at that point, this throughput becomes the capacity").
- `drive_rate`: offers records at a paced rate to a `process(batch)` callable in-process and
  reports (offered, processed, elapsed); clock and sleep are injected.
- `OperatorUnderTest`: the pipeline's operator function plus the worker's service-time emulation
  (the instance is busy `service_time_ms` per record, exactly as agent.instance.worker does it).
- `ServiceTimeEstimator`: EWMA of busy seconds per record -> online records/s.
- `corrected_capacity`: calibrated * (service time at calibration / service time now), clamped.
- `CapacityStore`: results per (node, operator) in `<state_dir>/capacity.json` (atomic writes).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from agent.files import write_atomic

__all__ = [
    "CalibrationStep",
    "CalibrationResult",
    "Calibrator",
    "drive_rate",
    "calibrate",
    "OperatorUnderTest",
    "ServiceTimeEstimator",
    "corrected_capacity",
    "LiveCapacity",
    "CapacityRecord",
    "CapacityStore",
    "capacity_for",
]


@dataclass(frozen=True)
class CalibrationStep:
    rate: float
    offered: int
    processed: int
    elapsed: float
    lagging: bool

    @property
    def throughput(self) -> float:
        return self.processed / self.elapsed if self.elapsed > 0 else 0.0


@dataclass(frozen=True)
class CalibrationResult:
    capacity: float  # records/s one instance sustains
    last_sustained_rate: float
    steps: Sequence[CalibrationStep]
    saturated: bool  # False: max_rate was reached without lag (capacity is a lower bound)


class Calibrator:
    """Raise the input rate until the output lags; sans-IO (see module doc)."""

    def __init__(self, start_rate: float = 50.0, growth: float = 1.5, max_rate: float = 1e6,
                 tolerance: float = 0.05, min_lag: int = 3, confirm: int = 2) -> None:
        if not start_rate > 0 or not growth > 1:
            raise ValueError(f"need start_rate > 0 and growth > 1, found {start_rate}, {growth}")
        self.rate = start_rate
        self.growth = growth
        self.max_rate = max_rate
        self.tolerance = tolerance
        self.min_lag = min_lag
        self.confirm = confirm  # saturated steps to average (the first one may include a ramp-up)
        self.steps: List[CalibrationStep] = []
        self._saturated: List[CalibrationStep] = []
        self.done = False

    def next_rate(self) -> Optional[float]:
        return None if self.done else self.rate

    def lagging(self, offered: int, processed: int) -> bool:
        return offered - processed > max(self.min_lag, self.tolerance * offered)

    def report(self, offered: int, processed: int, elapsed: float) -> CalibrationStep:
        if self.done:
            raise RuntimeError("calibration already finished")
        step = CalibrationStep(self.rate, offered, processed, elapsed, self.lagging(offered, processed))
        self.steps.append(step)
        if step.lagging:
            self._saturated.append(step)
            if len(self._saturated) >= self.confirm:
                self.done = True
            # stay at (or just above) the saturating rate to confirm the throughput
        else:
            if self._saturated:  # lag did not persist: it was noise, keep climbing
                self._saturated.clear()
            nxt = self.rate * self.growth
            if nxt > self.max_rate:
                self.done = True
            self.rate = min(nxt, self.max_rate)
        return step

    def result(self) -> CalibrationResult:
        ok = [s.rate for s in self.steps if not s.lagging]
        last_ok = max(ok) if ok else 0.0
        if self._saturated:
            tp = sorted(s.throughput for s in self._saturated)
            cap = tp[len(tp) // 2] if len(tp) % 2 else (tp[len(tp) // 2 - 1] + tp[len(tp) // 2]) / 2
            return CalibrationResult(cap, last_ok, tuple(self.steps), True)
        return CalibrationResult(last_ok, last_ok, tuple(self.steps), False)


def drive_rate(process: Callable[[List[Any]], None], make_record: Callable[[int], Any], rate: float,
               window: float, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], None] = time.sleep, batch_max: int = 100,
               busy_until: Callable[[], float] = lambda: 0.0) -> "tuple[int, int, float]":
    """Offer records at `rate`/s for `window` s; returns (offered, processed, elapsed).

    Record i is due at t0 + i/rate. `busy_until()` (clock time) tells when the operator is free
    again (the emulated service time); nothing is processed before it.
    """
    t0 = clock()
    total = max(1, int(rate * window))
    done = 0
    while True:
        now = clock()
        el = now - t0
        if el >= window:
            break
        due = min(total, int(el * rate) + 1)
        free_at = busy_until()
        if done < due and now >= free_at:
            k = min(batch_max, due - done)
            process([make_record(done + j) for j in range(k)])
            done += k
            continue
        wake = t0 + done / rate if done >= due else free_at
        sleep(max(1e-6, min(wake, t0 + window) - now))  # > 0: float time must advance
    # the last batch is counted as processed: measure until the operator is really free again
    end = max(clock(), busy_until())
    if end > clock():
        sleep(end - clock())
    elapsed = max(clock(), end) - t0
    offered = min(total, int(elapsed * rate))
    return offered, done, elapsed


def calibrate(process: Callable[[List[Any]], None], make_record: Callable[[int], Any],
              calibrator: Optional[Calibrator] = None, window: float = 0.5,
              clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
              busy_until: Callable[[], float] = lambda: 0.0, batch_max: int = 20) -> CalibrationResult:
    cal = calibrator or Calibrator()
    while True:
        rate = cal.next_rate()
        if rate is None:
            return cal.result()
        offered, processed, elapsed = drive_rate(process, make_record, rate, window, clock, sleep,
                                                 batch_max, busy_until)
        cal.report(offered, processed, elapsed)


class OperatorUnderTest:
    """An operator function with the worker's service-time emulation (busy n * service_time)."""

    def __init__(self, fn: Callable[[List[Any]], Any], service_time_ms: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.fn = fn
        self.service_time = service_time_ms / 1000.0
        self.clock = clock
        self._busy_until = 0.0
        self.records = 0

    def process(self, batch: List[Any]) -> None:
        now = self.clock()
        self.fn(batch)
        self.records += len(batch)
        if self.service_time:
            self._busy_until = max(self._busy_until, now) + len(batch) * self.service_time

    def busy_until(self) -> float:
        return self._busy_until


class ServiceTimeEstimator:
    """Online per-record service time: EWMA of busy seconds / records over each period."""

    def __init__(self, smoothing: float = 0.3) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], found {smoothing}")
        self.smoothing = smoothing
        self.service_time: Optional[float] = None

    def update(self, busy_seconds: float, records: int) -> Optional[float]:
        if records <= 0 or busy_seconds <= 0:
            return self.service_time  # an idle period says nothing about the service time
        s = busy_seconds / records
        self.service_time = s if self.service_time is None else \
            self.smoothing * s + (1 - self.smoothing) * self.service_time
        return self.service_time

    @property
    def capacity(self) -> Optional[float]:
        return 1.0 / self.service_time if self.service_time else None


def corrected_capacity(calibrated: Optional[float], calibrated_service_time: Optional[float],
                       online_service_time: Optional[float], frequency_ratio: Optional[float] = None,
                       clamp: "tuple[float, float]" = (0.25, 2.0)) -> Optional[float]:
    """Calibrated capacity scaled by how much slower (or faster) the instance runs now.

    Without a calibration the online estimate is used alone; without an online estimate the
    calibrated value is scaled by the CPU-frequency ratio (a throttled Pi), if known.
    """
    if calibrated is None:
        return 1.0 / online_service_time if online_service_time else None
    if online_service_time and calibrated_service_time:
        factor = calibrated_service_time / online_service_time
    elif frequency_ratio:
        factor = frequency_ratio
    else:
        factor = 1.0
    lo, hi = clamp
    return calibrated * min(hi, max(lo, factor))


class LiveCapacity:
    """The capacity one running instance publishes and its policy uses, fed every period.

    `base` is what the instance started with (this node's calibration, else the pipeline's number);
    `reference_service_time` is the per-record busy time that capacity stands for (the calibration's
    measured service time, else 1/base: "C records/s" read as "busy 1/C s per record"). Each period
    the worker reports its busy seconds and records (agent/measure/signals.py); the estimate is
    `corrected_capacity(base, reference, online)`, so an instance that becomes k times slower (a hot
    Pi, a neighbour's load, an added emulated service time) reports base/k within a few periods of
    the EWMA, clamped to [x0.25, x2] of the base.
    """

    def __init__(self, base: float, reference_service_time: Optional[float] = None, smoothing: float = 0.5) -> None:
        if not is_finite_positive(base):
            raise ValueError(f"base capacity must be a finite number > 0, found {base}")
        self.base = float(base)
        self.reference = reference_service_time if is_finite_positive(reference_service_time) else 1.0 / self.base
        self.estimator = ServiceTimeEstimator(smoothing)

    def update(self, busy_seconds: float, records: int) -> float:
        self.estimator.update(busy_seconds, records)
        return self.value

    @property
    def value(self) -> float:
        cap = corrected_capacity(self.base, self.reference, self.estimator.service_time)
        return float(cap) if cap is not None else self.base

    @property
    def service_time(self) -> Optional[float]:
        return self.estimator.service_time


@dataclass(frozen=True)
class CapacityRecord:
    node: str
    operator: str
    capacity: float
    service_time_ms: Optional[float] = None  # per-record busy time measured at calibration
    measured_at: float = 0.0
    cpu_freq_mhz: Optional[float] = None
    method: str = "calibrate"
    steps: List[Dict[str, Any]] = field(default_factory=list)


class CapacityStore:
    """`<state_dir>/capacity.json`: {"<node>/<operator>": CapacityRecord as a dict}."""

    FILE = "capacity.json"

    def __init__(self, state_dir: "str | os.PathLike[str]") -> None:
        self.path = Path(state_dir) / self.FILE

    def load(self) -> Dict[str, CapacityRecord]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.path}: unreadable capacity file ({exc})") from None
        out = {}
        for key, rec in data.items():
            out[key] = CapacityRecord(**rec)
        return out

    def get(self, node: str, operator: str) -> Optional[CapacityRecord]:
        return self.load().get(f"{node}/{operator}")

    def put(self, rec: CapacityRecord) -> None:
        data = {k: asdict(v) for k, v in self.load().items()}
        data[f"{rec.node}/{rec.operator}"] = asdict(rec)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(data, indent=2, sort_keys=True))


def capacity_for(state_dir: "str | os.PathLike[str]", node: str, operator: str, configured: Optional[float],
                 online_service_time: Optional[float] = None, frequency_ratio: Optional[float] = None) -> float:
    """The capacity a policy should use now for (node, operator).

    `configured` is the pipeline's `capacity` (None when it says "calibrate"). A stored calibration
    wins over the configured number (it was measured on this node); either is corrected by the
    online service time (or the CPU-frequency ratio). Raises ValueError when nothing is known.
    """
    rec = None
    try:
        rec = CapacityStore(state_dir).get(node, operator)
    except ValueError:
        rec = None  # an unreadable file must not stop the instance: fall back to the configured value
    base = rec.capacity if rec is not None else configured
    cal_st = (rec.service_time_ms / 1000.0) if rec is not None and rec.service_time_ms else \
        (1.0 / configured if configured else None)
    cap = corrected_capacity(base, cal_st, online_service_time, frequency_ratio)
    if not is_finite_positive(cap):
        raise ValueError(f"no capacity for {node}/{operator}: run `fog-agent calibrate --operator {operator}` "
                         f"or set a number in [scaling] capacity")
    return float(cap)  # type: ignore[arg-type]


def is_finite_positive(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x) and x > 0
