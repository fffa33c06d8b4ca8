"""The user operator API and the built-in operators: validate, in_zone, counting_sink, mqtt_sink.

An `[[operator]] function = "package.module:name"` names one of the following, and must be on the
node's allow-list (agent.operators.admission: the built-in operators below, the entry points of
installed packages in the group `fog_agent.operators`, the public functions of the modules the
node's agent.toml lists in `[operators] modules`; docs/runtime.md, "Your own operators"):
- a plain function `f(record) -> record | None` (a map or filter: None drops the record),
- a function decorated with `@record_map` (receives `(record, params)`),
- a factory with a `build(ctx) -> Operator` attribute (sources, sinks, stateful operators).

Why record ids never reach the user function: the id (source instance, sequence) must travel end to
end unchanged for the exactly-once accounting; the worker keeps it next to the record and gives
the function only the record. A filter that drops a record is not a loss: the worker counts it
(`filtered`), so `records_in = records_out + filtered` holds per instance.

The per-record service time (`service_time_ms` in the pipeline) is applied by the worker, not
here: it emulates a Raspberry Pi's per-record cost on this faster machine by keeping the instance
busy (it processes nothing else meanwhile) without burning the shared CPU (see docs/runtime.md).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from agent.dataplane.envelope import Item

if TYPE_CHECKING:
    from agent.operators.admission import AllowList

__all__ = [
    "OperatorContext",
    "Operator",
    "MapOperator",
    "SinkOperator",
    "Publication",
    "passes_records",
    "record_map",
    "Param",
    "check_params",
    "load_operator",
    "constructor_takes_ctx",
    "validate",
    "in_zone",
    "identity",
    "counting_sink",
    "null_sink",
    "mqtt_sink",
    "read_sink_ids",
    "GRID_ORIGIN",
]


@dataclass
class OperatorContext:
    """What an operator may know about where it runs (no sockets, no clock)."""

    instance: str
    operator: str
    node: str
    kind: str
    params: Dict[str, Any] = field(default_factory=dict)
    state_dir: Path = Path(".")
    sink_dir: Path = Path(".")
    restart: bool = False
    # spec.extra["spill"] (set by the agent from its [spill] section): {"dir" (the spool root; a
    # sink spools into <dir>/<instance>), "node", "max_bytes", "rotate_bytes", "rotate_seconds",
    # "ack" ("written" | "landed": when the sink acks upstream)}; empty = the sink does not spill.
    spill: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Publication:
    """A message a sink asks the worker to publish (through its one MQTT client)."""

    topic: str
    payload: bytes


class Operator:
    """Base: `process` maps input items to output items (ids unchanged)."""

    kind = "map"
    # True: never changes a record it is given in place (a `@passes_records` map, a sink that
    # reads only ids). A chained predecessor then hands it its batches without copying the
    # records (agent.instance.core, `_hand`: the copy protects only its replay buffer from a
    # receiver that writes into them). False unless declared.
    keeps_records = False

    def process(self, items: List[Item]) -> List[Item]:
        return items

    def close(self) -> None:
        """Called once before a clean exit (after draining)."""

    def stats(self) -> Dict[str, Any]:
        return {}


class MapOperator(Operator):
    """Wraps a per-record function; None means 'filtered out' (counted by the worker).

    A function marked `@passes_records` promises never to change a record in place;
    `unchanged` then says whether the last batch came out
    whole, record for record (checked with `is`), and the worker forwards such a batch as the
    bytes it arrived in instead of encoding it again (agent.dataplane.envelope.Passed)."""

    def __init__(self, fn: Callable[[Any], Any], passes: Optional[bool] = None) -> None:
        self.fn = fn
        self.passes_records = bool(getattr(fn, "passes_records", False)) if passes is None else passes
        self.keeps_records = self.passes_records
        # False: the function never reads its record (`identity`): the worker then does not
        # rebuild the records of compact batches (envelope.decode(records=LAZY)).
        self.reads_records = bool(getattr(fn, "reads_records", True))
        self.unchanged = False

    def process(self, items: List[Item]) -> List[Item]:
        fn = self.fn
        out: List[Item] = []
        append = out.append
        same = self.passes_records
        for it in items:
            rec = it[2]
            res = fn(rec)
            if res is rec:
                append(it)
            elif res is not None:
                same = False
                append((it[0], it[1], res))
        self.unchanged = same and len(out) == len(items)
        return out


def passes_records(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a map function that returns its record itself or None (a filter, or the identity),
    never modified in place: the worker may forward a batch it keeps whole without encoding it
    again (docs/measurement.md, "Cheap cuts of the data plane"). A marked function that returns
    anything else (a new record) just loses the shortcut for that batch; one that modifies its
    record in place breaks the promise (the next hop would see the record as it arrived)."""
    fn.passes_records = True  # type: ignore[attr-defined]
    return fn


