"""Declarative event-time windows per key, from pipeline.toml alone (docs/operators.md,
"Declarative windows").

    [[operator]]
    name = "minute"
    function = "agent.operators.windows:window"
    params = { kind = "tumbling", size_ms = 60000, time_field = "t", lateness_ms = 5000, late = "emit",
               aggregates = { mean_temp = ["mean", "temp"], max_temp = ["max", "temp"], n = ["count"] } }

`window` is a `KeyedOperator` (agent.operators.keyed) like the built-in `tumbling_window`: the
worker's keyed state (agent.instance.keyed_state) keeps its state per key and key group, saves it
with the input position it reflects, moves it with its key groups when instances duplicate and
terminate, and gives each output its id (`<operator>#<key digest>`, the key's n-th output), so a
run with crashes emits exactly the outputs of a run without. What it adds to the built-ins:

- three kinds: "tumbling" (`size_ms`), "sliding" (`size_ms`, `slide_ms` <= `size_ms`, at most
  MAX_WINDOWS_PER_RECORD windows per record) and "session" (`gap_ms`: a key's records less than
  `gap_ms` apart form one session; two sessions a record bridges merge);
- several aggregates at once, each `name = ["<aggregate>", <args>...]`: ["count"] (records),
  ["count", f] (records with a non-null f), ["sum", f], ["mean", f], ["min", f], ["max", f]
  (records whose f is a finite number; the others are skipped by that aggregate), ["top_k", f, k]
  (the k largest values of f, largest first, k <= MAX_TOP_K) and ["fold", "module:function"
  (, f)] (a user fold, below);
- late records to a side output. A record older than the watermark (the largest event time the
  instance has taken minus `lateness_ms`, as for every keyed operator) is left out of every window
  and counted (`late_dropped` in the instance's stats); with `late = "emit"` it also goes on
  downstream as it came, marked with a field `"late": true`, under its own record id (the keyed
  state's `on_late` side output: saved with the outputs, so the sink records it exactly once, on
  whichever instance and in whichever batch it came; counted `late_sent`). `late_split_sink`
  below publishes those to a topic of their own.

One output per key and window once the watermark reaches its end: `{"key", "start", "end",
<aggregate name>: value, ...}` (a session ends `gap_ms` after its last record). An aggregate that
saw no value gives null (sum: 0, count: 0).

A user fold: `["fold", "mylab.ops:fold", "temp"]` names a function on the node's operator
allow-list (agent.operators.admission: an entry point or a public function of a module listed in
`[operators] modules`), resolved through that list when the operator is built, never imported
because a pipeline names it. `fold(acc, value) -> acc`: `acc` is None for a window's first value,
`value` the record's field f (records without it are skipped) or the whole record when no field is
given; the window's result is the last acc. It must be deterministic, return a new acc rather
than change the one it got (a call that raises must leave it as it was), and return a small JSON value
(at most MAX_FOLD_BYTES as JSON; a record it raises on, or whose acc is not such a value, is
skipped for the whole window and counted in `fold_errors`). Session windows merge accumulators:
there the function needs a `merge(acc1, acc2) -> acc` attribute.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent.operators.builtin import MqttSink, OperatorContext, Param, Publication
from agent.operators.builtin import check_params as _check_params
from agent.operators.keyed import EVENT_TIME_PARAMS, KeyedOperator
from agent.refs import parse_ref

__all__ = ["window", "Window", "late_split_sink", "AGGREGATES", "KINDS", "MAX_WINDOWS_PER_RECORD",
           "MAX_TOP_K", "MAX_AGGREGATES", "MAX_FOLD_BYTES"]

KINDS = ("tumbling", "sliding", "session")
AGGREGATES = ("count", "sum", "mean", "min", "max", "top_k", "fold")
MAX_WINDOWS_PER_RECORD = 100  # size_ms / slide_ms of a sliding window: the state kept per record
MAX_TOP_K = 100
MAX_AGGREGATES = 32
MAX_FOLD_BYTES = 16 << 10
RESERVED = ("key", "start", "end", "late")  # fields of the output record an aggregate may not take


def _number(rec: Any, field: str) -> Optional[float]:
    v = rec.get(field) if isinstance(rec, dict) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return v
    return None


# ---- checking the params (check-config, and the worker when it builds the operator) --------------


class Given:
    """A value as check-config shows it after "got": arrays and tables as JSON (its default says
    only "an array"). Equal to the value itself."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return json.dumps(self.value, separators=(", ", ": "))

    def __eq__(self, other: Any) -> bool:
        return (other.value if isinstance(other, Given) else other) == self.value

    __hash__ = None  # type: ignore[assignment]


