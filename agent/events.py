"""Scaling and lock events on `fog/<cluster>/events`: one tiny pure builder and parser.

Why a schema of its own: `fogctl watch`, `fogctl why`, the spill to Spark and a person running
`mosquitto_sub -v -t 'fog/+/events'` all read the same line, so every publisher must write the
same keys. An event answers "why did it scale?" by carrying the numbers the decision was made
from (load, capacity, ratio, probability, draw), not only its outcome.

Payload (JSON object, keys sorted, one event per MQTT message, QoS 0 or 1, never retained):

    {"v": 1, "ts": 1700000000.123, "node": "n1", "instance": "in_zone-2", "operator": "in_zone",
     "pipeline": "taxi", "type": "scale_out",
     "reason": {"load": 560.0, "capacity": 500.0, "ratio": 1.12, "probability": 0.6,
                "draw": 0.31, "count": 1},
     "detail": {"new": ["in_zone-7"]}}

`type` is an `EventType` value. `reason` is present on decisions (null otherwise); `detail` is a
free-form object (peer instance, boundary of a lock, ...). Unknown extra keys are ignored by the
parser so that publishers can add fields without breaking older readers.

Usage (publisher side):
    ev = events.decision(ts=now, node="n1", instance="in_zone-2", operator="in_zone",
                         load=560, capacity=500, probability=0.6, draw=0.31, action="duplicate",
                         count=1)
    client.publish(topics.events(cluster), ev.to_json(), qos=1)

`fogctl why` reads the last decisions of an instance from the retained topic
`topics.decisions(cluster, instance)` (a JSON array of events, newest last); `remember()` keeps
that array bounded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Sequence

from agent import wire

__all__ = [
    "SCHEMA_VERSION",
    "EventType",
    "Reason",
    "Event",
    "EventError",
    "make",
    "decision",
    "parse",
    "parse_history",
    "remember",
    "HISTORY_LENGTH",
    "changes_something",
]

SCHEMA_VERSION = 1
HISTORY_LENGTH = 10


class EventError(ValueError):
    """An event payload does not match the schema (says which key and what was found)."""


class EventType(Enum):
    DECISION = "decision"          # a periodic scaling decision (also when it decides nothing)
    SCALE_OUT = "scale_out"        # a duplication started (detail.new = the new instance ids)
    SCALE_IN = "scale_in"          # a termination started
    SPAWNED = "spawned"            # the new instance is active
    TERMINATED = "terminated"      # the instance left (after drain)
    REFUSED = "refused"            # a scaling or steering request was refused (detail.error)
    LOCK_REQUEST = "lock_request"  # 2-FGME: asks for the CS of a boundary (detail.boundary)
    LOCK_ENTER = "lock_enter"      # 2-FGME: entered the CS
    LOCK_EXIT = "lock_exit"        # 2-FGME: left the CS
    DRAIN = "drain"                # a node drain started / progressed (detail.node)
    STEER = "steer"                # a manual `fogctl scale` request was accepted
    SITE_ACTION = "site_action"    # the site manager ordered drain/release/acquire/undrain (detail.reason)
    SPOOL_FULL = "spool_full"      # a spool reached its disk cap: the sink holds back (detail.used_bytes)
    SPOOL_RESUMED = "spool_resumed"  # shipped files were released: the spool takes records again
    SPOOL_RECOVERED = "spool_recovered"  # a crash left spool files open: salvaged (detail.records)


@dataclass(frozen=True)
class Reason:
    """The numbers a decision was made from (paper: l_t, C, l_t/C, p and the uniform draw)."""

    load: float
    capacity: float
    ratio: float
    probability: Optional[float] = None
    draw: Optional[float] = None
    action: Optional[str] = None  # "duplicate" | "terminate" | "none"
    count: int = 0

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"load": self.load, "capacity": self.capacity, "ratio": self.ratio}
        for k in ("probability", "draw", "action"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        out["count"] = self.count
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "Reason":
        if not isinstance(d, Mapping):
            raise EventError(f"reason: expected an object, found {type(d).__name__}")
        try:
            return cls(
                load=_num(d, "load"),
                capacity=_num(d, "capacity"),
                ratio=_num(d, "ratio"),
                probability=_num(d, "probability", optional=True),
                draw=_num(d, "draw", optional=True),
                action=_str(d, "action", optional=True),
                count=int(_num(d, "count", optional=True) or 0),
            )
        except EventError as exc:
            raise EventError(f"reason.{exc}") from None


@dataclass(frozen=True)
class Event:
    ts: float
    node: str
    type: EventType
    instance: Optional[str] = None
    operator: Optional[str] = None
    pipeline: Optional[str] = None
    reason: Optional[Reason] = None
    detail: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.type, EventType):
            raise EventError(f"type: expected an EventType, found {self.type!r}")
        if not isinstance(self.node, str) or not self.node:
            raise EventError(f"node: expected a non-empty string, found {self.node!r}")

    def to_dict(self) -> Dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "ts": self.ts,
            "node": self.node,
            "instance": self.instance,
            "operator": self.operator,
            "pipeline": self.pipeline,
            "type": self.type.value,
            "reason": self.reason.to_dict() if self.reason is not None else None,
            "detail": dict(self.detail),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Any) -> "Event":
        if not isinstance(d, Mapping):
            raise EventError(f"event: expected a JSON object, found {type(d).__name__}")
        raw_type = d.get("type")
        try:
            etype = EventType(raw_type)
        except ValueError:
            allowed = ", ".join(t.value for t in EventType)
            raise EventError(f"type: expected one of {allowed}, found {raw_type!r}") from None
        reason = d.get("reason")
        detail = d.get("detail") or {}
        if not isinstance(detail, Mapping):
            raise EventError(f"detail: expected an object, found {type(detail).__name__}")
        return cls(
            ts=_num(d, "ts"),
            node=_str(d, "node"),  # type: ignore[arg-type]
            type=etype,
            instance=_str(d, "instance", optional=True),
            operator=_str(d, "operator", optional=True),
            pipeline=_str(d, "pipeline", optional=True),
            reason=Reason.from_dict(reason) if reason is not None else None,
            detail=dict(detail),
        )


def _num(d: Mapping[str, Any], key: str, optional: bool = False) -> Any:
    v = d.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise EventError(f"{key}: expected a finite number, found {v!r}")
    return float(v)


def _str(d: Mapping[str, Any], key: str, optional: bool = False) -> Optional[str]:
    v = d.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v:
        raise EventError(f"{key}: expected a non-empty string, found {v!r}")
    return v


def make(
    type: str,
    *,
    ts: float,
    node: str,
    instance: Optional[str] = None,
    operator: Optional[str] = None,
    pipeline: Optional[str] = None,
    detail: Optional[Mapping[str, Any]] = None,
    reason: Optional[Reason] = None,
) -> Event:
    """Any event; `type` is an EventType value such as "lock_enter"."""
    return Event(
        ts=ts, node=node, type=EventType(type), instance=instance, operator=operator,
        pipeline=pipeline, reason=reason, detail=dict(detail or {}),
    )


def decision(
    *,
    ts: float,
    node: str,
    instance: str,
    operator: str,
    load: float,
    capacity: float,
    probability: Optional[float] = None,
    draw: Optional[float] = None,
    action: str = "none",
    count: int = 0,
    pipeline: Optional[str] = None,
    type: str = "decision",
    detail: Optional[Mapping[str, Any]] = None,
) -> Event:
    """A decision with its reason; use type="scale_out"/"scale_in" when it acted."""
    ratio = load / capacity if capacity > 0 else float("inf")
    reason = Reason(load=float(load), capacity=float(capacity), ratio=ratio if math.isfinite(ratio) else 0.0,
                    probability=probability, draw=draw, action=action, count=count)
    return make(type, ts=ts, node=node, instance=instance, operator=operator, pipeline=pipeline,
                reason=reason, detail=detail)


def parse(payload: Any) -> Event:
    """Decode one event payload (bytes, str or dict); raises EventError, never anything else."""
    if isinstance(payload, (bytes, bytearray, memoryview, str)):
        try:  # bus input: bounded in size and depth before parsing (agent.wire)
            payload = wire.loads(payload, what="event")
        except wire.BusInputError as exc:
            raise EventError(str(exc)) from None
    return Event.from_dict(payload)


def parse_history(payload: Any) -> List[Event]:
    """Decode the retained decision history of an instance (JSON array of events)."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        payload = bytes(payload).decode("utf-8", "replace")
    if isinstance(payload, str):
        if not payload.strip():
            return []
        try:  # bus input: bounded in size and depth before parsing (agent.wire)
            payload = wire.loads(payload, what="history")
        except wire.BusInputError as exc:
            raise EventError(str(exc)) from None
    if not isinstance(payload, list):
        raise EventError(f"history: expected a JSON array, found {type(payload).__name__}")
    return [Event.from_dict(d) for d in payload]


def changes_something(event: Event) -> bool:
    """Whether the event reports a change (a scaling round, a spawn, a termination, a drain, a
    lock step, a refusal, a spool state), as opposed to the periodic "nothing to do" decision
    every instance publishes (docs/fogctl.md, "watch"): `fogctl watch` shows only these unless
    `--all` is given, so a quiet fleet prints nothing."""
    if event.type is not EventType.DECISION:
        return True
    r = event.reason
    return r is not None and r.action not in (None, "none")


def remember(history: Sequence[Event], event: Event, keep: int = HISTORY_LENGTH) -> List[Event]:
    """The bounded history after `event` (newest last); publish `[e.to_dict() for e in ...]`."""
    return (list(history) + [event])[-keep:]
