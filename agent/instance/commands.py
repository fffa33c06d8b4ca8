"""What an instance asks its shell to do: the outputs of `Instance.handle` (sans-IO).

Rules of this file: frozen dataclasses under one base class; no I/O. The shell performs the
commands of one `handle` call in list order and finishes each before the next (a `Persist` before
the publishes it protects: write-ahead, agent.instance.recovery).

Publishing contract. A tracked `Publish` carries a `token`; the shell answers each with
`PublishAccepted(token, mid)` or `PublishRefused(token)` before the next event. Once one tracked
publish of a list is refused, the shell refuses every later tracked publish of that list without
trying (so the instance's retry queue keeps the channel order). `Notify` is fire-and-forget
(events, retained decision history): a failure is the shell's to count, never the instance's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

__all__ = ["Command", "Publish", "Handoff", "Notify", "RequestSpawn", "Persist", "PersistSource", "AckIngest",
           "LogIngest", "SaveKeyed", "SaveRoutes", "Emit", "CrashPoint", "Exit"]


class Command:
    """Base class of every output of an `Instance`."""

    __slots__ = ()


@dataclass(frozen=True)
class Publish(Command):
    """A QoS 1 message on a data channel (an inbox): data, acks, protocol messages."""

    topic: str
    payload: bytes
    token: int


@dataclass(frozen=True)
class Handoff(Command):
    """An envelope for an instance hosted by the same process (a chained link, docs/runtime.md
    "Chaining"): the shell gives it to that instance as `EnvelopeHanded`, in the order of the
    commands, with no encoding and no broker. Never refused and never PUBACKed: the sender's
    replay buffer keeps a data batch until the receiver acks it, as over MQTT."""

    dest: str
    envelope: Any  # agent.dataplane.envelope.Envelope


@dataclass(frozen=True)
class Notify(Command):
    """A message outside the data channels (events, retained history), not tracked."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False


@dataclass(frozen=True)
class RequestSpawn(Command):
    """createNode(): ask the agent for a new instance; it answers with `Spawned(request, ...)`."""

    request: str
    spec: Dict[str, Any]


@dataclass(frozen=True)
class Persist(Command):
    """Write the instance's state atomically; a `Restarted` event gives it back."""

    state: Dict[str, Any]


@dataclass(frozen=True)
class PersistSource(Command):
    """Write a source's restart position (and its counters) atomically."""

    data: Dict[str, Any]


@dataclass(frozen=True)
class AckIngest(Command):
    """PUBACK these deliveries of the source's ingest topic ((mid, qos) each): their records are
    acked by a successor, so the broker may forget them. Until then they stay unacked in the
    instance's ingest session, and a new incarnation gets them again."""

    tokens: Tuple[Tuple[int, int], ...]


@dataclass(frozen=True)
class LogIngest(Command):
    """Append these [seq, digest, record] entries to the source's ingest log and sync it, before
    the records leave (they precede their Publish commands): a restarted source sends them again
    under the same numbers, so a successor that had them drops the copies by id. `keep_from`: the
    entries below it are acked downstream and may go when the log is compacted."""

    entries: Tuple[Any, ...]
    keep_from: int


@dataclass(frozen=True)
class SaveKeyed(Command):
    """Save a keyed operator's state (agent.instance.keyed_state: full file or delta). It carries
    the state object itself, whose `save` writes the files: not yet a value (docs/runtime.md)."""

    state: Any


@dataclass(frozen=True)
class SaveRoutes(Command):
    """Where the records about to be sent go (agent.dataplane.sticky.RouteMemory.take_save):
    with `snapshot`, replace the routes file with it and empty the routes log; then append `log`
    to the log. Performed before the publishes that follow it (write-ahead, invariant 8)."""

    snapshot: Optional[str]
    log: str


@dataclass(frozen=True)
class Emit(Command):
    """A control line to the agent ("ready", "heartbeat", "spawn" is `RequestSpawn`, ...)."""

    event: str
    fields: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CrashPoint(Command):
    """A named point where the tests' fault injection may kill the process (extra.crash_at)."""

    name: str


@dataclass(frozen=True)
class Exit(Command):
    """The instance is done: close the connection (`final`: gone for good) and exit with `code`."""

    code: int
    reason: str
    final: bool = False
