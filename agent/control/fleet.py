"""Pure parsing of what the agents publish (retained state, status, latency, pipelines).

Why tolerant parsing: the daemon and fogctl are released separately and a Pi fleet is upgraded
node by node, so fogctl must show an older or newer agent's state instead of failing on it. Each
field is looked up under its documented key first (docs/fogctl.md "Payloads"), then under a few
obvious aliases; a missing number shows as "-". A payload that is not a JSON object is kept as an
`error` on its node, shown in the table, never a traceback.

Nothing here does I/O or reads a clock: `Fleet.from_messages(messages, now)` is a function of
the retained messages (topic -> payload bytes) and the time passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from agent import topics, wire
from agent.control.records import parse_record

__all__ = ["Phase", "LockState", "Instance", "Node", "Fleet", "parse_state", "parse_status", "parse_latency"]


class Phase(Enum):
    ACTIVE = "active"
    STARTING = "starting"
    TERMINATING = "terminating"
    UNKNOWN = "unknown"


class LockState(Enum):
    IDLE = "idle"
    REQUESTING = "requesting"
    IN_CS = "in_cs"


@dataclass(frozen=True)
class Instance:
    id: str
    operator: str
    node: str
    pipeline: Optional[str] = None
    keeper: bool = False
    phase: Phase = Phase.UNKNOWN
    load: Optional[float] = None
    capacity: Optional[float] = None
    lock: Optional[LockState] = None
    boundary: Optional[str] = None  # the 2-FGME boundary ("a|b") this instance's lock is about
    # Per boundary ("a|b", state): an instance of operator s is in the locks of s-1|s and s|s+1,
    # and may hold one while it requests the other. Empty for an older single-boundary payload.
    locks: Tuple[Tuple[str, LockState], ...] = ()

    @property
    def ratio(self) -> Optional[float]:
        if self.load is None or not self.capacity:
            return None
        return self.load / self.capacity

    def to_dict(self) -> Dict[str, Any]:
        return {
            "id": self.id, "operator": self.operator, "node": self.node, "pipeline": self.pipeline,
            "keeper": self.keeper, "phase": self.phase.value, "load": self.load,
            "capacity": self.capacity, "ratio": _round(self.ratio, 4),
            "lock": self.lock.value if self.lock else None, "boundary": self.boundary,
            "locks": {b: st.value for b, st in self.locks},
        }


@dataclass(frozen=True)
class Node:
    node: str
    status: str = "unknown"  # "online" | "offline" | "unknown" (no retained status)
    cpu: Optional[float] = None
    memory: Optional[float] = None
    temperature: Optional[float] = None
    slots: Optional[int] = None
    free_slots: Optional[int] = None
    capacity: Optional[float] = None
    instances: Tuple[Instance, ...] = ()
    ts: Optional[float] = None  # when the agent published its state (unix seconds)
    error: Optional[str] = None
    draining: bool = False  # fogctl drain: the node takes no new instance and hands its own over
    # fogctl scale pins this agent holds: ({"pipeline", "operator", "until" (unix s or None)}, ...)
    pins: Tuple[Dict[str, Any], ...] = ()

    def last_seen(self, now: float) -> Optional[float]:
        return None if self.ts is None else max(0.0, now - self.ts)

    @property
    def offline(self) -> bool:
        return self.status == "offline"

    def to_dict(self, now: float) -> Dict[str, Any]:
        # An offline node's retained state is its last word, not its present: its machine
        # figures would read as current, so they are left out (null), its age stays.
        live = not self.offline
        return {
            "node": self.node, "status": self.status, "draining": self.draining,
            "cpu": self.cpu if live else None, "memory": self.memory if live else None,
            "temperature": self.temperature if live else None, "slots": self.slots,
            "free_slots": self.free_slots if live else None,
            "capacity": self.capacity, "instances": [i.id for i in self.instances],
            "pins": [dict(p) for p in self.pins],
            "ts": self.ts, "last_seen_s": _round(self.last_seen(now), 3), "error": self.error,
        }


@dataclass(frozen=True)
class Fleet:
    cluster: str
    nodes: Tuple[Node, ...]
    latency: Dict[str, Dict[str, float]] = field(default_factory=dict)
    emulated: Dict[str, Dict[str, float]] = field(default_factory=dict)
    pipelines: Dict[str, str] = field(default_factory=dict)  # name -> TOML text

    @property
    def instances(self) -> List[Instance]:
        return [i for n in self.nodes for i in n.instances]

    def node(self, name: str) -> Optional[Node]:
        for n in self.nodes:
            if n.node == name:
                return n
        return None

    def operator_order(self, pipeline: Optional[str] = None) -> List[str]:
        """Operators in pipeline order when the pipeline TOML is retained, else by name."""
        order: List[str] = []
        names = [pipeline] if pipeline else sorted(self.pipelines)
        for name in names:
            text = self.pipelines.get(name or "")
            if text:
                order += [op for op in _operators_of(text) if op not in order]
        seen = sorted({i.operator for i in self.instances if pipeline is None or i.pipeline in (None, pipeline)})
        return order + [op for op in seen if op not in order]

    @classmethod
    def from_messages(cls, cluster: str, messages: Mapping[str, bytes]) -> "Fleet":
        states: Dict[str, Any] = {}
        statuses: Dict[str, str] = {}
        latency: Dict[str, Dict[str, float]] = {}
        emulated: Dict[str, Dict[str, float]] = {}
        pipelines: Dict[str, str] = {}
        for topic, payload in messages.items():
            parsed = topics.parse(cluster, topic)
            if parsed is None or not payload or parsed.node is None:
                continue
            name = parsed.node
            if parsed.kind == "state":
                states[name] = payload
            elif parsed.kind == "status":
                statuses[name] = parse_status(payload)
            elif parsed.kind == "latency":
                measured, emu = parse_latency(payload)
                if measured:
                    latency[name] = measured
                if emu:
                    emulated[name] = emu
            elif parsed.kind == "pipeline" and len(payload) <= wire.MAX_CONTROL_BYTES:
                if parse_record(payload).state == "undeployed":  # a tombstone
                    continue
                pipelines[name] = payload.decode("utf-8", "replace")
        # An instance whose state does not name its pipeline belongs to the one deployed pipeline
        # that has its operator, when there is exactly one.
        owners: Dict[str, List[str]] = {}
        for pname, text in pipelines.items():
            for op in _operators_of(text):
                owners.setdefault(op, []).append(pname)
        nodes = []
        for name in sorted(set(states) | set(statuses)):
            node = parse_state(name, states[name]) if name in states else Node(name)
            insts = tuple(_replace(i, pipeline=owners[i.operator][0])
                          if i.pipeline is None and len(owners.get(i.operator, ())) == 1 else i
                          for i in node.instances)
            nodes.append(_replace(node, status=statuses.get(name, "unknown"), instances=insts))
        return cls(cluster, tuple(nodes), latency, emulated, pipelines)


# ---- payload parsers ----------------------------------------------------------------------------


def parse_status(payload: bytes) -> str:
    """Retained status: the plain strings "online"/"offline", or {"status": ...} JSON."""
    text = payload.decode("utf-8", "replace").strip()
    if text.startswith("{"):
        try:
            text = str(wire.loads(payload, what="status", expect=dict).get("status", "unknown"))
        except ValueError:
            return "unknown"
    text = text.strip('"').lower()
    return text if text in ("online", "offline") else "unknown"


def parse_state(node: str, payload: bytes) -> Node:
    """A node's retained state for the views; anything unreadable (too large, too deep, not
    JSON, odd values) becomes a Node with `error` set, one table row, never an exception."""
    try:
        d = wire.loads(payload, what="state")
    except wire.BusInputError as exc:
        return Node(node, error=str(exc)[:160])
    if not isinstance(d, dict):
        return Node(node, error=f"state is a JSON {type(d).__name__}, expected an object")
    try:
        return _parse_state_doc(node, d)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        return Node(node, error=f"unreadable state ({type(exc).__name__}: {str(exc)[:120]})")


def _parse_state_doc(node: str, d: Dict[str, Any]) -> Node:
    # The topic names the node (the broker's ACL proves it); a payload naming another is ignored.
    name = node
    raw = d.get("instances") or []
    if isinstance(raw, dict):  # {"id": {...}} form
        raw = [dict(v, id=k) if isinstance(v, dict) else {"id": k} for k, v in raw.items()]
    instances = []
    for item in raw if isinstance(raw, list) else []:
        inst = _instance(name, item, d)
        if inst is not None:
            instances.append(inst)
    slots = _int(d, "slots", "slots_total")
    free = _int(d, "free_slots", "slots_free", "free")
    if free is None and slots is not None:
        free = max(0, slots - len(instances))
    return Node(
        node=name,
        cpu=_num(d, "cpu", "cpu_percent"),
        memory=_num(d, "memory", "mem", "memory_percent", "mem_percent"),
        temperature=_num(d, "temperature", "temp", "temperature_c"),
        slots=slots,
        free_slots=free,
        capacity=_node_capacity(d, instances),
        instances=tuple(sorted(instances, key=lambda i: (i.operator, i.id))),
        ts=_num(d, "ts", "time", "timestamp"),
        draining=d.get("draining") is True,
        pins=_pins(d.get("pins")),
    )


def _pins(raw: Any) -> Tuple[Dict[str, Any], ...]:
    """The `pins` list of a state, each reduced to its documented keys (bus input: odd items skipped)."""
    out = []
    for p in raw[:64] if isinstance(raw, list) else []:
        if not isinstance(p, dict) or not isinstance(p.get("operator"), str) or not p["operator"]:
            continue
        pipeline = p.get("pipeline") if isinstance(p.get("pipeline"), str) else None
        until = p.get("until") if _isnum(p.get("until")) else None
        out.append({"operator": p["operator"][:80], "pipeline": pipeline and pipeline[:80], "until": until})
    return tuple(out)


def _node_capacity(d: Mapping[str, Any], instances: Sequence[Instance]) -> Optional[float]:
    """The node's published capacity, else its measurement's, else what its instances sustain."""
    cap = _num(d, "capacity", "node_capacity")
    if cap is None and isinstance(d.get("measure"), dict):
        cap = _num(d["measure"], "capacity", "capacity_rps")
    if cap is None:
        caps = [i.capacity for i in instances if i.capacity is not None]
        cap = sum(caps) if caps else None
    return cap


def _instance(node: str, item: Any, state: Mapping[str, Any]) -> Optional[Instance]:
    if isinstance(item, str):
        return Instance(id=item, operator=item.rsplit("-", 1)[0], node=node)
    if not isinstance(item, dict):
        return None
    iid = item.get("id") or item.get("instance")
    if not isinstance(iid, str) or not iid:
        return None
    operator = item.get("operator") if isinstance(item.get("operator"), str) else iid.rsplit("-", 1)[0]
    stats = item.get("stats") if isinstance(item.get("stats"), dict) else {}
    pipeline = next((v for v in (item.get("pipeline"), stats.get("pipeline"), state.get("pipeline"))
                     if isinstance(v, str) and v), None)
    if pipeline is None and iid.count(".") == 2 and iid.split(".")[1] == operator:
        pipeline = iid.split(".")[0]  # a keeper's id is "<pipeline>.<operator>.0" (fog-agent deploy)
    lock_raw = item.get("lock")
    if lock_raw is None and isinstance(stats.get("lock"), dict):
        lock_raw = stats["lock"]  # an agent that only forwards the worker's heartbeat stats
    lock = boundary = None
    per: List[Tuple[str, LockState]] = []
    if isinstance(lock_raw, dict):
        lock = _lock_state(lock_raw.get("state"))
        boundary = lock_raw.get("boundary") if isinstance(lock_raw.get("boundary"), str) else None
        for b in lock_raw.get("boundaries") or [] if isinstance(lock_raw.get("boundaries"), list) else []:
            st = _lock_state(b.get("state")) if isinstance(b, dict) else None
            if st is not None and isinstance(b.get("boundary"), str):
                per.append((b["boundary"], st))
    elif isinstance(lock_raw, str):
        lock = _lock_state(lock_raw)
        boundary = item.get("boundary") if isinstance(item.get("boundary"), str) else None
    return Instance(
        id=iid, operator=operator, node=node,
        pipeline=pipeline if isinstance(pipeline, str) else None,
        keeper=bool(item.get("keeper", False)),
        phase=_phase(item),
        load=_num(item, "load", "load_rate", "rate") if _num(item, "load", "load_rate", "rate") is not None else _num(stats, "load"),
        capacity=_num(item, "capacity") if _num(item, "capacity") is not None else _num(stats, "capacity"),
        lock=lock, boundary=boundary, locks=tuple(per),
    )


def _phase(item: Mapping[str, Any]) -> Phase:
    for key in ("phase", "state", "status"):
        v = item.get(key)
        if isinstance(v, str):
            try:
                return Phase(v.lower())
            except ValueError:
                if v.lower() in ("ready", "running"):
                    return Phase.ACTIVE
                if v.lower() in ("draining", "stopping", "leaving"):
                    return Phase.TERMINATING
    if item.get("terminating"):
        return Phase.TERMINATING
    if item.get("starting"):
        return Phase.STARTING
    if "active" in item:
        return Phase.ACTIVE if item.get("active") else Phase.STARTING
    return Phase.UNKNOWN


def _lock_state(v: Any) -> Optional[LockState]:
    try:
        return LockState(str(v).lower())
    except ValueError:
        return None


def parse_latency(payload: bytes) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Retained latency of one node: ({peer: measured RTT ms}, {peer: emulated delay ms})."""
    try:
        d = wire.loads(payload, what="latency", expect=dict)
    except wire.BusInputError:
        return {}, {}
    measured = _peer_map(d, ("rtt_ms", "measured", "peers", "rtt"))
    emulated = _peer_map(d, ("emulated_ms", "emulated", "netem_ms", "configured"))
    if not measured and not emulated:  # a flat {peer: ms} object
        measured = {k: float(v) for k, v in d.items() if _isnum(v) and k not in ("ts", "v")}
    return measured, emulated