class SinkOperator(Operator):
    """A sink: `record` must have durably recorded the items when it returns (the worker acks
    its predecessors right after, or after the returned publications are PUBACKed).

    A sink whose recording completes later (`deferred = True`, e.g. a spool at its cap) is
    asked `settle()` by the worker: how many earlier `record()` calls, oldest first, are now
    recorded; their inputs are acked only then. `writable()` False makes the worker stop reading
    its input (back pressure): the sink is holding records it could not store yet."""

    kind = "sink"
    deferred = False
    # False: `record` reads only the ids of its items (item[2] may be None then), so the worker
    # does not rebuild the records of compact batches (envelope.decode(records=False)).
    reads_records = True

    def record(self, items: List[Item]) -> List[Publication]:
        raise NotImplementedError

    def record_batch(self, items: List[Item], body: Optional[bytes]) -> List[Publication]:
        """`record` with the batch's JSON body as it arrived (None if unknown)."""
        return self.record(items)

    def settle(self) -> int:
        return 0

    def writable(self) -> bool:
        return True

    def take_events(self) -> List[Dict[str, Any]]:
        """Events to publish on the cluster's events topic (e.g. spool_full)."""
        return []


def record_map(fn: Callable[[Any, Dict[str, Any]], Any]) -> Callable[[Any, Dict[str, Any]], Any]:
    """Mark `fn(record, params)` as a map operator that receives its params."""

    def build(ctx: OperatorContext) -> Operator:
        params = ctx.params
        return MapOperator(lambda rec: fn(rec, params), passes=bool(getattr(fn, "passes_records", False)))

    fn.build = build  # type: ignore[attr-defined]
    return fn


@dataclass(frozen=True)
class Param:
    """One key of an operator's params, as `fog-agent check-config` checks it (docs/operators.md,
    "Declaring params"). An operator declares its keys with a `params_schema = {"key": Param(...)}`
    attribute on the object the pipeline names; without one, its params are not checked. Checked
    by check-config only: the worker builds the operator with the params as they are.

    `type`: "number", "integer", "string", "boolean", "array", "table" or "any"; `choices`: the
    allowed values; `min` / `max` inclusive bounds, `above` an exclusive lower bound (numbers);
    `path`: a file the operator opens, which must exist and be readable where check-config runs."""

    type: str = "any"
    required: bool = False
    choices: Tuple[Any, ...] = ()
    min: Optional[float] = None
    max: Optional[float] = None
    above: Optional[float] = None
    path: bool = False

    def expected(self) -> str:
        """What a good value is, in words (the end of an error line)."""
        if self.choices:
            return "one of " + ", ".join(json.dumps(c) for c in self.choices)
        words = {"number": "a finite number", "integer": "an integer", "string": "a string", "boolean": "a boolean",
                 "array": "an array", "table": "a table", "any": "a value"}[self.type]
        if self.path:
            words = "a readable file"
        bounds = []
        if self.above is not None:
            bounds.append(f"> {self.above:g}")
        if self.min is not None:
            bounds.append(f">= {self.min:g}")
        if self.max is not None:
            bounds.append(f"<= {self.max:g}")
        return words + (" " + " and ".join(bounds) if bounds else "")

    def problem(self, value: Any) -> Optional[str]:
        """None if `value` is good, else what was expected."""
        t = self.type
        ok = {
            "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "string": isinstance(value, str),
            "boolean": isinstance(value, bool),
            "array": isinstance(value, list),
            "table": isinstance(value, dict),
            "any": True,
        }[t]
        if ok and self.choices:
            ok = value in self.choices
        if ok and t in ("number", "integer"):
            ok = ((self.above is None or value > self.above) and (self.min is None or value >= self.min)
                  and (self.max is None or value <= self.max))
        if not ok:
            return f"expected {self.expected()}"
        if self.path:
            if not isinstance(value, str) or not value:
                return "expected a readable file"
            try:
                with open(value, "rb"):
                    pass
            except OSError as exc:
                return f"expected a readable file ({exc.strerror})"
        return None


