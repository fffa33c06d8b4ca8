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


def reconnect(agent: Any, client: RecordingClient, at: float, retained: List[Tuple[str, bytes]]) -> None:
    """A (re)connect of `agent` at `at`: a loop turn before the retained messages arrive, then
    them and the echo of this connection's sync marker, and a loop turn."""
    from agent import topics
    from agent.node.loopevents import Connected

    marker_topic = topics.replies(agent.cluster, agent.node, agent.node)
    agent._dispatch(Connected(True, "Success", True), at)
    agent._periodic(at)
    for topic, payload in retained + [(marker_topic, client.on(marker_topic)[-1])]:
        agent.core._on_message(message(topic, payload, retain=topic != marker_topic), at)
    agent._periodic(at)
