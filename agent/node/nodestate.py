"""The agent's retained node state: what other agents, fogctl and the demo know about a node.

Published retained on `fog/<cluster>/agents/<node>/state` so that a newcomer (an agent that just
started, `fog-agent deploy`, `fogctl`) learns the whole fleet from one subscription without asking
anybody. Building the JSON is pure (`build_node_state`); reading the machine (`sample_machine`)
uses `agent.measure.resources` (richer psutil measurements, issue 6) when it is installed, else a
minimal psutil fallback, so the daemon never depends on that module being present.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from agent import wire
from agent.node.placement import NodeView

STATE_VERSION = 1


@dataclass(frozen=True)
class MachineSample:
    """One reading of the node: cpu percent (whole machine), memory percent, temperature (C)."""

    cpu: float
    memory: float
    temperature: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceInfo:
    """One hosted instance as shown in the state (status: starting, active, terminating)."""

    id: str
    operator: str
    keeper: bool
    status: str
    load: Optional[float] = None
    capacity: Optional[float] = None
    pid: Optional[int] = None
    stats: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        d = {
            "id": self.id,
            "operator": self.operator,
            "keeper": self.keeper,
            "status": self.status,
            "load": self.load,
            "capacity": self.capacity,
            "pid": self.pid,
            "stats": self.stats,
        }
        # 2-FGME state (coordination = "fgme"): the worker's own view, under the documented key
        # fogctl reads (docs/fogctl.md): {"state": ..., "boundaries": [{"boundary": "a|b", ...}]}.
        lock = self.stats.get("lock") if isinstance(self.stats, dict) else None
        if isinstance(lock, dict):
            d["lock"] = lock
        return d


def build_node_state(
    node: str,
    slots: int,
    instances: Sequence[InstanceInfo],
    machine: MachineSample,
    now: float,
) -> Dict[str, Any]:
    """The retained JSON document (a dict); `now` is wall-clock seconds, passed in."""
    used = len(instances)
    doc: Dict[str, Any] = {
        "version": STATE_VERSION,
        "node": node,
        "time": round(now, 3),
        "cpu": round(machine.cpu, 1),
        "memory": round(machine.memory, 1),
        "slots": slots,
        "free_slots": max(0, slots - used),
        "instances": [i.to_dict() for i in sorted(instances, key=lambda i: i.id)],
    }
    if machine.temperature is not None:
        doc["temperature"] = round(machine.temperature, 1)
    if machine.extra:
        doc["measure"] = machine.extra
    return doc


def encode_state(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def parse_node_state(payload: bytes) -> Dict[str, Any]:
    """Decode a state payload; raise ValueError (wire.BusInputError) with the reason if it is not
    one. Bounded in size and depth before parsing: a neighbour's state is bus input."""
    doc = wire.loads(payload, what="node state", expect=dict)
    if not isinstance(doc.get("node"), str):
        raise ValueError("node state without a 'node' string")
    if not isinstance(doc.get("slots"), int) or not isinstance(doc.get("free_slots"), int):
        raise ValueError("node state without integer 'slots' and 'free_slots'")
    if not isinstance(doc.get("instances", []), list):
        raise ValueError("node state 'instances' is not a list")
    return doc


def node_view(doc: Mapping[str, Any], online: bool = True, latency_ms: Optional[Mapping[str, float]] = None,
              max_slots: Optional[int] = None) -> NodeView:
    """The placement view of a parsed state document (bus input, the node's own word). With
    `max_slots` (what the admin gave that node, `[security] node_slots`) it offers at most that
    many slots less the instances it lists: a node that claims more free slots than it has would
    otherwise be every placement's first choice."""
    ids: List[str] = [str(i.get("id")) for i in doc.get("instances", []) if isinstance(i, dict)]
    slots, free = int(doc["slots"]), int(doc["free_slots"])
    if max_slots is not None:
        slots = min(slots, max_slots)
        free = max(0, min(free, slots - len(ids)))
    return NodeView(
        node=str(doc["node"]),
        slots=slots,
        free_slots=free,
        online=online,
        latency_ms=dict(latency_ms or {}),
        instances=tuple(ids),
    )


def parse_latency(payload: bytes) -> Dict[str, float]:
    """RTTs in ms from a retained latency document; accepts {peer: ms} or {"rtt_ms": {peer: ms}}.

    The latency publisher belongs to the measurement area (issue 6); this reader is deliberately
    lenient so that a format change there degrades placement to 'unmeasured', never crashes it.
    """
    try:
        doc = wire.loads(payload, what="latency record", expect=dict)
    except wire.BusInputError:
        return {}
    for key in ("rtt_ms", "latency_ms", "peers", "rtt"):
        if isinstance(doc.get(key), dict):
            doc = doc[key]
            break
    out: Dict[str, float] = {}
    for peer, value in doc.items():
        if isinstance(value, dict):
            value = value.get("rtt_ms", value.get("ms", value.get("rtt")))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(peer)] = float(value)
    return out


def sample_machine(pids: Sequence[int] = ()) -> MachineSample:
    """Read cpu/memory/temperature now (I/O: psutil or agent.measure.resources); `pids`: workers."""
    try:
        from agent.measure import resources as measure  # issue 6; optional
    except ImportError:
        measure = None  # type: ignore[assignment]
    if measure is not None:
        sample = _from_measure(measure, pids)
        if sample is not None:
            return sample
    return _psutil_sample()


def _from_measure(measure: Any, pids: Sequence[int]) -> Optional[MachineSample]:
    for name in ("measure_node",):
        fn = getattr(measure, name, None)
        if callable(fn):
            try:
                raw = fn(list(pids))
            except Exception:  # a broken optional module must not stop the daemon
                return None
            data = raw if isinstance(raw, dict) else getattr(raw, "__dict__", {})
            if not isinstance(data, dict):
                return None
            cpu = data.get("cpu", data.get("cpu_percent"))
            mem = data.get("memory", data.get("memory_percent", data.get("mem")))
            if not isinstance(cpu, (int, float)) or not isinstance(mem, (int, float)):
                return None
            temp = data.get("temperature", data.get("temp"))
            extra = {k: v for k, v in data.items() if k not in ("cpu", "memory", "temperature")}
            return MachineSample(float(cpu), float(mem), float(temp) if isinstance(temp, (int, float)) else None, extra)
    return None


def _psutil_sample() -> MachineSample:
    import psutil

    cpu = psutil.cpu_percent(interval=None)
    mem = psutil.virtual_memory().percent
    temp: Optional[float] = None
    try:
        temps = psutil.sensors_temperatures()  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        temps = {}
    for entries in (temps or {}).values():
        if entries:
            temp = float(entries[0].current)
            break
    return MachineSample(float(cpu), float(mem), temp)


__all__ = [
    "InstanceInfo",
    "MachineSample",
    "build_node_state",
    "encode_state",
    "node_view",
    "parse_latency",
    "parse_node_state",
    "sample_machine",
]
