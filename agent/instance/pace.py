"""An instance's emulated service time: each record processed keeps it busy that long, as on a
slower node (the operator's `service_time_ms`, or a `set` control line; the checker's, the demo's
and the benchmarks' Pi-like operators; docs/measurement.md).

Rules of this file: `Pace` owns the service time and until when the instance is busy, and holds no
reference to the instance; it is given the time `now` per call. No I/O, no clock, no random.
"""

from __future__ import annotations

__all__ = ["Pace"]


class Pace:
    def __init__(self, service_time: float) -> None:
        self.service_time = service_time  # seconds per record, 0: none emulated
        self.busy_until = 0.0  # no data is processed before (the next Tick goes on)

    def busy(self, now: float) -> bool:
        return now < self.busy_until

    def cost(self, records: int) -> float:
        """The emulated seconds `records` take."""
        return records * self.service_time

    def processed(self, records: int, now: float) -> None:
        """`records` were processed at `now`: busy for their emulated time after what came before."""
        if self.service_time:
            self.busy_until = max(self.busy_until, now) + records * self.service_time
