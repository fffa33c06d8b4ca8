"""DEBS 2015 query 1 at the edge: the top routes per event-time window, as a keyed operator.

Why not the built-in `top_k` (agent.operators.keyed): the challenge breaks ties between routes
with as many trips by freshness (the route whose last drop-off is more recent first), and the
central batch job (agent.analytics.debs.top_routes) does the same, then orders by the start cell
and the end cell as numbers. `top_k` breaks ties by the value's text, so at a tie on the tenth
place the edge and the batch answers would differ although both are right. This operator keeps
per window and route [trips, last drop-off] and ranks exactly as the batch job does, so that the
two answers can be compared window by window (docs/spill.md).

Input: trips annotated by `in_zone` (`pickup_cell`, `dropoff_cell` as "x.y"); records without
them are skipped (counted). Event time: `time_field` (the drop-off time, as in the batch job).
Output per window [start, end), once the watermark reaches its end:
`{"start", "end", "trips", "top": [[start_cell, end_cell, trips, last_dropoff_ms], ...]}`.
Its key: whatever the operator before it sets; for the global answer of the challenge, one key
(a field no record has: every record goes to the group of None).

`forward = true` (param): the trips also go on, unchanged and with their ids (the demo's sink
records and spills them as before, and the batch job computes the same query over them).
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, List, Optional, Tuple

from agent.operators.builtin import OperatorContext, Param
from agent.operators.keyed import EVENT_TIME_PARAMS, KeyedOperator

__all__ = ["TopRoutes", "top_routes", "route_rank"]


def _cell(text: Any) -> Optional[Tuple[int, int]]:
    if not isinstance(text, str):
        return None
    x, _, y = text.partition(".")
    return (int(x), int(y)) if x.isdigit() and y.isdigit() else None


def route_rank(route: str, trips: int, last_ms: float) -> Tuple[Any, ...]:
    """The batch job's order: more trips, then a more recent last drop-off, then the start cell
    (x, y) and the end cell (x, y) as numbers, smaller first."""
    a, _, b = route.partition(">")
    (ax, ay), (bx, by) = _cell(a) or (0, 0), _cell(b) or (0, 0)
    return (-trips, -last_ms, ax, ay, bx, by)


class TopRoutes(KeyedOperator):
    """Per key and tumbling window of `size_ms`: the `k` routes with most trips (see the module)."""

    params_schema = dict(EVENT_TIME_PARAMS, time_field=Param("string", required=True),
                         size_ms=Param("integer", required=True, min=1), k=Param("integer", min=1, max=1000),
                         forward=Param("boolean"))

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self.forwards = bool(ctx.params.get("forward", False))
        self.size = int(ctx.params["size_ms"])
        self.k = int(ctx.params.get("k", 10))
        self.skipped = 0

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        wins: Dict[str, Dict[str, List[float]]] = state if state is not None else {}
        for rec in records:
            a, b = rec.get("pickup_cell"), rec.get("dropoff_cell")
            if _cell(a) is None or _cell(b) is None:
                self.skipped += 1
                continue
            t = self.event_time(rec)
            assert t is not None  # the worker gives only records with an event time
            routes = wins.setdefault(str(int(t // self.size * self.size)), {})
            acc = routes.get(f"{a}>{b}")
            if acc is None:
                routes[f"{a}>{b}"] = [1, t]
            else:
                acc[0] += 1
                acc[1] = max(acc[1], t)
        return [], wins

    def notify_at(self, key: Any, state: Any) -> Optional[float]:
        return float(min(int(s) for s in state) + self.size) if state else None

    def on_notify(self, key: Any, state: Any, watermark: float) -> Tuple[List[Any], Any]:
        out = []
        for s in sorted(int(s) for s in state):
            if s + self.size > watermark:
                break
            routes = state.pop(str(s))
            best = heapq.nsmallest(self.k, routes.items(), key=lambda kv: route_rank(kv[0], kv[1][0], kv[1][1]))
            out.append({"start": s, "end": s + self.size, "trips": sum(int(v[0]) for v in routes.values()),
                        "top": [[r.partition(">")[0], r.partition(">")[2], int(n), int(last)]
                                for r, (n, last) in best]})
        return out, (state or None)

    def stats(self) -> Dict[str, Any]:
        return {"skipped": self.skipped} if self.skipped else {}


top_routes = TopRoutes
