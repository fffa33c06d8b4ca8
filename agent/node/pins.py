"""The `fogctl scale` pins of one node: while an operator is pinned, its instances here make no
automatic scaling decision (docs/fogctl.md, "scale").

Rules of this file: no I/O, no clock, no reference to the daemon. The pins are given as read from
the state directory and the wall clock as an argument; what to tell which worker comes back as a
list, and the daemon sends the control lines, says which were delivered (`delivered`) and keeps
the pins in its state directory when `changed` says so.

A pin is `{"pipeline": name or None (every pipeline), "operator": name, "until": wall time or None
(until released)}`, keyed by "<pipeline>/<operator>"; a worker is told `set pinned=<flag>` when the
flag its process was last sent differs from what the pins say now, and only once it is active (a
starting worker reads no control line yet).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

Pin = Dict[str, Any]
# (instance, pipeline, operator, active) of each local worker
WorkerRow = Tuple[str, str, str, bool]


class Pins:
    def __init__(self, pins: Optional[Dict[str, Pin]] = None) -> None:
        self.pins: Dict[str, Pin] = dict(pins or {})
        self._sent: Dict[str, bool] = {}  # instance -> the pinned flag its worker was sent

    def __bool__(self) -> bool:
        return bool(self.pins)

    def pin(self, now: float, pipeline: Optional[str], operator: str, seconds: Optional[float]) -> str:
        """Pin `operator` (of `pipeline`, or of every pipeline) for `seconds` from `now` (None: until
        released); returns its key."""
        key = f"{pipeline or ''}/{operator}"
        until = None if seconds is None else round(now + seconds, 3)
        self.pins[key] = {"pipeline": pipeline, "operator": operator, "until": until}
        return key

    def release(self, pipeline: Optional[str], operator: str) -> str:
        """Release every pin of `operator` (of that pipeline, when one is named); returns the key."""
        for k, p in list(self.pins.items()):
            if p["operator"] == operator and pipeline in (None, p["pipeline"]):
                del self.pins[k]
        return f"{pipeline or ''}/{operator}"

    def until(self, key: str) -> Optional[float]:
        return self.pins.get(key, {}).get("until")

    def pin_of(self, pipeline: str, operator: str) -> Optional[Pin]:
        return next((p for p in self.pins.values() if p["operator"] == operator
                     and p["pipeline"] in (None, pipeline)), None)

    def expire(self, now: float) -> List[str]:
        """Drop the pins whose time is over at `now`; their keys (the pins changed if any)."""
        expired = [k for k, p in self.pins.items() if p["until"] is not None and p["until"] <= now]
        for k in expired:
            del self.pins[k]
        return expired

    def apply(self, workers: Iterable[WorkerRow]) -> Tuple[List[str], List[Tuple[str, bool]]]:
        """(the pinned local instances, sorted; the (instance, flag) control lines to send now)."""
        pinned: List[str] = []
        send: List[Tuple[str, bool]] = []
        for inst, pipeline, operator, active in workers:
            want = self.pin_of(pipeline, operator) is not None
            if want:
                pinned.append(inst)
            if self._sent.get(inst, False) != want and active:
                send.append((inst, want))
        return sorted(pinned), send

    def delivered(self, instance: str, flag: bool) -> None:
        """The worker of `instance` was sent `set pinned=flag`."""
        self._sent[instance] = flag

    def flagged(self, instance: str) -> bool:
        """Whether the worker of `instance` was last told it is pinned (the state says so)."""
        return self._sent.get(instance, False)

    def forget(self, instance: str) -> None:
        """Its worker exited: a new process starts unpinned."""
        self._sent.pop(instance, None)

    def listed(self) -> List[Pin]:
        """The pins as the node's state lists them."""
        return sorted(self.pins.values(), key=lambda p: (p["pipeline"] or "", p["operator"]))


__all__ = ["Pin", "Pins", "WorkerRow"]