def check_params(obj: Any, params: Dict[str, Any]) -> List[Tuple[str, str, Any]]:
    """(key, what was expected, the value) for each problem of `params` against the
    `params_schema` the operator object `obj` declares (none: nothing is checked). A key the
    schema does not name is a problem: a misspelt key would silently fall back to its default.
    An object may add checks across keys with a `check_params(params)` attribute returning the
    same triples (the taxi source: `csv` is required with `profile = "csv"`)."""
    schema = getattr(obj, "params_schema", None)
    if not isinstance(schema, dict):
        return []
    out: List[Tuple[str, str, Any]] = []
    for key in sorted(set(params) - set(schema)):
        allowed = f"allowed: {', '.join(sorted(schema))}" if schema else "this operator takes no params"
        out.append((key, f"unknown key ({allowed})", params[key]))
    for key, spec in schema.items():
        if key not in params:
            if spec.required:
                out.append((key, f"missing required key (expected {spec.expected()})", None))
            continue
        why = spec.problem(params[key])
        if why:
            out.append((key, why, params[key]))
    extra = getattr(obj, "check_params", None)
    if callable(extra) and not out:
        out.extend(extra(params))
    return out


def constructor_takes_ctx(cls: type) -> bool:
    """Whether an Operator class named directly is built as `cls(ctx)` (its constructor takes one
    positional argument, as every sink's does: it needs `ctx.sink_dir`) or `cls()`; TypeError
    when it needs more. docs/operators.md's table promises both forms; the loader used to call
    `cls()` only, so a SinkOperator class named directly passed check-config and failed here."""
    import inspect

    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C type): the argument-free form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) > 1 or any(p.kind == p.KEYWORD_ONLY for p in required):
        names = ", ".join(p.name for p in required)
        raise TypeError(f"its constructor requires {names}; it may take at most the context")
    return bool(positional) or any(p.kind == p.VAR_POSITIONAL for p in params)


def load_operator(ref: str, ctx: OperatorContext, allowed: Optional["AllowList"] = None) -> Operator:
    """Resolve "package.module:name" through the node's allow-list and build the operator
    instance. `allowed` defaults to this process's (`admission.node_allow_list`: built-ins,
    entry points, and the modules its agent configured); a refused name is never imported."""
    from agent.operators.admission import node_allow_list

    obj = (allowed if allowed is not None else node_allow_list()).resolve(ref)
    build = getattr(obj, "build", None)
    if callable(build):
        op = build(ctx)
    elif isinstance(obj, type) and issubclass(obj, Operator):
        op = obj(ctx) if constructor_takes_ctx(obj) else obj()
    elif callable(obj):
        op = MapOperator(obj)
    else:
        raise ValueError(f"operator function {ref!r}: not callable")
    if not isinstance(op, Operator) and not hasattr(op, "poll"):
        raise ValueError(f"operator function {ref!r}: build() returned {type(op).__name__}")
    return op


# ---- built-in map operators (thesis chapter 4 pipeline) ----------------------------------------

# DEBS 2015 grand challenge grid: 500 m x 500 m cells, cell 1.1 centred at this point, 300 x 300
# cells. 0.004491556 degrees latitude and 0.005986 degrees longitude are 500 m there.
GRID_ORIGIN = (41.474937, -74.913585)
CELL_LAT = 0.004491556
CELL_LON = 0.005986
GRID_CELLS = 300

_NUMERIC = ("trip_time_in_secs", "trip_distance", "fare_amount", "total_amount")
_COORDS = ("pickup_longitude", "pickup_latitude", "dropoff_longitude", "dropoff_latitude")


def _valid(rec: Any) -> bool:
    if not isinstance(rec, dict):
        return False
    try:
        if not (rec["trip_time_in_secs"] > 0 and rec["trip_distance"] > 0):
            return False
        if rec["fare_amount"] < 0 or rec["total_amount"] < 0:
            return False
        for k in _COORDS:
            if not rec[k]:  # the raw DEBS data marks a missing GPS fix with 0.0
                return False
        return bool(rec["medallion"]) and bool(rec["hack_license"])
    except (KeyError, TypeError):
        return False


