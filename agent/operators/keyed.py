"""Keyed stateful operators: the API and the built-ins (docs/operators.md, "Keyed state").

A keyed operator keeps one state value per key. The worker (agent.instance.keyed_state) groups
each input batch by key and calls

    on_batch(key, records, state) -> (outputs, new_state)

once per key of the batch, in the order the records arrived; `state` is None for a key seen for
the first time, and a `new_state` of None forgets the key. After each call the worker asks
`notify_at(key, state)`: an event time (ms) at which `on_notify(key, state, watermark)` must be
called, once the watermark has reached it (Flink's event-time timers, bytewax's `notify_at`).

Event time and the watermark: `event_time(record)` says when a record happened, in ms (by
default: the `time_field` param, numbers in `time_unit` "s" or "ms", or "YYYY-MM-DD HH:MM:SS"
text, read as UTC). An instance's watermark is the largest event time it has taken minus
`lateness_ms` (bounded out-of-orderness): a record older than the watermark is LATE, counted
(`late_dropped`) and dropped, never given to the operator. So a window that fired (its end <=
watermark) never receives another record, and what a window holds does not depend on how the
records were batched. An operator without `time_field` has no event time and no watermark.

The state is kept per key group (agent.dataplane.keygroups) and persisted with the input position
it reflects (exactly-once updates after a crash); `snapshot(states) -> bytes` and
`restore(bytes) -> states` turn the states of one group (a dict key -> state) into bytes and back:
JSON by default, so a state made of dicts, lists, strings, numbers and None needs nothing more.

Rules for `on_batch` and `on_notify`: use only the arguments (no clock, no randomness, no I/O:
the replay after a crash must compute the same thing); return the new state (updating `state` in
place and returning it is fine); if a call raises, the records of that call are retried one by
one from the state the failed call left, so check a record before changing the state. An
output is any JSON value; the worker gives each one a record id of its own, the same in every run
(`<operator>#<key digest>`, and the key's output count), so the sink records it exactly once.
"""

from __future__ import annotations

import heapq
import json
import math
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Tuple

from agent.dataplane.envelope import Item
from agent.operators.builtin import Operator, OperatorContext, Param

__all__ = [
    "KeyedOperator",
    "EVENT_TIME_PARAMS",
    "parse_event_time",
    "keyed_count",
    "keyed_sum",
    "keyed_mean",
    "tumbling_window",
    "sliding_window",
    "top_k",
    "keyed_config_problems",
    "is_keyed",
]

# The params every keyed operator understands (merge them into your own params_schema).
EVENT_TIME_PARAMS: Dict[str, Param] = {
    "time_field": Param("string"),
    "time_unit": Param("string", choices=("s", "ms")),
    "lateness_ms": Param("number", min=0),
}