def _peer_map(d: Mapping[str, Any], keys: Sequence[str]) -> Dict[str, float]:
    for k in keys:
        v = d.get(k)
        if isinstance(v, dict):
            out: Dict[str, float] = {}
            for peer, ms in v.items():
                if isinstance(ms, dict):
                    ms = next((ms[x] for x in ("rtt_ms", "ms", "mean", "value") if _isnum(ms.get(x))), None)
                if _isnum(ms):
                    out[str(peer)] = float(ms)
            return out
    return {}


def _operators_of(text: str) -> List[str]:
    try:
        from agent.schema import tomllib

        data = tomllib.loads(text)
    except Exception:  # a malformed retained pipeline must not break `status`
        return []
    ops = data.get("operator")
    if not isinstance(ops, list):  # `operator = 5` in a hostile retained pipeline
        return []
    return [op["name"] for op in ops if isinstance(op, dict) and isinstance(op.get("name"), str)]


def _isnum(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(d: Mapping[str, Any], *keys: str) -> Optional[float]:
    for k in keys:
        v = d.get(k)
        if isinstance(v, dict):  # {"percent": 12.5} style
            v = next((v[x] for x in ("percent", "value", "celsius", "used_percent") if _isnum(v.get(x))), None)
        if _isnum(v):
            return float(v)
    return None


def _int(d: Mapping[str, Any], *keys: str) -> Optional[int]:
    v = _num(d, *keys)
    return None if v is None else int(v)


def _round(v: Optional[float], digits: int) -> Optional[float]:
    return None if v is None else round(v, digits)


def _replace(node: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(node, **changes)


def state_decisions(cluster: str, topic: str, payload: bytes) -> List[Any]:
    """Scaling decisions an agent's retained state carries (worker stats `decisions`), as events.

    Why: workers keep their recent decisions (time, kind, load, new instances) in the heartbeat
    stats that the agent republishes in its state, so `watch` and `why` can explain a scale-out
    even before workers publish decision events on `fog/<cluster>/events`. These events carry
    load, capacity and ratio but no probability or draw (the state does not record them), and
    `detail.source = "state"`. A forced decision (`fogctl scale`, a drain's scale-in: the worker
    records no load for it) has no reason; its detail says `cause: "forced"` and the action.
    """
    parsed = topics.parse(cluster, topic)
    if parsed is None or parsed.kind != "state" or not payload:
        return []
    node_name = str(parsed.node)
    try:
        d = wire.loads(payload, what="state", expect=dict)
    except wire.BusInputError:
        return []
    node = parse_state(node_name, payload)
    try:
        return _state_decisions(d, node)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, ZeroDivisionError):
        return []  # a hostile or odd state: no decisions from it, never a traceback


def _state_decisions(d: Dict[str, Any], node: Node) -> List[Any]:
    from agent.events import Event, EventType, Reason

    stats_by_id: Dict[str, Any] = {}
    raw = d.get("instances") or []
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("stats"), dict):
                stats_by_id[str(item.get("id") or item.get("instance"))] = item["stats"]
    out = []
    for inst in node.instances:
        stats = stats_by_id.get(inst.id, {})
        for dec in stats.get("decisions") or []:
            if not isinstance(dec, dict) or not _isnum(dec.get("at")):
                continue
            forced = dec.get("forced") is True
            if not _isnum(dec.get("load")) and not forced:
                continue
            kind = dec.get("kind")
            etype = {"scale_out": EventType.SCALE_OUT, "scale_in": EventType.SCALE_IN}.get(kind, EventType.DECISION)
            new = [str(x) for x in dec.get("new") or []]
            action = {"scale_out": "duplicate", "scale_in": "terminate"}.get(str(kind), "none")
            reason = None
            if _isnum(dec.get("load")):
                cap = _num(dec, "capacity") or _num(stats, "capacity") or inst.capacity or 0.0
                load = float(dec["load"])
                reason = Reason(load=load, capacity=cap, ratio=load / cap if cap else 0.0,
                                probability=_num(dec, "probability", "p"), draw=_num(dec, "draw"),
                                action=action, count=len(new) if new else (1 if action == "terminate" else 0))
            detail: Dict[str, Any] = {"source": "state"}
            if forced:
                detail.update(cause="forced", action=action)
            if new:
                detail["new"] = new
            out.append(Event(ts=float(dec["at"]), node=node.node, type=etype, instance=inst.id,
                             operator=inst.operator, pipeline=inst.pipeline, reason=reason, detail=detail))
    return sorted(out, key=lambda e: e.ts)
