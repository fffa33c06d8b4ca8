"""What reaches the daemon's loop from the other threads (gunicorn's arbiter habit: the signal
handlers, paho's network thread and the workers' reader threads only enqueue one of these; the
loop, which owns all state, dispatches each by its type through one table, `Agent._LOOP`, and
hands what the node decides on to agent.node.core).

Rules of this file: frozen values, no I/O; an event carries what its thread saw, converted
(paho's reason codes as text), never a callback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoopEvent:
    """Base of everything the loop's queue holds."""


@dataclass(frozen=True)
class MqttMessage(LoopEvent):
    msg: Any  # paho's MQTTMessage (topic, payload, retain, properties)


@dataclass(frozen=True)
class Puback(LoopEvent):
    mid: int


@dataclass(frozen=True)
class Connected(LoopEvent):
    """A CONNACK: `ok` false when the broker refused the connection (`reason`)."""

    ok: bool
    reason: str
    session_present: bool


@dataclass(frozen=True)
class ConnectFailed(LoopEvent):
    """A failed (re)connect that paho retries by itself."""

    why: str


@dataclass(frozen=True)
class PahoError(LoopEvent):
    """paho's last error log line: the cause of the next disconnect (a TLS alert, ...)."""

    why: str


@dataclass(frozen=True)
class Disconnected(LoopEvent):
    reason: str


@dataclass(frozen=True)
class WorkerLine(LoopEvent):
    """One line a worker wrote on its stdout (the member of a chain that named itself)."""

    instance: str
    line: str


@dataclass(frozen=True)
class WorkerEof(LoopEvent):
    """A worker's stdout closed: every line it wrote is in the queue before this."""

    instance: str


@dataclass(frozen=True)
class Signalled(LoopEvent):
    """SIGTERM or SIGINT (or `request_stop`): shut down."""

    signum: int


@dataclass(frozen=True)
class Reload(LoopEvent):
    """SIGHUP: re-read what can change in place."""

    signum: int


__all__ = ["ConnectFailed", "Connected", "Disconnected", "LoopEvent", "MqttMessage", "PahoError", "Puback",
           "Reload", "Signalled", "WorkerEof", "WorkerLine"]