@passes_records
@record_map
def validate(rec: Any, params: Dict[str, Any]) -> Any:
    """Drop records the DEBS 2015 challenge calls erroneous (zero GPS, zero time/distance, ...)."""
    return rec if _valid(rec) else None


def cell_of(lat: float, lon: float) -> Optional[Tuple[int, int]]:
    """The 1-based (east, south) cell of the DEBS grid, or None outside it. Floor, not int():
    truncation towards zero folded the band 0.5-1.5 cells west or north of cell 1.1's centre into
    the grid, where the batch job (agent.analytics.grid, docs/spill.md) counts it outside."""
    x = math.floor((lon - GRID_ORIGIN[1]) / CELL_LON + 0.5) + 1
    y = math.floor((GRID_ORIGIN[0] - lat) / CELL_LAT + 0.5) + 1
    if 1 <= x <= GRID_CELLS and 1 <= y <= GRID_CELLS:
        return x, y
    return None


@record_map
def in_zone(rec: Any, params: Dict[str, Any]) -> Any:
    """Keep trips that start and end inside the grid; annotate them with their cells and route."""
    try:
        a = cell_of(rec["pickup_latitude"], rec["pickup_longitude"])
        b = cell_of(rec["dropoff_latitude"], rec["dropoff_longitude"])
    except (KeyError, TypeError):
        return None
    if a is None or b is None:
        return None
    out = dict(rec)
    out["pickup_cell"] = f"{a[0]}.{a[1]}"
    out["dropoff_cell"] = f"{b[0]}.{b[1]}"
    # the route, as the DEBS query 1 operators name it: the key its first stage is keyed by
    # (foglab.operators.debs.RouteCounts; one field, since a pipeline's `key` names one field)
    out["route"] = f"{a[0]}.{a[1]}>{b[0]}.{b[1]}"
    return out


@passes_records
def identity(rec: Any) -> Any:
    """The trivial operator of the dataplane benchmark."""
    return rec


identity.reads_records = False  # type: ignore[attr-defined]


# The built-in maps take no params (check_params: any key is a misspelling).
validate.params_schema = {}  # type: ignore[attr-defined]
in_zone.params_schema = {}  # type: ignore[attr-defined]
identity.params_schema = {}  # type: ignore[attr-defined]


# ---- sinks --------------------------------------------------------------------------------------


def sink_ids_path(sink_dir: Path, instance: str) -> Path:
    return Path(sink_dir) / f"{instance}.ids"


class _Spilled:
    """One record() call of a spilling sink the spool's cap holds back: its line and its ids."""

    __slots__ = ("kind", "line", "ids")

    def __init__(self, kind: str, line: Optional[bytes], ids: List[str]) -> None:
        self.kind, self.line, self.ids = kind, line, ids  # line None: nothing new to store


