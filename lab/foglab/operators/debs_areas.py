"""DEBS 2015 query 2 at the edge: the most profitable areas per event-time window, in three keyed
stages whose answer equals the batch job's (agent.analytics.debs.profitable_areas) window by window.

The batch definition, per tumbling window [s, e) of drop-off time (docs/spill.md):
- profit(c) = exact median of fare + tip over the trips that started in cell c and ended in
  [e - recent, e), left out: fare <= 0 or a negative tip;
- empty_taxis(c) = taxis with a trip ending in the window in c whose NEXT trip (the taxi's trips
  ordered by drop-off, then pickup) is absent or picks up at or after e;
- profitability = profit / empty_taxis; the top `k` by profitability, then profit, then the cell
  (x, y) as numbers; a cell without profit or without an empty taxi is not ranked.

The stages (each forwards the trips unchanged, with their ids, before its outputs):

- `EmptyTaxis` (`empty_taxis`), keyed by taxi (the operator before it sets key = "medallion"):
  per taxi its trips of the windows not decided yet. A window is decided when the next trip after
  its last one is known: once the watermark passed the drop-off of the first trip ending at or
  after e (no trip ending before it can come any more), or passed e + `max_trip_ms` (any trip still
  to come ends after that, so it picks up after e: trips last at most `max_trip_ms`; a longer one
  is counted, `long_trips`). The next trip may well be in a later window: that is why the decision
  waits for the watermark, not for the window's end. Output per taxi and window:
  `{"start", "end", "trips": n, "empty_taxis": [cells]}` (the cells where the taxi is empty in the
  window: one, the cell of its last drop-off, unless its trips overlap in time).
- `CellProfit` (`cell_profit`), keyed by pickup cell (`empty_taxis` sets key = "pickup_cell"): per
  cell and window the trips taken and the fare + tip values of those ending in the last `recent_ms`;
  when the watermark passes e: `{"cell", "start", "end", "trips": n, "profit": median or None}`.
  The taxis' outputs have no pickup cell: they pass through it, forwarded.
- `MergeTopAreas` (`merge_top_areas`), one instance (`cell_profit` keys by a field no record has):
  per window the trips it forwarded, the profits and the empty taxis per cell; it closes a window
  when the trips its two inputs say they reflect BOTH add up to the trips it forwarded and its own
  watermark over the trips passed e (the counting of foglab.operators.debs.MergeTopRoutes: whatever
  instances of the first two stages exist and wherever their key groups are, a window closes only
  once every trip of it is in a cell's row and in a taxi's decision). Output per window:
  `{"start", "end", "trips", "areas": [[cell, profit, empty_taxis, profitability], ...]}`.

Why it equals the batch answer: the median needs all values of a (window, cell) at one place, which
keying by pickup cell gives; empty_taxis counts DISTINCT taxis, and each taxi's trips are at one
place, which keying by taxi gives, so the merge only adds. A record the runtime would accept into a
window a stage already closed (possible only where a key group moved to an instance whose watermark
is behind) is refused and counted (`late_trips`): the merge then never sees that window add up and
closes it `give_up_ms` later as incomplete (counted), and the comparison lists it if it differs.
Ties the batch leaves open are not covered: two trips of one taxi with the same drop-off and pickup
times and different cells (Spark orders them arbitrarily; here by cell).
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

from agent.operators.builtin import OperatorContext, Param
from foglab.operators.debs import parse_cell
from agent.operators.keyed import EVENT_TIME_PARAMS, KeyedOperator, parse_event_time

__all__ = ["EmptyTaxis", "empty_taxis", "CellProfit", "cell_profit", "MergeTopAreas", "merge_top_areas",
           "trip_times", "profit_value", "median", "areas_row", "is_area_input", "DEFAULT_MAX_TRIP_MS",
           "DEFAULT_RECENT_MS"]

DEFAULT_MAX_TRIP_MS = 7_200_000  # 2 h: a longer trip is counted (`long_trips`): a decision may be wrong
DEFAULT_RECENT_MS = 900_000  # the challenge's "last 15 minutes" of the window


def trip_times(rec: Any, time_field: str, pickup_field: str, unit: str) -> Optional[Tuple[float, float]]:
    """(drop-off ms, pickup ms) of a trip every stage takes (both times readable, both cells from
    `in_zone`); None for anything else: the three stages skip and count the same records, as the
    batch job leaves out trips without both times."""
    if not isinstance(rec, dict) or parse_cell(rec.get("pickup_cell")) is None or parse_cell(rec.get("dropoff_cell")) is None:
        return None
    d = parse_event_time(rec.get(time_field), unit)
    p = parse_event_time(rec.get(pickup_field), unit)
    return None if d is None or p is None else (d, p)


def _number(v: Any) -> Optional[float]:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def profit_value(rec: Dict[str, Any]) -> Optional[float]:
    """fare + tip of a trip that enters the median (fare > 0, tip >= 0, as the batch job's filter)."""
    fare, tip = _number(rec.get("fare_amount")), _number(rec.get("tip_amount"))
    if fare is None or tip is None or not fare > 0 or tip < 0:
        return None
    return fare + tip


def median(values: List[float]) -> float:
    """Spark's `percentile(x, 0.5)`, bit for bit: the middle value, or for an even count
    lower + 0.5 * (upper - lower), its linear interpolation at position (n - 1) / 2 (Spark 4.3;
    0.5 * lower + 0.5 * upper, the same number on paper, differs in the last bit for 3% of pairs:
    tests/test_debs_edge.py compares with Spark)."""
    v = sorted(values)
    n = len(v)
    if n % 2:
        return v[n // 2]
    lo, hi = v[n // 2 - 1], v[n // 2]
    return lo + 0.5 * (hi - lo)


class _TripStage(KeyedOperator):
    """What the three stages share: tumbling windows of `size_ms` over the drop-off time
    (`time_field`), the pickup time's field, forwarding, and their counters."""

    params_schema = dict(EVENT_TIME_PARAMS, time_field=Param("string", required=True),
                         pickup_field=Param("string"), size_ms=Param("integer", required=True, min=1),
                         forward=Param("boolean"))
    counters: Tuple[str, ...] = ("skipped", "late_trips")

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        p = ctx.params
        self.forwards = bool(p.get("forward", False))
        self.size = int(p["size_ms"])
        self.pickup_field = str(p.get("pickup_field", "pickup_datetime"))
        self.counts = dict.fromkeys(self.counters, 0)

    def times(self, rec: Any) -> Optional[Tuple[float, float]]:
        return trip_times(rec, str(self.time_field), self.pickup_field, self.time_unit)

    def trips(self, records: List[Any]) -> Iterator[Tuple[Dict[str, Any], float, float]]:
        """(record, drop-off ms, pickup ms) of the records that are trips; the others counted."""
        for rec in records:
            times = self.times(rec)
            if times is None:
                self.counts["skipped"] += 1
            else:
                yield rec, times[0], times[1]

    def start_of(self, t: float) -> int:
        return int(t // self.size * self.size)

    def stats(self) -> Dict[str, Any]:
        return {k: v for k, v in self.counts.items() if v}


class EmptyTaxis(_TripStage):
    """Query 2, stage A, keyed by taxi: per taxi and window, once the taxi's next trip is known,
    the cells where it is empty (see the module). State (JSON): {"w": {start: [[drop-off ms,
    pickup ms, drop-off cell], ...]}, "done": [drop-off ms, pickup ms or None]}: trips ordered
    before "done" can no longer change a decision made (the pickup None: every drop-off before it)."""

    params_schema = dict(_TripStage.params_schema, max_trip_ms=Param("number", min=0))
    counters = ("skipped", "late_trips", "long_trips")

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self.max_trip = float(ctx.params.get("max_trip_ms", DEFAULT_MAX_TRIP_MS))

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        st = state if state is not None else {"w": {}, "done": None}
        done = st["done"]
        for rec, d, p in self.trips(records):
            if done is not None and (d < done[0] or (d == done[0] and done[1] is not None and p < done[1])):
                self.counts["late_trips"] += 1  # would change a decision already sent
                continue
            if d - p > self.max_trip:
                self.counts["long_trips"] += 1
            st["w"].setdefault(str(self.start_of(d)), []).append([d, p, rec["dropoff_cell"]])
        return [], (st if st["w"] or done is not None else None)

    @staticmethod
    def _first_from(state: Dict[str, Any], end: int) -> Optional[List[Any]]:
        """The taxi's first trip (drop-off, pickup, cell order) ending at or after `end`, if any."""
        later = [t for s, trips in state["w"].items() if int(s) >= end for t in trips]
        return min(later) if later else None

    def notify_at(self, key: Any, state: Any) -> Optional[float]:
        if not state or not state["w"]:
            return None
        end = min(int(s) for s in state["w"]) + self.size
        first = self._first_from(state, end)
        t = end + self.max_trip if first is None else min(first[0], end + self.max_trip)
        return math.nextafter(float(t), math.inf)  # the watermark must pass it (see on_notify)

    def on_notify(self, key: Any, state: Any, watermark: float) -> Tuple[List[Any], Any]:
        out: List[Any] = []
        wins = state["w"]
        for s in sorted(int(s) for s in wins):
            end = s + self.size
            first = self._first_from(state, end)
            known = first is not None and first[0] < watermark  # nothing ordered before it can come
            if not known and not watermark > end + self.max_trip:
                break  # and the later windows wait for this one
            trips = sorted(wins.pop(str(s)))
            empty = set()
            for i, (_, _, cell) in enumerate(trips):
                nxt = trips[i + 1] if i + 1 < len(trips) else first
                if nxt is None or nxt[1] >= end:
                    empty.add(cell)
            out.append({"start": s, "end": end, "trips": len(trips), "empty_taxis": sorted(empty)})
            state["done"] = [first[0], first[1]] if known else [watermark, None]  # type: ignore[index]
        return out, state


empty_taxis = EmptyTaxis


class CellProfit(_TripStage):
    """Query 2, stage B: per cell and window, the trips and the median of fare + tip of those that
    ended in the last `recent_ms` (see the module). Any key works (the state is per window and
    pickup cell under it); keyed by pickup cell, the cells spread over the instances. State (JSON):
    {"w": {start: {cell: [trips, [values]]}}, "closed": end of the last window emitted}."""

    params_schema = dict(_TripStage.params_schema, recent_ms=Param("integer", min=0))

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self.recent = int(ctx.params.get("recent_ms", DEFAULT_RECENT_MS))

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        st = state if state is not None else {"w": {}, "closed": None}
        closed = st["closed"]
        for rec, d, _ in self.trips(records):
            s = self.start_of(d)
            if closed is not None and s + self.size <= closed:
                self.counts["late_trips"] += 1  # its window's row is out already
                continue
            acc = st["w"].setdefault(str(s), {}).setdefault(rec["pickup_cell"], [0, []])
            acc[0] += 1
            v = profit_value(rec)
            if v is not None and d >= s + self.size - self.recent:
                acc[1].append(v)
        return [], (st if st["w"] or closed is not None else None)

    def notify_at(self, key: Any, state: Any) -> Optional[float]:
        return float(min(int(s) for s in state["w"]) + self.size) if state and state["w"] else None

    def on_notify(self, key: Any, state: Any, watermark: float) -> Tuple[List[Any], Any]:
        out: List[Any] = []
        for s in sorted(int(s) for s in state["w"]):
            if s + self.size > watermark:
                break
            for cell, (n, values) in sorted(state["w"].pop(str(s)).items()):
                out.append({"cell": cell, "start": s, "end": s + self.size, "trips": n,
                            "profit": median(values) if values else None})
            state["closed"] = s + self.size
        return out, state


cell_profit = CellProfit


def is_area_input(rec: Any) -> bool:
    """Is `rec` an output of `CellProfit` or `EmptyTaxis` (what the merge consumes; not a trip)?"""
    return isinstance(rec, dict) and "trips" in rec and (("cell" in rec and "profit" in rec) or "empty_taxis" in rec)


def areas_row(start: int, size: int, trips: int, profits: Dict[str, float], empties: Dict[str, int],
              k: int) -> Dict[str, Any]:
    """One window's answer: the `k` cells with profit and empty taxis, ranked as the batch job ranks
    (profitability, then profit, higher first, then the cell (x, y) as numbers)."""
    ranked = [(profit / empties[c], profit, c) for c, profit in profits.items() if empties.get(c, 0) > 0]
    best = heapq.nsmallest(k, ranked, key=lambda r: (-r[0], -r[1], parse_cell(r[2])))
    return {"start": start, "end": start + size, "trips": trips,
            "areas": [[c, profit, empties[c], ratio] for ratio, profit, c in best]}


class MergeTopAreas(_TripStage):
    """Query 2, stage C: per window the cells' profits and the taxis' empty cells, joined and
    ranked once both add up to the trips it forwarded (see the module). Run with one key.

    Like MergeTopRoutes it has no event time for the runtime (its inputs' rows come long after the
    trips of their window) and keeps its own watermark over the trips. State (JSON): {"max": newest
    trip ms, "closed": end of the last window emitted, "wins": {start: [trips forwarded, trips in
    cell rows, trips in taxi rows, {cell: profit}, {cell: empty taxis}]}}. `give_up_ms` (default
    `lateness_ms` + `max_trip_ms`: a taxi's decision comes up to `max_trip_ms` after the window):
    how long past its end a window whose counts do not add up waits before it is emitted anyway."""

    params_schema = dict(_TripStage.params_schema, k=Param("integer", min=1, max=1000),
                         give_up_ms=Param("number", min=0), max_trip_ms=Param("number", min=0))
    counters = ("skipped", "late_trips", "late_counts", "incomplete_windows")

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        p = ctx.params
        self.k = int(p.get("k", 10))
        self.give_up = float(p.get("give_up_ms", self.lateness_ms + float(p.get("max_trip_ms", DEFAULT_MAX_TRIP_MS))))

    @property
    def uses_event_time(self) -> bool:
        return False  # its own watermark, in its state (see the class)

    def forward(self, record: Any) -> bool:
        return not is_area_input(record)

    def _row(self, rec: Dict[str, Any]) -> Optional[Tuple[int, int]]:
        """(window start, trips) of a well-formed input row; None: skipped."""
        s, n = rec.get("start"), rec.get("trips")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (s, n)) or s % self.size or n < 0:
            return None
        if "empty_taxis" in rec:
            cells = rec["empty_taxis"]
            ok = isinstance(cells, list) and all(parse_cell(c) is not None for c in cells)
        else:
            ok = parse_cell(rec["cell"]) is not None and (rec["profit"] is None or _number(rec["profit"]) is not None)
        return (s, n) if ok else None

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        st = state if state is not None else {"max": None, "closed": None, "wins": {}}
        wins, closed = st["wins"], st["closed"]
        for rec in records:
            if is_area_input(rec):
                row = self._row(rec)
                if row is None:
                    self.counts["skipped"] += 1
                    continue
                s, n = row
                if closed is not None and s + self.size <= closed:
                    self.counts["late_counts"] += 1
                    continue
                w = wins.setdefault(str(s), [0, 0, 0, {}, {}])
                if "empty_taxis" in rec:
                    w[2] += n
                    for c in set(rec["empty_taxis"]):
                        w[4][c] = w[4].get(c, 0) + 1
                else:
                    w[1] += n
                    if rec["profit"] is not None:
                        w[3][rec["cell"]] = float(rec["profit"])
                continue
            times = self.times(rec)
            if times is None:
                continue  # not a trip (query 1's windows pass through here), or one no stage takes
            s = self.start_of(times[0])
            if closed is not None and s + self.size <= closed:
                self.counts["late_trips"] += 1
                continue
            wins.setdefault(str(s), [0, 0, 0, {}, {}])[0] += 1
            if st["max"] is None or times[0] > st["max"]:
                st["max"] = times[0]
        out = []
        if st["max"] is not None:
            wm = st["max"] - self.lateness_ms
            for s in sorted(int(s) for s in wins):
                forwarded, by_cells, by_taxis, profits, empties = wins[str(s)]
                if s + self.size > wm:
                    break
                if not by_cells == by_taxis == forwarded:
                    if s + self.size > wm - self.give_up:
                        break  # rows still on their way: wait (and hold the later windows)
                    self.counts["incomplete_windows"] += 1
                del wins[str(s)]
                st["closed"] = s + self.size
                out.append(areas_row(s, self.size, forwarded, profits, empties, self.k))
        return out, st


merge_top_areas = MergeTopAreas
