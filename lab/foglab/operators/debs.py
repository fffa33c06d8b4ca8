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

`TopRoutes` runs with one key, so on one instance: nothing to spread. The same query as two keyed
stages, so that the heavy part scales (docs/spill.md, "Query 1 in two stages"):

- `RouteCounts` (`route_counts`), keyed by route (`in_zone` sets `key = "route"`): per route and
  window the trips and the freshest drop-off, emitted when its watermark closes the window as
  `{"route", "start", "end", "trips", "last"}`; it forwards the trips. Any scaling policy: its key
  groups move with their state (docs/operators.md, "Key groups that move").
- `MergeTopRoutes` (`merge_top_routes`), keyed by a constant (one instance): per window the top `k`
  of the counts, ranked as the batch job ranks, emitted in `TopRoutes`' format. It forwards the
  trips and keeps the counts. It closes a window when the counts it got for it add up to the trips
  of that window it forwarded (every trip reaches it through stage 1 BEFORE the count that includes
  it, on the same FIFO channel) and its own watermark over the trips passed the window's end: a
  completeness check that does not depend on which stage-1 instances exist, so instances joining
  and leaving (and groups moving between them, counted once wherever they fire) cannot make it
  close a window early. A window whose counts never add up (a trip dropped as late by stage 1)
  is closed anyway `give_up_ms` later, with what it has, and counted (`incomplete_windows`): the
  comparison with the batch answer then lists it.
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, List, Optional, Tuple

from agent.operators.builtin import OperatorContext, Param
from agent.operators.keyed import EVENT_TIME_PARAMS, KeyedOperator, parse_event_time

__all__ = ["TopRoutes", "top_routes", "route_rank", "RouteCounts", "route_counts", "MergeTopRoutes",
           "merge_top_routes", "is_route_count", "parse_cell"]


def parse_cell(text: Any) -> Optional[Tuple[int, int]]:
    """A grid cell as `in_zone` writes it ("x.y") -> (x, y); None for anything else."""
    if not isinstance(text, str):
        return None
    x, _, y = text.partition(".")
    return (int(x), int(y)) if x.isdigit() and y.isdigit() else None


def route_rank(route: str, trips: int, last_ms: float) -> Tuple[Any, ...]:
    """The batch job's order: more trips, then a more recent last drop-off, then the start cell
    (x, y) and the end cell (x, y) as numbers, smaller first."""
    a, _, b = route.partition(">")
    (ax, ay), (bx, by) = parse_cell(a) or (0, 0), parse_cell(b) or (0, 0)
    return (-trips, -last_ms, ax, ay, bx, by)


def window_row(start: int, size: int, routes: Dict[str, List[float]], k: int) -> Dict[str, Any]:
    """One window's answer from its {route: [trips, last drop-off ms]}: the `k` best by `route_rank`."""
    best = heapq.nsmallest(k, routes.items(), key=lambda kv: route_rank(kv[0], kv[1][0], kv[1][1]))
    return {"start": start, "end": start + size, "trips": sum(int(v[0]) for v in routes.values()),
            "top": [[r.partition(">")[0], r.partition(">")[2], int(n), int(last)] for r, (n, last) in best]}