class CountingSink(SinkOperator):
    """Records the id of every record it receives, once; with `ctx.spill`, also spills the records.

    Accounting contract (for verifiers, the demo and the chaos runs): every sink instance appends
    one line `<source instance> <source seq>` per NEW record id to `<sink_dir>/<instance>.ids`
    (written and flushed before the batch is acknowledged, so an acked record is on disk for a
    worker crash); a record id seen before (by this instance, including before a restart) is
    dropped and counted as `duplicates`. Across sink instances, `read_sink_ids` merges the files
    and reports ids that appear in more than one file as duplicated.

    Spill (docs/spill.md): the new records of each batch go to this instance's spool
    (`batchspool.BatchSpool`) as ONE line: the batch's compact body exactly as it arrived
    (`{"k": keys, "r": [[src, seq, values]]}`, kind "batches", no re-encoding) when no record of
    it was a duplicate, else the new records re-encoded (same form; kind "records" with src/seq
    inside for non-dict records). Order per batch, all in this thread, in `record_batch`: spool
    line handed to the OS (one os.write, no compression, no thread hand-off) -> ids appended to
    the ids file -> the worker acks (`settle` reports the call done). At the spool's cap the
    batch is kept (`writable()` False: the worker stops reading, acks stop) and retried in
    `settle`, in order. A spool file reaches `closed/` (shippable) only after the ids file is
    fsync'ed (`_sync_ids`, called by the spool's compressor before it compresses the file), and
    the file is closed for appending only after the ids of its lines were written. Hence after a
    crash: the ids file plus the ids still in the local spool files (read back at start) are
    every id spooled, and a replayed record is dropped, never spooled twice.

    When the acks go upstream (`ctx.spill["ack"]`, the agent's `[spill] ack`; ledger:
    `agent.spill.ackhold.AckHold`): "written" (default), as above, once the line and the ids are
    written; "landed", only once the spool files holding the call's records (and every file
    written before, which holds the first copies of the ids it dropped as duplicates) have left
    the spool: the daemon's shipper deletes a file only once the collector answered landed or
    duplicate (or a path shipper landed it). Checked every `LAND_CHECK` seconds in `settle`; a
    file a held call waits on is closed for shipping once that call waited `LANDED_CLOSE_AFTER`
    (its predecessors' credit runs out long before `rotate_bytes`). At start, the files a
    previous incarnation left hold the first calls (its predecessors' replays are duplicates).
    """

    def __init__(self, ctx: OperatorContext) -> None:
        self.path = sink_ids_path(ctx.sink_dir, ctx.instance)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seen: Dict[str, Set[int]] = {}
        if self.path.exists():
            for src, seq in _read_ids(self.path):
                self.seen.setdefault(src, set()).add(seq)
        self._fh = open(self.path, "a", buffering=1 << 16)
        self.duplicates = 0
        self.spool: Any = None
        self._pending: "deque[_Spilled]" = deque()  # held back by the cap, oldest first
        self.hold: Any = None  # agent.spill.ackhold.AckHold, with a spool
        self._events: List[Dict[str, Any]] = []
        self.spilled = 0
        self.adopted = 0
        if ctx.spill.get("dir"):
            self._open_spool(ctx)
        self.recorded = sum(len(s) for s in self.seen.values())

    @property
    def deferred(self) -> bool:  # type: ignore[override]
        return self.spool is not None

    @property
    def reads_records(self) -> bool:  # type: ignore[override]
        return self.spool is not None  # spilling re-encodes the new records of a batch with duplicates

    def _open_spool(self, ctx: OperatorContext) -> None:
        from agent.spill.batchspool import BatchSpool

        spill = ctx.spill
        d = Path(spill["dir"]) / ctx.instance  # one spool per instance (siblings inherit `extra`)
        self.adopted = self._adopt_spooled(d)
        self.spool = BatchSpool(
            d, str(spill.get("node") or ctx.node),
            max_bytes=int(spill.get("max_bytes", 512 << 20)),
            rotate_bytes=int(spill.get("rotate_bytes", 4 << 20)),
            rotate_seconds=float(spill.get("rotate_seconds", 60.0)),
            on_event=lambda ev: self._events.append(ev.to_json()),  # list.append: thread-safe
            before_close=self._sync_ids,  # from the compressor thread, before a file may be shipped
        )
        self._last_tick = 0.0
        from agent.spill.ackhold import AckHold

        mode = str(spill.get("ack") or "written")
        self.hold = AckHold(mode, unlanded=self.spool.unshipped() if mode == "landed" else ())
        self._landed = mode == "landed"
        self._last_land_check = 0.0

    def _sync_ids(self) -> None:
        """fsync the ids file: every id written so far (flushed by `_store_pending` before the
        spool may close a file) survives a power cut before its records can leave the node."""
        os.fsync(self._fh.fileno())

    def _adopt_spooled(self, d: Path) -> int:
        """Ids in this instance's local spool files but not in the ids file (a crash between the
        spool write and the ids write): recorded now, so that their replay is dropped."""
        from agent.spill.spool import salvage_lines

        new: List[str] = []
        for sub in ("open", "closed"):
            for p in sorted((d / sub).iterdir()) if (d / sub).is_dir() else ():
                if not p.name.startswith(("batches+", "records+")) or p.name.endswith(".tmp"):
                    continue
                for line in salvage_lines(p.read_bytes()):
                    for src, seq in _line_ids(line):
                        s = self.seen.setdefault(src, set())
                        if seq not in s:
                            s.add(seq)
                            new.append(f"{src} {seq}\n")
        if new:
            self._fh.write("".join(new))
            self._fh.flush()
            os.fsync(self._fh.fileno())
        return len(new)

    def _new_ids(self, items: List[Item]) -> Tuple[List[Item], List[str]]:
        fresh, lines = [], []
        seen = self.seen
        for it in items:
            src, seq = it[0], it[1]
            s = seen.get(src)
            if s is None:
                s = seen[src] = set()
            if seq in s:
                self.duplicates += 1  # duplicate record id: dropped before recording
                continue
            s.add(seq)
            fresh.append(it)
            lines.append(f"{src} {seq}\n")
        return fresh, lines

    def record(self, items: List[Item]) -> List[Publication]:
        return self.record_batch(items, None)

    def record_batch(self, items: List[Item], body: Optional[bytes]) -> List[Publication]:
        fresh, lines = self._new_ids(items)
        if self.spool is None:
            if lines:
                self._fh.write("".join(lines))
                self._fh.flush()  # in the OS page cache: survives a worker crash
                self.recorded += len(lines)
            return []
        if not fresh:
            e = _Spilled("batches", None, [])
        elif body is not None and len(fresh) == len(items) and body[:1] == b"{":
            e = _Spilled("batches", body + b"\n", lines)  # as received
        else:
            e = _Spilled(*_encode_spill(fresh), lines)
        self._pending.append(e)
        self._store_pending()
        return []

    def _store_pending(self) -> None:
        """Spool line, then ids, of each held-back call in order, until the cap holds one back.
        Every line is in the OS file before its ids are written (and the ids before the ack)."""
        pending, spool, hold = self._pending, self.spool, self.hold
        ids: List[str] = []
        done = 0
        now = time.monotonic()
        while pending:
            e = pending[0]
            if e.line is not None and not spool.append_line(e.kind, e.line):
                break  # cap reached: keep it (and everything after it), retry in settle()
            pending.popleft()
            ids.extend(e.ids)
            done += 1
            if self._landed:
                hold.wrote((spool.open_name(e.kind),) if e.line is not None else (), now)
        if ids:
            self._fh.write("".join(ids))
            self._fh.flush()  # in the OS page cache: survives a worker crash
            self.recorded += len(ids)
            self.spilled += len(ids)
        if done and not self._landed:
            hold.wrote((), now, calls=done)
        spool.close_full_files()  # after the ids are flushed: see BatchSpool.close_full_files

    def writable(self) -> bool:
        return self.spool is None or not self._pending

    def settle(self) -> int:
        """How many more record() calls may be acked (in order): those recorded (spool line in the
        OS file, ids written), all of them unless the spool's cap holds some back; with
        ack "landed", those whose spool files have landed."""
        if self.spool is None:
            return 0
        if self._pending:
            self._store_pending()
        now = time.monotonic()
        if now - self._last_tick >= 0.5:
            self._last_tick = now
            self.spool.tick()  # rotation by age; a full spool notices released files
        if self._landed and now - self._last_land_check >= LAND_CHECK:
            self._last_land_check = now
            self._check_landed(now)
        return self.hold.take()

    def _check_landed(self, now: float) -> None:
        """Files gone from the spool have landed (the shipper releases only those), oldest first:
        nothing is released before the oldest lands, so one look per check while it is here. A
        file a call has waited on for `LANDED_CLOSE_AFTER` is closed for shipping."""
        hold, spool = self.hold, self.spool
        name = hold.oldest()
        while name is not None and not spool.holds(name):
            hold.landed(name)
            name = hold.oldest()
        since = hold.held_since()
        if since is not None and now - since >= LANDED_CLOSE_AFTER:
            spool.close_files(hold.waits_on())

    def close(self) -> None:
        if self.spool is not None:
            if self._pending:
                self._store_pending()  # what the cap still holds back stays unacked: replayed later
            self._fh.flush()
            self.spool.close()  # compresses every file, each after `_sync_ids`
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def take_events(self) -> List[Dict[str, Any]]:
        if not self._events:
            return []
        evs, self._events = self._events, []
        return [e for e in evs if e.get("event") != "file_closed"]

    def stats(self) -> Dict[str, Any]:
        s: Dict[str, Any] = {"recorded": self.recorded, "duplicates_dropped": self.duplicates}
        if self.spool is not None:
            s.update(spilled=self.spilled, spill_waiting=len(self._pending), acks_held=self.hold.held,
                     spool_full=self.spool.full, spool_bytes=self.spool.used_bytes(),
                     spool_full_events=self.spool.stats["full_events"], spill_adopted=self.adopted)
        return s


