"""When an instance writes its state and when it sends a heartbeat (docs/runtime.md, "Instance").

Rules of this file: `Cadence` owns the two clocks and whether the protocol state changed since the
last write, and holds no reference to the instance; it is given the heartbeat period at
construction and the time `now` per call. No I/O, no clock, no random.

The state (epoch, channel positions, the scaling driver's tables) is written at most every
STATE_PERIOD (a rename costs ~5 ms on a Pi-class disk) unless the protocol state changed or the
caller forces it (write-ahead: a `Persist` before the publishes it protects).
"""

from __future__ import annotations

__all__ = ["Cadence", "STATE_PERIOD"]

STATE_PERIOD = 1.0  # persist the channel snapshot at most this often (a rename costs ~5 ms here)


class Cadence:
    def __init__(self, heartbeat_period: float) -> None:
        self._heartbeat_period = heartbeat_period
        self.dirty = True  # the protocol state changed since the last write
        self._last_write = -1e9
        self._last_beat = 0.0

    def changed(self) -> None:
        self.dirty = True

    def write_due(self, now: float, force: bool) -> bool:
        """Write the state now? Forced, changed, or STATE_PERIOD since the last write."""
        return force or self.dirty or now - self._last_write >= STATE_PERIOD

    def written(self, now: float) -> None:
        self.dirty = False
        self._last_write = now

    def beat_due(self, now: float) -> bool:
        return now - self._last_beat >= self._heartbeat_period

    def beat(self, now: float) -> None:
        self._last_beat = now

    def next_beat(self) -> float:
        return self._last_beat + self._heartbeat_period
