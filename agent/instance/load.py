"""What an instance measures of its own load for the scaling decision (docs/measurement.md,
"Live signals"; docs/scaling.md).

Rules of this file: `Load` owns the measures and holds no reference to the instance; it is given
the two clocks of the live signals at construction (the shell passes time.perf_counter and
time.process_time, the checker none: no time spent) and per call the time `now` and the counts. No
I/O, no global clock, no random.

Two measures, both read by the scaling driver once per decision period (agent.instance.driver,
`maybe_tick`): the records received per second (the paper's l_t, per second: `measure`), and
the live signals of the period (busy time, records processed, time held back by what comes
after us, CPU: `take_signals`), which feed the online capacity estimate (`capacity`) the Gesscale
policies compare with. The heartbeat publishes the last of each.
"""

from __future__ import annotations

from typing import Callable, Optional

from agent.measure.capacity import LiveCapacity
from agent.measure.signals import PeriodSignals, Signals

__all__ = ["Load", "no_clock"]


def no_clock() -> float:
    """The live signals' clocks when none is passed (the checker): no time spent."""
    return 0.0


class Load:
    """The records received in the current period, the last period's rate, the live signals of
    the current period and of the last one, and the online capacity they feed."""

    def __init__(self, perf: Callable[[], float] = no_clock, cpu: Callable[[], float] = no_clock) -> None:
        self._perf, self._cpu = perf, cpu
        self._records = 0  # received since the period began
        self._since = 0.0  # when the period began
        self.last = 0.0  # records/s of the last period
        self.signals = PeriodSignals(0.0, 0.0)
        self.last_signals: Optional[Signals] = None
        self.capacity = LiveCapacity(500.0)

    def begin(self, now: float) -> None:
        """The instance is running (started or restarted): its first period begins at `now`."""
        self._since = now
        self.signals = PeriodSignals(now, self._cpu())

    def set_capacity(self, base: float) -> None:
        """The capacity the online estimate starts from (the scaling parameters')."""
        self.capacity = LiveCapacity(base)

    def arrived(self, records: int) -> None:
        """A data batch of `records` taken in from a predecessor."""
        self._records += records
        self.signals.arrived(records)

    def produced(self, records: int) -> None:
        """A source's poll gave `records` (counted in the load, not in the live signals' arrivals)."""
        self._records += records

    def clock(self) -> float:
        """The interval clock the processing time is measured with."""
        return self._perf()

    def processed(self, records: int, since: float, modelled: float) -> None:
        """`records` processed, begun at `clock()` = `since`, plus `modelled` seconds of a set
        service time (the checker's and the benchmarks' slow operators)."""
        self.signals.processed(records, self._perf() - since + modelled)

    def blocked(self, now: float, is_blocked: bool) -> None:
        """Held back (or not) by what comes after us since the last call."""
        self.signals.blocked(now, is_blocked)

    def take_signals(self, now: float) -> Signals:
        """Close the live-signal period (the decision period) and feed the online capacity."""
        sig = self.signals.take(now, self._cpu())
        self.capacity.update(sig.busy, sig.processed)
        self.last_signals = sig
        return sig

    def measure(self, now: float) -> float:
        """Records received per second since the last call (the paper's l_t, per second)."""
        dt = max(1e-6, now - self._since)
        load = self._records / dt
        self._records = 0
        self._since = now
        self.last = load
        return load