def _add_trips(wins: Dict[str, Dict[str, List[float]]], records: List[Any], size: int,
               time_of: Any) -> int:
    """Add trips to {window start: {route: [trips, last]}}; returns how many had no cells (skipped)."""
    skipped = 0
    for rec in records:
        a, b = rec.get("pickup_cell"), rec.get("dropoff_cell")
        if parse_cell(a) is None or parse_cell(b) is None:
            skipped += 1
            continue
        t = time_of(rec)
        assert t is not None  # the worker gives only records with an event time
        routes = wins.setdefault(str(int(t // size * size)), {})
        acc = routes.get(f"{a}>{b}")
        if acc is None:
            routes[f"{a}>{b}"] = [1, t]
        else:
            acc[0] += 1
            acc[1] = max(acc[1], t)
    return skipped


class _RouteWindows(KeyedOperator):
    """Per key and tumbling window of `size_ms`: {route: [trips, last drop-off]}; a window is
    handed to `emit` once the watermark passes its end."""

    params_schema = dict(EVENT_TIME_PARAMS, time_field=Param("string", required=True),
                         size_ms=Param("integer", required=True, min=1), forward=Param("boolean"))

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self.forwards = bool(ctx.params.get("forward", False))
        self.size = int(ctx.params["size_ms"])
        self.skipped = 0

    def emit(self, start: int, routes: Dict[str, List[float]]) -> List[Any]:
        raise NotImplementedError

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        wins: Dict[str, Dict[str, List[float]]] = state if state is not None else {}
        self.skipped += _add_trips(wins, records, self.size, self.event_time)
        return [], wins

    def notify_at(self, key: Any, state: Any) -> Optional[float]:
        return float(min(int(s) for s in state) + self.size) if state else None

    def on_notify(self, key: Any, state: Any, watermark: float) -> Tuple[List[Any], Any]:
        out: List[Any] = []
        for s in sorted(int(s) for s in state):
            if s + self.size > watermark:
                break
            out.extend(self.emit(s, state.pop(str(s))))
        return out, (state or None)

    def stats(self) -> Dict[str, Any]:
        return {"skipped": self.skipped} if self.skipped else {}


class TopRoutes(_RouteWindows):
    """Per key and tumbling window of `size_ms`: the `k` routes with most trips (see the module)."""

    params_schema = dict(_RouteWindows.params_schema, k=Param("integer", min=1, max=1000))

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self.k = int(ctx.params.get("k", 10))

    def emit(self, start: int, routes: Dict[str, List[float]]) -> List[Any]:
        return [window_row(start, self.size, routes, self.k)]


top_routes = TopRoutes


class RouteCounts(_RouteWindows):
    """Query 1, stage 1: per route and tumbling window of `size_ms`, the trips and the freshest
    drop-off, emitted when the watermark closes the window (see the module). Any key works (the
    state is per window and route under it); keyed by route, the work spreads over the instances."""

    def emit(self, start: int, routes: Dict[str, List[float]]) -> List[Any]:
        return [{"route": r, "start": start, "end": start + self.size, "trips": int(n), "last": int(last)}
                for r, (n, last) in sorted(routes.items())]


route_counts = RouteCounts


def is_route_count(rec: Any) -> bool:
    """Is `rec` one of `RouteCounts`' outputs (and not a trip: trips have no "end" nor "trips")?"""
    return isinstance(rec, dict) and "end" in rec and "trips" in rec and "route" in rec


class MergeTopRoutes(KeyedOperator):
    """Query 1, stage 2: the counts of `RouteCounts` merged per window into the top `k` (see the
    module). Run with one key (the operator before it keys by a field no record has).

    It has no event time for the runtime (no late drop, no timers: the counts of a window arrive
    after trips of later windows, and would be late by the trips' watermark); it keeps its own
    watermark over the trips' `time_field` in its state. State (JSON): {"max": newest trip ms,
    "closed": end of the last window emitted, "wins": {start: [trips forwarded, trips counted,
    {route: [trips, last]}]}}. Windows are emitted in order of their start."""

    params_schema = dict(TopRoutes.params_schema, give_up_ms=Param("number", min=0))

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self.forwards = bool(ctx.params.get("forward", False))
        self.size = int(ctx.params["size_ms"])
        self.k = int(ctx.params.get("k", 10))
        self.give_up = float(ctx.params.get("give_up_ms", self.lateness_ms))
        self.counts = {"late_trips": 0, "late_counts": 0, "incomplete_windows": 0, "skipped": 0}

    @property
    def uses_event_time(self) -> bool:
        return False  # its own watermark, in its state (see the class)

    def forward(self, record: Any) -> bool:
        return not is_route_count(record)

    def _trip_time(self, rec: Any) -> Optional[float]:
        if parse_cell(rec.get("pickup_cell")) is None or parse_cell(rec.get("dropoff_cell")) is None:
            return None  # stage 1 skips it too
        return parse_event_time(rec.get(self.time_field), self.time_unit)

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        st = state if state is not None else {"max": None, "closed": None, "wins": {}}
        wins = st["wins"]
        closed = st["closed"]
        for rec in records:
            if not isinstance(rec, dict):
                self.counts["skipped"] += 1
                continue
            if is_route_count(rec):
                s, n, last = rec.get("start"), rec.get("trips"), rec.get("last")
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in (s, n, last)):
                    self.counts["skipped"] += 1
                    continue
                if closed is not None and s + self.size <= closed:
                    self.counts["late_counts"] += 1
                    continue
                w = wins.setdefault(str(s), [0, 0, {}])
                w[1] += n
                acc = w[2].get(rec["route"])
                w[2][str(rec["route"])] = [n, last] if acc is None else [acc[0] + n, max(acc[1], last)]
                continue
            t = self._trip_time(rec)
            if t is None:
                continue  # no cells or no time: stage 1 never counts it either
            s = int(t // self.size * self.size)
            if closed is not None and s + self.size <= closed:
                self.counts["late_trips"] += 1
                continue
            wins.setdefault(str(s), [0, 0, {}])[0] += 1
            if st["max"] is None or t > st["max"]:
                st["max"] = t
        out = []
        if st["max"] is not None:
            wm = st["max"] - self.lateness_ms
            for s in sorted(int(s) for s in wins):
                forwarded, counted, routes = wins[str(s)]
                if s + self.size > wm:
                    break
                if counted != forwarded:
                    if s + self.size > wm - self.give_up:
                        break  # counts still on their way: wait (and hold the later windows)
                    self.counts["incomplete_windows"] += 1
                del wins[str(s)]
                st["closed"] = s + self.size
                out.append(window_row(s, self.size, routes, self.k))
        return out, st

    def stats(self) -> Dict[str, Any]:
        return {k: v for k, v in self.counts.items() if v}


merge_top_routes = MergeTopRoutes