def _aggregate_problem(spec: Any) -> Optional[str]:
    """What is wrong with one aggregate's spec (None: nothing), as "expected ..."."""
    if not isinstance(spec, list) or not spec or not isinstance(spec[0], str):
        return 'expected an array ["<aggregate>", <args>...] with the aggregate one of ' + ", ".join(
            json.dumps(a) for a in AGGREGATES)
    what, args = spec[0], spec[1:]
    if what not in AGGREGATES:
        return "expected the aggregate one of " + ", ".join(json.dumps(a) for a in AGGREGATES)
    if what == "count":
        if len(args) > 1 or (args and not (isinstance(args[0], str) and args[0])):
            return 'expected ["count"] or ["count", "<field>"]'
    elif what in ("sum", "mean", "min", "max"):
        if len(args) != 1 or not isinstance(args[0], str) or not args[0]:
            return f'expected ["{what}", "<field>"] (the numeric field it reads)'
    elif what == "top_k":
        ok = (len(args) == 2 and isinstance(args[0], str) and args[0] and isinstance(args[1], int)
              and not isinstance(args[1], bool) and 1 <= args[1] <= MAX_TOP_K)
        if not ok:
            return f'expected ["top_k", "<field>", k] with k an integer 1..{MAX_TOP_K}'
    else:  # fold
        if len(args) not in (1, 2) or (len(args) == 2 and not (isinstance(args[1], str) and args[1])):
            return 'expected ["fold", "package.module:function"] or ["fold", "package.module:function", "<field>"]'
        try:
            parse_ref(args[0])
        except ValueError:
            return 'expected ["fold", "package.module:function", ...] (a function on the node\'s operator allow-list)'
    return None


def _check(params: Dict[str, Any]) -> List[Tuple[str, str, Any]]:
    """Problems across keys (the schema checked each key's type already): (key, expected, given)."""
    out: List[Tuple[str, str, Any]] = []
    kind = params.get("kind", "tumbling")
    size, slide, gap = params.get("size_ms"), params.get("slide_ms"), params.get("gap_ms")
    needs = {"tumbling": ("size_ms",), "sliding": ("size_ms", "slide_ms"), "session": ("gap_ms",)}[kind]
    for key in ("size_ms", "slide_ms", "gap_ms"):
        if key in needs and params.get(key) is None:
            out.append((key, f'missing required key (expected an integer >= 1: kind = "{kind}" needs {", ".join(needs)})',
                        None))
        elif key not in needs and params.get(key) is not None:
            out.append((key, f'expected no {key} with kind = "{kind}" (it takes {", ".join(needs)})', params[key]))
    if kind == "sliding" and isinstance(size, int) and isinstance(slide, int):
        if slide > size:
            out.append(("slide_ms", f"expected an integer <= size_ms ({size})", slide))
        elif size > MAX_WINDOWS_PER_RECORD * slide:
            out.append(("slide_ms", f"expected an integer >= size_ms / {MAX_WINDOWS_PER_RECORD} "
                        f"({-(-size // MAX_WINDOWS_PER_RECORD)}: at most {MAX_WINDOWS_PER_RECORD} windows per record)", slide))
    aggs = params.get("aggregates")
    if not aggs:
        out.append(("aggregates", 'expected a table of at least one name = ["<aggregate>", <args>...]', Given(aggs)))
    elif len(aggs) > MAX_AGGREGATES:
        out.append(("aggregates", f"expected at most {MAX_AGGREGATES} aggregates", len(aggs)))
    else:
        for name, spec in aggs.items():
            if name in RESERVED:
                out.append((f"aggregates.{name}", "expected a name other than " + ", ".join(f'"{r}"' for r in RESERVED)
                            + " (fields of the output record)", name))
                continue
            why = _aggregate_problem(spec)
            if why:
                out.append((f"aggregates.{name}", why, Given(spec) if isinstance(spec, (list, dict)) else spec))
    return out


# ---- the aggregates --------------------------------------------------------------------------------


