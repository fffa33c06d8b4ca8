"""The instance's clock: the monotonic time of the event being handled and the wall time derived
from it (sans-IO: both come with the events; nothing here reads a clock).

Why a part of its own: the instance and the parts that act between two of its events (the scaling
driver) read the same time; shared, it is set once per event, where the instance is handed it.
"""

from __future__ import annotations

__all__ = ["Clock"]


class Clock:
    """`now`: the time of the current event; `offset`: wall minus monotonic, from the last event
    that carried the wall time (`Started`, `Restarted`, `Tick`)."""

    __slots__ = ("now", "offset")

    def __init__(self) -> None:
        self.now = 0.0
        self.offset = 0.0

    def wall(self) -> float:
        return self.now + self.offset