LAND_CHECK = 0.05  # seconds between two looks at the spool for landed files (ack "landed")
LANDED_CLOSE_AFTER = 0.2  # seconds a held call waits before the file it waits on is closed for shipping


def _encode_spill(items: List[Item]) -> Tuple[str, bytes]:
    from agent.dataplane.envelope import _compact, _dumps

    body = _compact(items)
    if isinstance(body, dict):
        return "batches", _dumps(body).encode() + b"\n"
    rows = [dict(rec, src=src, seq=seq) if isinstance(rec, dict) else {"src": src, "seq": seq, "value": rec}
            for src, seq, rec in items]
    return "records", _dumps(rows).encode() + b"\n"


def _line_ids(line: bytes) -> Iterable[Tuple[str, int]]:
    """The record ids of one spool line: a compact batch, an array of records, or one record."""
    try:
        v = json.loads(line)
    except ValueError:
        return
    if isinstance(v, dict) and "r" in v and "k" in v:
        for row in v["r"]:
            yield str(row[0]), int(row[1])
    elif isinstance(v, list):
        for r in v:
            if isinstance(r, dict) and "src" in r and "seq" in r:
                yield str(r["src"]), int(r["seq"])
    elif isinstance(v, dict) and "src" in v and "seq" in v:
        yield str(v["src"]), int(v["seq"])


