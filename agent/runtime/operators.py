"""The user operator API and the built-in operators: validate, in_zone, counting_sink, mqtt_sink.

An `[[operator]] function = "package.module:name"` names one of:
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

import importlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from agent.runtime.envelope import Item

__all__ = [
    "OperatorContext",
    "Operator",
    "MapOperator",
    "SinkOperator",
    "Publication",
    "record_map",
    "load_operator",
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


@dataclass(frozen=True)
class Publication:
    """A message a sink asks the worker to publish (through its one MQTT client)."""

    topic: str
    payload: bytes


class Operator:
    """Base: `process` maps input items to output items (ids unchanged)."""

    kind = "map"

    def process(self, items: List[Item]) -> List[Item]:
        return items

    def close(self) -> None:
        """Called once before a clean exit (after draining)."""

    def stats(self) -> Dict[str, Any]:
        return {}


class MapOperator(Operator):
    """Wraps a per-record function; None means 'filtered out' (counted by the worker)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def process(self, items: List[Item]) -> List[Item]:
        fn = self.fn
        out: List[Item] = []
        append = out.append
        for src, seq, rec in items:
            res = fn(rec)
            if res is not None:
                append((src, seq, res))
        return out


class SinkOperator(Operator):
    """A sink: `record` must have durably recorded the items when it returns (the worker acks
    its predecessors right after, or after the returned publications are PUBACKed)."""

    kind = "sink"

    def record(self, items: List[Item]) -> List[Publication]:
        raise NotImplementedError


def record_map(fn: Callable[[Any, Dict[str, Any]], Any]) -> Callable[[Any, Dict[str, Any]], Any]:
    """Mark `fn(record, params)` as a map operator that receives its params."""

    def build(ctx: OperatorContext) -> Operator:
        params = ctx.params
        return MapOperator(lambda rec: fn(rec, params))

    fn.build = build  # type: ignore[attr-defined]
    return fn


def load_operator(ref: str, ctx: OperatorContext) -> Operator:
    """Resolve "package.module:name" and build the operator instance."""
    module_name, _, name = ref.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"operator function {ref!r}: cannot import ({exc})") from None
    build = getattr(obj, "build", None)
    if callable(build):
        op = build(ctx)
    elif isinstance(obj, type) and issubclass(obj, Operator):
        op = obj()
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


@record_map
def validate(rec: Any, params: Dict[str, Any]) -> Any:
    """Drop records the DEBS 2015 challenge calls erroneous (zero GPS, zero time/distance, ...)."""
    return rec if _valid(rec) else None


def cell_of(lat: float, lon: float) -> Optional[Tuple[int, int]]:
    """The 1-based (east, south) cell of the DEBS grid, or None outside it."""
    x = int((lon - GRID_ORIGIN[1]) / CELL_LON + 0.5) + 1
    y = int((GRID_ORIGIN[0] - lat) / CELL_LAT + 0.5) + 1
    if 1 <= x <= GRID_CELLS and 1 <= y <= GRID_CELLS:
        return x, y
    return None


@record_map
def in_zone(rec: Any, params: Dict[str, Any]) -> Any:
    """Keep trips that start and end inside the grid; annotate them with their cells."""
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
    return out


def identity(rec: Any) -> Any:
    """The trivial operator of the dataplane benchmark."""
    return rec


# ---- sinks --------------------------------------------------------------------------------------


def sink_ids_path(sink_dir: Path, instance: str) -> Path:
    return Path(sink_dir) / f"{instance}.ids"


class CountingSink(SinkOperator):
    """Records the id of every record it receives, once.

    Accounting contract (for verifiers, the demo and the chaos runs): every sink instance appends
    one line `<source instance> <source seq>` per NEW record id to `<sink_dir>/<instance>.ids`
    (written and flushed before the batch is acknowledged, so an acked record is on disk for a
    worker crash); a record id seen before (by this instance, including before a restart) is
    dropped and counted as `duplicates`. Across sink instances, `read_sink_ids` merges the files
    and reports ids that appear in more than one file as duplicated.
    """

    def __init__(self, ctx: OperatorContext) -> None:
        self.path = sink_ids_path(ctx.sink_dir, ctx.instance)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seen: Dict[str, Set[int]] = {}
        if self.path.exists():
            for src, seq in _read_ids(self.path):
                self.seen.setdefault(src, set()).add(seq)
        self._fh = open(self.path, "a", buffering=1 << 16)
        self.recorded = sum(len(s) for s in self.seen.values())
        self.duplicates = 0

    def record(self, items: List[Item]) -> List[Publication]:
        lines = []
        seen = self.seen
        for src, seq, _ in items:
            s = seen.get(src)
            if s is None:
                s = seen[src] = set()
            if seq in s:
                self.duplicates += 1  # duplicate record id: dropped before recording
                continue
            s.add(seq)
            lines.append(f"{src} {seq}\n")
        if lines:
            self._fh.write("".join(lines))
            self._fh.flush()  # in the OS page cache: survives a worker crash
            self.recorded += len(lines)
        return []

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def stats(self) -> Dict[str, Any]:
        return {"recorded": self.recorded, "duplicates_dropped": self.duplicates}


class _Factory:
    def __init__(self, build: Callable[[OperatorContext], Operator]) -> None:
        self.build = build


counting_sink = _Factory(CountingSink)


class NullSink(SinkOperator):
    """Counts and forgets (benchmarks: no id bookkeeping, so it measures the data path alone)."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.recorded = 0

    def record(self, items: List[Item]) -> List[Publication]:
        self.recorded += len(items)
        return []

    def stats(self) -> Dict[str, Any]:
        return {"recorded": self.recorded}


null_sink = _Factory(NullSink)


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
        body = {"ids": [[s, q] for s, q, _ in items], "records": [r for _, _, r in items]}
        self.published += len(items)
        return [Publication(self.topic, json.dumps(body, separators=(",", ":")).encode())]

    def stats(self) -> Dict[str, Any]:
        return {"published": self.published}


mqtt_sink = _Factory(MqttSink)


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