class _Agg:
    """One compiled aggregate: `new()` an empty accumulator (a JSON value), `add(acc, rec)` a new one
    (never changes `acc`; raises for a record the user fold fails on), `merge(a, b)` (sessions),
    `result(acc)` the output value."""

    def __init__(self, name: str, spec: List[Any], resolve: Callable[[str], Any], kind: str) -> None:
        self.name, self.what = name, spec[0]
        args = spec[1:]
        self.field: Optional[str] = None
        self.k = 0
        self.fn: Any = None
        if self.what == "fold":
            self.fn = resolve(args[0])
            if not callable(self.fn):
                raise ValueError(f"window: aggregates.{name}: {args[0]!r} is not a function")
            self.field = args[1] if len(args) > 1 else None
            if kind == "session" and not callable(getattr(self.fn, "merge", None)):
                raise ValueError(f"window: aggregates.{name}: a fold in session windows needs {args[0]}.merge(acc, acc) "
                                 "(two sessions a record bridges merge)")
        else:
            self.field = args[0] if args else None
            if self.what == "top_k":
                self.k = int(args[1])

    def new(self) -> Any:
        return {"count": 0, "sum": 0, "mean": [0, 0], "top_k": []}.get(self.what)

    def add(self, acc: Any, rec: Any) -> Any:
        w = self.what
        if w == "count":
            ok = self.field is None or (isinstance(rec, dict) and rec.get(self.field) is not None)
            return acc + 1 if ok else acc
        if w == "fold":
            if self.field is None:
                value = rec
            else:
                value = rec.get(self.field) if isinstance(rec, dict) else None
                if value is None:
                    return acc
            new = self.fn(acc, value)
            if len(json.dumps(new, allow_nan=False)) > MAX_FOLD_BYTES:
                raise ValueError(f"fold {self.name}: accumulator larger than {MAX_FOLD_BYTES} bytes as JSON")
            return new
        v = _number(rec, self.field)  # type: ignore[arg-type]
        if v is None:
            return acc
        if w == "sum":
            return acc + v
        if w == "mean":
            return [acc[0] + 1, acc[1] + v]
        if w == "min":
            return v if acc is None or v < acc else acc
        if w == "max":
            return v if acc is None or v > acc else acc
        return sorted(acc + [v], reverse=True)[:self.k]  # top_k

    def merge(self, a: Any, b: Any) -> Any:
        w = self.what
        if w in ("count", "sum"):
            return a + b
        if w == "mean":
            return [a[0] + b[0], a[1] + b[1]]
        if w in ("min", "max"):
            if a is None or b is None:
                return b if a is None else a
            return min(a, b) if w == "min" else max(a, b)
        if w == "top_k":
            return sorted(a + b, reverse=True)[:self.k]
        if a is None or b is None:
            return b if a is None else a
        return self.fn.merge(a, b)

    def result(self, acc: Any) -> Any:
        if self.what == "mean":
            return acc[1] / acc[0] if acc[0] else None
        return acc


def _ms(t: float) -> Any:
    """A time in ms as the output shows it: whole milliseconds as an integer (a session's bounds
    come from event times, which are floats)."""
    return int(t) if isinstance(t, float) and t.is_integer() else t


# ---- the operator ----------------------------------------------------------------------------------


