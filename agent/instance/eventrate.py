"""How often the scaling driver publishes its events, and the decision history it keeps for
`fogctl why` (docs/runtime.md, "Instance"; docs/operations.md).

Rules of this file: `EventRate` owns the rate limits' clocks and the history, and holds no
reference to the driver or the instance; it is given the time `now` per call, and the driver
builds and publishes the events. No I/O, no clock, no random.

A decision that acts is always published; a "nothing to do" one at most every
DECISION_EVENT_PERIOD (an instance decides every period: thousands of them would flood the
topic), and so is the retained history unless the decision acted. Lock events: at most
LOCK_EVENT_BURST per second (an instance makes at most 6 per round; a flood would mean a bug).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional

from agent import events

__all__ = ["EventRate", "DECISION_EVENT_PERIOD", "LOCK_EVENT_BURST"]

DECISION_EVENT_PERIOD = 5.0  # at most one "nothing to do" decision event per instance per 5 s
LOCK_EVENT_BURST = 20  # at most this many lock events per instance per second (6 per round)


class EventRate:
    def __init__(self) -> None:
        self.history: List[Any] = []  # last decision events (retained for `fogctl why`)
        self._last_none = -1e9  # the last "nothing to do" decision event
        self._last_history = -1e9  # the last retained history published
        self._locks: Deque[float] = deque()  # publish times of the last lock events

    def decision_due(self, now: float, acted: bool) -> bool:
        """Publish this decision's event? Always when it acted, else once per DECISION_EVENT_PERIOD."""
        if not acted and now - self._last_none < DECISION_EVENT_PERIOD:
            return False
        if not acted:
            self._last_none = now
        return True

    def remember(self, ev: Any, now: float, acted: bool) -> Optional[List[Any]]:
        """`ev` published: kept in the history; the history to publish (retained) when it is due."""
        self.history = events.remember(self.history, ev)
        if acted or now - self._last_history >= DECISION_EVENT_PERIOD:
            self._last_history = now
            return self.history
        return None

    def lock_allowed(self, now: float) -> bool:
        """May a lock event go out at `now` (fewer than LOCK_EVENT_BURST in the last second)?"""
        q = self._locks
        while q and now - q[0] > 1.0:
            q.popleft()
        if len(q) >= LOCK_EVENT_BURST:
            return False
        q.append(now)
        return True