def parse_event_time(value: Any, unit: str = "s") -> Optional[float]:
    """An event time in ms from a record's field: a finite number in `unit`, or ISO 8601 text
    ("2013-01-01 00:02:00", "2013-01-01T00:02:00Z"; no zone means UTC). None if it is neither."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            return None
        return float(value) * (1000.0 if unit == "s" else 1.0)
    if isinstance(value, str) and 10 <= len(value) <= 40:
        text = value[:-1] + "+00:00" if value.endswith("Z") else value
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            return None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        return dt.timestamp() * 1000.0
    return None


class KeyedOperator(Operator):
    """Base class of keyed stateful operators (see the module docstring for the contract).

    Subclasses override `on_batch` and, for timers, `notify_at` and `on_notify`. The class itself
    is what a pipeline names (`function = "pkg.mod:MyOp"`): the worker builds it with `build(ctx)`,
    and check-config reads its `params_schema`."""

    keyed = True
    # True: every record applied also goes on to the successor unchanged, with its own id
    # (agent.instance.keyed_state); late records and records without an event time included.
    forwards = False
    params_schema: Dict[str, Param] = dict(EVENT_TIME_PARAMS)

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx
        p = ctx.params
        self.time_field: Optional[str] = p.get("time_field")
        self.time_unit: str = p.get("time_unit", "s")
        self.lateness_ms: float = float(p.get("lateness_ms", 0.0))

    @classmethod
    def build(cls, ctx: OperatorContext) -> "KeyedOperator":
        return cls(ctx)

    @property
    def uses_event_time(self) -> bool:
        return self.time_field is not None

    def event_time(self, record: Any) -> Optional[float]:
        """When `record` happened, in ms; None: it has no usable time (counted, dropped)."""
        if not isinstance(record, dict):
            return None
        return parse_event_time(record.get(self.time_field), self.time_unit)

    def on_late(self, record: Any) -> Optional[Any]:
        """A record older than the watermark, left out of every window (counted `late_dropped`):
        what to send on downstream in its place, under its own record id (a side output, saved
        with the outputs, so the sink gets it once), or None (the default: dropped, counted)."""
        return None

    def forward(self, record: Any) -> bool:
        """With `forwards`: does this applied record go on to the successor? (default: every one).
        A merge stage that consumes another keyed operator's outputs but passes the trips on says
        False for the outputs (foglab.operators.debs.MergeTopRoutes)."""
        return True

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        raise NotImplementedError

    def notify_at(self, key: Any, state: Any) -> Optional[float]:
        return None

    def on_notify(self, key: Any, state: Any, watermark: float) -> Tuple[List[Any], Any]:
        return [], state

    def snapshot(self, states: Dict[Any, Any]) -> bytes:
        """The states of one key group as bytes (JSON: a list of [key, state] pairs)."""
        return json.dumps([[k, s] for k, s in states.items()], separators=(",", ":")).encode()

    def restore(self, data: bytes) -> Dict[Any, Any]:
        return {k: s for k, s in json.loads(data)}

    def process(self, items: List[Item]) -> List[Item]:
        raise TypeError("a keyed operator is driven through agent.instance.keyed_state, not process()")


# ---- running aggregates per key ------------------------------------------------------------------


def _number(rec: Any, field: str) -> Optional[float]:
    v = rec.get(field) if isinstance(rec, dict) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


class _Running(KeyedOperator):
    """One output per record taken: the key's aggregate so far. Records whose `field` is not a
    number are skipped by sum and mean (counted in `skipped`)."""

    what = "count"
    params_schema = dict(EVENT_TIME_PARAMS)

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self.field = ctx.params.get("field")
        self.skipped = 0

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        n, total = state if state is not None else (0, 0.0)
        out = []
        for rec in records:
            if self.what != "count":
                v = _number(rec, self.field)
                if v is None:
                    self.skipped += 1
                    continue
                total += v
            n += 1
            row: Dict[str, Any] = {"key": key, "count": n}
            if self.what == "sum":
                row["sum"] = total
            elif self.what == "mean":
                row["mean"] = total / n
            out.append(row)
        return out, [n, total]

    def stats(self) -> Dict[str, Any]:
        return {"skipped": self.skipped} if self.what != "count" else {}


class KeyedCount(_Running):
    what = "count"


class KeyedSum(_Running):
    what = "sum"
    params_schema = dict(EVENT_TIME_PARAMS, field=Param("string", required=True))


class KeyedMean(_Running):
    what = "mean"
    params_schema = dict(EVENT_TIME_PARAMS, field=Param("string", required=True))


keyed_count = KeyedCount
keyed_sum = KeyedSum
keyed_mean = KeyedMean


# ---- event-time windows --------------------------------------------------------------------------

_AGGS = ("count", "sum", "mean", "min", "max")


class _Windows(KeyedOperator):
    """Event-time windows of `size_ms`, starting every `slide_ms` (= size: tumbling), per key.

    State: {"<start ms>": accumulator} for the windows still open. A window [start, start + size)
    is emitted once the watermark reaches its end, as one record
    `{"key", "start", "end", "count", <agg>}` (top_k: `"top": [[value, count], ...]`)."""

    params_schema = dict(EVENT_TIME_PARAMS, time_field=Param("string", required=True),
                         size_ms=Param("integer", required=True, min=1),
                         agg=Param("string", choices=_AGGS), field=Param("string"))

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        p = ctx.params
        self.size = int(p["size_ms"])
        self.slide = int(p.get("slide_ms", self.size))
        self.agg = p.get("agg", "count")
        self.field = p.get("field")
        self.skipped = 0

    @staticmethod
    def check_params(params: Dict[str, Any]) -> List[Tuple[str, str, Any]]:
        out = []
        agg = params.get("agg", "count")
        if agg != "count" and "field" not in params:
            out.append(("field", f'missing required key (expected a string: agg = "{agg}" needs the field it reads)', None))
        slide = params.get("slide_ms")
        if slide is not None and slide > params["size_ms"]:
            out.append(("slide_ms", f"expected an integer <= size_ms ({params['size_ms']})", slide))
        return out

    def starts(self, t: float) -> List[int]:
        """The starts of the windows an event at `t` ms belongs to, oldest first."""
        last = int(math.floor(t / self.slide)) * self.slide
        first = last - ((self.size - 1) // self.slide) * self.slide
        return [s for s in range(first, last + 1, self.slide) if s <= t < s + self.size]

    def value(self, rec: Any) -> Any:
        return _number(rec, self.field) if self.field else None

    def add(self, acc: Any, rec: Any, v: Any) -> Any:
        if acc is None:
            return [1, v, v, v]  # count, sum, min, max
        acc[0] += 1
        if v is not None:
            acc[1] += v
            acc[2] = min(acc[2], v)
            acc[3] = max(acc[3], v)
        return acc

    def result(self, acc: Any) -> Dict[str, Any]:
        row: Dict[str, Any] = {"count": acc[0]}
        if self.agg == "sum":
            row["sum"] = acc[1]
        elif self.agg == "mean":
            row["mean"] = acc[1] / acc[0]
        elif self.agg in ("min", "max"):
            row[self.agg] = acc[2] if self.agg == "min" else acc[3]
        return row

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        wins: Dict[str, Any] = state if state is not None else {}
        for rec in records:
            v = self.value(rec)
            if self.field and v is None and self.agg != "count":
                self.skipped += 1
                continue
            t = self.event_time(rec)
            assert t is not None  # the worker gives only records with an event time
            for s in self.starts(t):
                k = str(s)
                wins[k] = self.add(wins.get(k), rec, v)
        return [], wins

    def notify_at(self, key: Any, state: Any) -> Optional[float]:
        if not state:
            return None
        return float(min(int(s) for s in state) + self.size)

    def on_notify(self, key: Any, state: Any, watermark: float) -> Tuple[List[Any], Any]:
        out = []
        for s in sorted(int(s) for s in state):
            if s + self.size > watermark:
                break
            row: Dict[str, Any] = {"key": key, "start": s, "end": s + self.size}
            row.update(self.result(state.pop(str(s))))
            out.append(row)
        return out, (state or None)

    def stats(self) -> Dict[str, Any]:
        return {"skipped": self.skipped} if self.skipped else {}


class TumblingWindow(_Windows):
    pass


class SlidingWindow(_Windows):
    params_schema = dict(_Windows.params_schema, slide_ms=Param("integer", required=True, min=1))


class TopK(_Windows):
    """Per key and window, the `k` most frequent values of `by` (ties: the smaller value as text
    first): `{"key", "start", "end", "count", "top": [[value, count], ...]}`. Tumbling, or sliding
    with `slide_ms`. DEBS 2015 query 1 per area: key = "pickup_cell", by = "dropoff_cell"."""

    params_schema = dict(EVENT_TIME_PARAMS, time_field=Param("string", required=True),
                         size_ms=Param("integer", required=True, min=1), slide_ms=Param("integer", min=1),
                         by=Param("string", required=True), k=Param("integer", min=1, max=1000))

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self.by = ctx.params["by"]
        self.k = int(ctx.params.get("k", 10))

    @staticmethod
    def check_params(params: Dict[str, Any]) -> List[Tuple[str, str, Any]]:
        slide = params.get("slide_ms")
        if slide is not None and slide > params["size_ms"]:
            return [("slide_ms", f"expected an integer <= size_ms ({params['size_ms']})", slide)]
        return []

    def value(self, rec: Any) -> Any:
        v = rec.get(self.by) if isinstance(rec, dict) else None
        return v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v, sort_keys=True)

    def add(self, acc: Any, rec: Any, v: Any) -> Any:
        if acc is None:
            acc = [0, {}]
        acc[0] += 1
        tag = json.dumps(v)  # a JSON object's keys are text: keep the value's type in its tag
        acc[1][tag] = acc[1].get(tag, 0) + 1
        return acc

    def result(self, acc: Any) -> Dict[str, Any]:
        counts: Dict[str, int] = acc[1]
        best = heapq.nsmallest(self.k, counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return {"count": acc[0], "top": [[json.loads(tag), n] for tag, n in best]}


tumbling_window = TumblingWindow
sliding_window = SlidingWindow
top_k = TopK


def is_keyed(obj: Any) -> bool:
    """Is `obj` (an operator class, or one built) a keyed stateful operator? Its predecessors then
    route by an explicit group -> owner table (agent.dataplane.owners): its groups move only with
    their state."""
    return (isinstance(obj, type) and issubclass(obj, KeyedOperator)) or isinstance(obj, KeyedOperator)


def keyed_config_problems(cfg: Any, index: int, obj: Any) -> List[str]:
    """Why the pipeline `cfg` cannot run operator number `index`, whose function is `obj`, as a
    keyed operator (empty: it can, or it is not keyed). Said by check-config and by the worker
    (the deploy then fails with this line), not found out by losing state.

    Any scaling policy: its key groups move with their state when it duplicates or terminates
    (agent.instance.moves; docs/operators.md, "Key groups that move"). Its key field is the `key`
    of the operator before it (that key routes the records)."""
    if not is_keyed(obj):
        return []
    op = cfg.operators[index]
    what = f"operator {op.name!r} keeps keyed state ({op.function})"
    out = []
    if index == 0 or op.kind != "map":
        out.append(f'{what}: it must be a map (kind = "map"), after a source')
    elif cfg.operators[index - 1].key is None:
        prev = cfg.operators[index - 1].name
        out.append(f'{what}: the operator before it, {prev!r}, must set key = "<field>" (the field its records are '
                   "keyed by)")
    return out
