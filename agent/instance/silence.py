"""When an instance checks for messages that will never come, and the holes it watches in its
senders' numbering (docs/reliability.md).

Rules of this file: `Silence` owns the clock of the silence checks and the holes seen open, and
holds no reference to the instance; it is given per call the time `now` and the holes the
channels report. No I/O, no clock, no random.

Messages that will never come (lost by the broker, or taken by another connection with our client
id: a fenced copy after a partition) show up as a hole in a sender's numbering that stays open:
after GAP_TIMEOUT the instance becomes a new incarnation, and every predecessor replays what we
have not acked. The same check, every SILENCE_CHECK, looks for replay markers that do not come
(agent.instance.replays) and for links gone silent (agent.instance.outputs, the scaling driver,
the group moves).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

__all__ = ["Silence", "GAP_TIMEOUT", "SILENCE_CHECK"]

# A hole in a sender's numbering this old will not close by itself: the broker lost those
# messages, or another connection with our client id took them (a fenced copy after a partition).
GAP_TIMEOUT = 5.0
SILENCE_CHECK = 1.0  # seconds between two silence checks


class Silence:
    """When the next check is due, and per sender the hole seen open ((epoch, missing seq)) and since when."""

    def __init__(self) -> None:
        self._next = 0.0
        self._holes: Dict[str, Tuple[Tuple[int, int], float]] = {}

    def due(self, now: float) -> bool:
        return now >= self._next

    def checked(self, now: float) -> None:
        """A check at `now` (or the start): the next one is SILENCE_CHECK later."""
        self._next = now + SILENCE_CHECK

    def stuck(self, gaps: Dict[str, Any], now: float) -> List[str]:
        """The senders whose hole (`gaps`: sender -> (epoch, missing seq, ...), as the channels
        report them) has stayed the same for GAP_TIMEOUT, sorted; when there are any, every hole
        is forgotten (the new incarnation that follows resyncs every channel)."""
        holes = {s: (g[0], g[1]) for s, g in gaps.items()}
        self._holes = {s: (h, self._holes[s][1] if self._holes.get(s, (None,))[0] == h else now)
                       for s, h in holes.items()}
        stuck = sorted(s for s, (_, since) in self._holes.items() if now - since >= GAP_TIMEOUT)
        if stuck:
            self._holes = {}
        return stuck

    def forget(self, sender: str) -> None:
        self._holes.pop(sender, None)
