"""An MQTT client for an agent object connected to no broker (tests of the daemon's own logic):
it records what the agent publishes and subscribes nothing; the test hands the agent the broker's
messages itself (`Agent._on_message`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Tuple


class RecordingClient:
    def __init__(self) -> None:
        self.sent: List[Tuple[str, bytes]] = []

    def subscribe(self, subs: Any) -> None:
        pass

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Any = None) -> Any:
        self.sent.append((topic, payload))
        return SimpleNamespace(rc=0)

    def on(self, topic: str) -> List[bytes]:
        """What was published on `topic`, oldest first."""
        return [p for t, p in self.sent if t == topic]


def message(topic: str, payload: bytes, retain: bool = False) -> Any:
    """A received message as the agent's `_on_message` reads it."""
    return SimpleNamespace(topic=topic, payload=payload, retain=retain, properties=None)
