"""What happens to an instance: the inputs of `agent.instance.core.Instance.handle` (sans-IO).

Rules of this file: frozen dataclasses under one base class, checked in the constructor; no I/O.
The worker process (agent.instance.worker) turns paho callbacks, control lines from its agent and
its timers into these; the interleaving checker (foglab.sim.instance_check) makes them up.
Time is not an event field: `handle(event, now)` carries the monotonic clock, and `Tick.wall`
the wall clock (timestamps and epoch plausibility only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "Event", "Started", "Restarted", "EnvelopeReceived", "EnvelopeHanded", "PublishAccepted", "PublishRefused",
    "PubAcked", "SessionLost", "Spawned", "Control", "Tick", "Abort",
]


class Event:
    """Base class of every input of an `Instance`."""

    __slots__ = ()


@dataclass(frozen=True)
class Started(Event):
    """A fresh instance is subscribed to its inbox (and, for a source, to its topic)."""

    wall: float


@dataclass(frozen=True)
class Restarted(Event):
    """The same identity starts again: `state` is what its last `Persist` wrote (empty when the
    file was missing or damaged); `source_position` what its last `PersistSource` wrote."""

    wall: float
    state: Dict[str, Any] = field(default_factory=dict)
    source_position: Optional[Dict[str, Any]] = None
    keyed: Optional[Dict[str, Any]] = None  # a keyed operator's saved state (KeyedState.load)
    # what the last `SaveRoutes` commands left: (routes file text, routes log text), None if absent
    routes: Tuple[Optional[str], Optional[str]] = (None, None)
    # a sensor source's ingest log (`LogIngest`): [seq, digest, record] entries, oldest first
    ingest_log: Optional[List[Any]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.state, dict):
            raise TypeError(f"Restarted.state: expected a dict, found {type(self.state).__name__}")


@dataclass(frozen=True)
class EnvelopeReceived(Event):
    """One MQTT message on one of our subscriptions (the inbox, or a source's ingest topic).
    token: (mid, qos) of an ingest delivery the shell must PUBACK once the core says so
    (`AckIngest`); None when there is nothing to ack. dup: the broker sends it again."""

    topic: str
    payload: bytes
    token: Optional[Tuple[int, int]] = None
    dup: bool = False


@dataclass(frozen=True)
class EnvelopeHanded(Event):
    """An envelope from an instance hosted by the same process (a chained link, the shell's
    `Handoff`): built by its sender, nothing to decode; admitted like one from the broker."""

    envelope: Any  # agent.dataplane.envelope.Envelope


@dataclass(frozen=True)
class PublishAccepted(Event):
    """The client took the tracked `Publish` with `token`; the broker will PUBACK `mid`."""

    token: int
    mid: int


@dataclass(frozen=True)
class PublishRefused(Event):
    """The client refused the tracked `Publish` with `token` (its queue is full): keep it, in order."""

    token: int
    reason: str = ""


@dataclass(frozen=True)
class PubAcked(Event):
    """The broker acknowledged message `mid` (QoS 1)."""

    mid: int


@dataclass(frozen=True)
class SessionLost(Event):
    """Reconnected, but the broker kept no session for us: what it held for us may be gone."""


@dataclass(frozen=True)
class Spawned(Event):
    """The agent's answer to a `RequestSpawn`."""

    request: str
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class Control(Event):
    """A control line from the agent ("stop", "scale", "set", "eof"); see agent.instance.spec."""

    message: Dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.message, dict) or not isinstance(self.message.get("event"), str):
            raise TypeError(f"Control: expected a dict with a string 'event', found {self.message!r}")


@dataclass(frozen=True)
class Tick(Event):
    """The loop turned: do whatever is due (process, flush, ack, decide, persist, ...)."""

    wall: float


@dataclass(frozen=True)
class Abort(Event):
    """Exit now without draining (a second SIGTERM while draining)."""

    reason: str