class Window(KeyedOperator):
    """Declarative windows per key (see the module docstring).

    State of a key: tumbling and sliding `{"<start ms>": [acc, ...]}` for its open windows (one
    accumulator per aggregate, in the order of `aggregates`); session `[[start, end, [acc, ...]],
    ...]` sorted by start. A window is emitted and forgotten once the watermark reaches its end; a
    key without open windows has no state (its output counter stays with the keyed state)."""

    params_schema = dict(EVENT_TIME_PARAMS, time_field=Param("string", required=True),
                         kind=Param("string", choices=KINDS), size_ms=Param("integer", min=1),
                         slide_ms=Param("integer", min=1), gap_ms=Param("integer", min=1),
                         aggregates=Param("table", required=True), late=Param("string", choices=("count", "emit")))

    def __init__(self, ctx: OperatorContext, resolve: Optional[Callable[[str], Any]] = None) -> None:
        super().__init__(ctx)
        p = ctx.params
        problems = _check_params(Window, p)  # what check-config says, said again where it runs
        if problems:
            key, expected, got = problems[0]
            raise ValueError(f"window: params.{key}: {expected}" + ("" if got is None else f", got {got!r}"))
        self.kind = p.get("kind", "tumbling")
        self.size = int(p.get("size_ms") or 0)
        self.slide = int(p.get("slide_ms") or self.size)
        self.gap = int(p.get("gap_ms") or 0)
        self.emit_late = p.get("late", "count") == "emit"
        if resolve is None:
            from agent.operators.admission import node_allow_list

            resolve = node_allow_list().resolve  # the node's allow-list: never what the bus names alone
        self.aggs = [_Agg(name, spec, resolve, self.kind) for name, spec in p["aggregates"].items()]
        self.fold_errors = 0

    @staticmethod
    def check_params(params: Dict[str, Any]) -> List[Tuple[str, str, Any]]:
        return _check(params)

    def on_late(self, record: Any) -> Optional[Any]:
        """With late = "emit": the late record goes on, marked (the keyed state's side output)."""
        return dict(record, late=True) if self.emit_late and isinstance(record, dict) else None

    # ---- the windows -------------------------------------------------------------------------------

    def _starts(self, t: float) -> List[int]:
        last = int(math.floor(t / self.slide)) * self.slide
        first = last - ((self.size - 1) // self.slide) * self.slide
        return [s for s in range(first, last + 1, self.slide) if s <= t < s + self.size]

    def _added(self, accs: List[Any], rec: Any) -> List[Any]:
        return [a.add(acc, rec) for a, acc in zip(self.aggs, accs)]

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        wins = state
        for rec in records:
            t = self.event_time(rec)
            assert t is not None  # the keyed state hands on only records with an event time
            try:
                wins = self._session_add(wins, t, rec) if self.kind == "session" else self._window_add(wins, t, rec)
            except Exception:  # noqa: BLE001 - the user's fold: the record is skipped (checked before any change)
                self.fold_errors += 1
        return [], wins

    def _window_add(self, wins: Any, t: float, rec: Any) -> Any:
        wins = wins if wins is not None else {}
        new = {}
        for s in self._starts(t):
            k = str(s)
            accs = wins.get(k)
            new[k] = self._added(accs if accs is not None else [a.new() for a in self.aggs], rec)
        wins.update(new)  # every window computed first: a fold that raises changes none
        return wins

    def _session_add(self, sessions: Any, t: float, rec: Any) -> Any:
        sessions = sessions if sessions is not None else []
        lo, hi = t, t + self.gap
        touching = [s for s in sessions if s[0] < hi and lo < s[1]]
        accs = [a.new() for a in self.aggs]
        for s in touching:  # oldest first: a fold's merge sees them in start order
            accs = [a.merge(x, y) for a, x, y in zip(self.aggs, accs, s[2])]
            lo, hi = min(lo, s[0]), max(hi, s[1])
        accs = self._added(accs, rec)
        keep = [s for s in sessions if not any(s is x for x in touching)]
        keep.append([lo, hi, accs])
        keep.sort(key=lambda s: (s[0], s[1]))
        return keep

    def notify_at(self, key: Any, state: Any) -> Optional[float]:
        if not state:
            return None
        if self.kind == "session":
            return float(min(s[1] for s in state))
        return float(min(int(s) for s in state) + self.size)

    def _row(self, key: Any, start: float, end: float, accs: List[Any]) -> Dict[str, Any]:
        row: Dict[str, Any] = {"key": key, "start": _ms(start), "end": _ms(end)}
        for a, acc in zip(self.aggs, accs):
            row[a.name] = a.result(acc)
        return row

    def on_notify(self, key: Any, state: Any, watermark: float) -> Tuple[List[Any], Any]:
        out = []
        if self.kind == "session":
            for s in sorted(state, key=lambda s: (s[1], s[0])):
                if s[1] <= watermark:
                    out.append(self._row(key, s[0], s[1], s[2]))
            state = [s for s in state if s[1] > watermark]
            return out, (state or None)
        for s in sorted(int(s) for s in state):
            if s + self.size > watermark:
                break
            out.append(self._row(key, s, s + self.size, state.pop(str(s))))
        return out, (state or None)

    def stats(self) -> Dict[str, Any]:
        return {"fold_errors": self.fold_errors}


window = Window


# ---- a sink that publishes the side output apart ---------------------------------------------------


class LateSplitSink(MqttSink):
    """`mqtt_sink` that publishes the records marked `"late": true` (a window's side output) to
    `params.late_topic` and the others to `params.topic`, each batch as `mqtt_sink` does: one
    message `{"ids": [...], "records": [...]}` per topic that has records."""

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)  # reads params.topic
        late = ctx.params.get("late_topic")
        if not isinstance(late, str) or not late or "+" in late or "#" in late:
            raise ValueError(f"late_split_sink: params.late_topic must be a topic name, found {late!r}")
        self.late_topic = late
        self.published_late = 0

    def record(self, items: List[Any]) -> List[Publication]:
        late = [it for it in items if isinstance(it[2], dict) and it[2].get("late") is True]
        rest = [it for it in items if not (isinstance(it[2], dict) and it[2].get("late") is True)]
        pubs = super().record(rest)
        if late:
            self.published_late += len(late)
            pubs.append(self.publication(self.late_topic, late))
        return pubs

    def stats(self) -> Dict[str, Any]:
        return dict(super().stats(), published_late=self.published_late)


class _SinkFactory:
    def build(self, ctx: OperatorContext) -> LateSplitSink:
        return LateSplitSink(ctx)


def _topic_problems(params: Dict[str, Any]) -> List[Tuple[str, str, Any]]:
    return [(k, "expected a topic name (no + or #)", params[k]) for k in ("topic", "late_topic")
            if not params[k] or "+" in params[k] or "#" in params[k]]


late_split_sink = _SinkFactory()
late_split_sink.params_schema = {"topic": Param("string", required=True),  # type: ignore[attr-defined]
                                 "late_topic": Param("string", required=True)}
late_split_sink.check_params = _topic_problems  # type: ignore[attr-defined]