class _Factory:
    def __init__(self, build: Callable[[OperatorContext], Operator]) -> None:
        self.build = build


counting_sink = _Factory(CountingSink)
counting_sink.params_schema = {}  # type: ignore[attr-defined]


class NullSink(SinkOperator):
    """Counts and forgets (benchmarks: no id bookkeeping, so it measures the data path alone)."""

    reads_records = False
    keeps_records = True

    def __init__(self, ctx: OperatorContext) -> None:
        self.recorded = 0

    def record(self, items: List[Item]) -> List[Publication]:
        self.recorded += len(items)
        return []

    def stats(self) -> Dict[str, Any]:
        return {"recorded": self.recorded}


null_sink = _Factory(NullSink)
null_sink.params_schema = {}  # type: ignore[attr-defined]


class MqttSink(SinkOperator):
    """Publishes each batch as one JSON message `{"ids": [[src, seq], ...], "records": [...]}` to
    `params.topic`; the batch counts as recorded once the broker PUBACKs it."""

    def __init__(self, ctx: OperatorContext) -> None:
        topic = ctx.params.get("topic")
        if not isinstance(topic, str) or not topic or "+" in topic or "#" in topic:
            raise ValueError(f"mqtt_sink: params.topic must be a topic name, found {topic!r}")
        self.topic = topic
        self.published = 0

    def record(self, items: List[Item]) -> List[Publication]:
        if not items:
            return []
        self.published += len(items)
        return [self.publication(self.topic, items)]

    @staticmethod
    def publication(topic: str, items: List[Item]) -> Publication:
        """One batch as one message on `topic`: `{"ids": [[src, seq], ...], "records": [...]}`."""
        body = {"ids": [[s, q] for s, q, _ in items], "records": [r for _, _, r in items]}
        return Publication(topic, json.dumps(body, separators=(",", ":")).encode())

    def stats(self) -> Dict[str, Any]:
        return {"published": self.published}


mqtt_sink = _Factory(MqttSink)
mqtt_sink.params_schema = {"topic": Param("string", required=True)}  # type: ignore[attr-defined]
mqtt_sink.check_params = lambda p: (  # type: ignore[attr-defined]
    [("topic", "expected a topic name (no + or #)", p["topic"])] if not p["topic"] or "+" in p["topic"] or "#" in p["topic"] else [])


def _read_ids(path: Path) -> Iterable[Tuple[str, int]]:
    with open(path) as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():  # a torn last line after a crash is skipped
                yield parts[0], int(parts[1])


def read_sink_ids(sink_dir: Path) -> Tuple[Dict[str, Set[int]], int]:
    """Merge every `*.ids` file under sink_dir: ({source: seqs}, ids seen more than once)."""
    merged: Dict[str, Set[int]] = {}
    dup = 0
    for path in sorted(Path(sink_dir).glob("*.ids")):
        for src, seq in _read_ids(path):
            s = merged.setdefault(src, set())
            if seq in s:
                dup += 1
            else:
                s.add(seq)
    return merged, dup
