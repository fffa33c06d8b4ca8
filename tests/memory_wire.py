"""The worker's transport in memory, for tests that drive a `Worker` without a broker:
publications are kept in `sent`, each one PUBACKed at once; `refuse = N` makes the next N
publishes raise `PublishRejected`, as paho does when its queue is full; `acked` lists the
deliveries a manual-ack owner (an `mqtt_source`'s ingest connection) PUBACKed."""

from __future__ import annotations

from typing import Any, List, Tuple

from agent.mqtt.transport import PubAck, PublishRejected


class MemoryWire:
    def __init__(self) -> None:
        self.events: List[Any] = []
        self.sent: List[Tuple[str, bytes]] = []
        self.connected = True
        self.refuse = 0  # refuse this many publishes (PublishRejected)
        self.acked: List[Tuple[int, int]] = []  # (mid, qos) PUBACKed by a manual-ack owner
        self.acks_skipped = 0  # a real manual-ack transport counts the PUBACKs it did not repeat

    def connect(self, *a: object, **k: object) -> bool:
        return True

    def subscribe(self, *a: object, **k: object) -> None:
        pass

    def publish(self, topic: str, payload: bytes, qos: object = None, retain: bool = False) -> int:
        if self.refuse:
            self.refuse -= 1
            raise PublishRejected(topic, 15)  # MQTT_ERR_QUEUE_SIZE: paho did not take it
        self.sent.append((topic, payload))
        self.events.append(PubAck(len(self.sent)))
        return len(self.sent)

    def poll(self, timeout: float) -> None:
        pass

    def ack(self, mid: int, qos: int) -> None:
        self.acked.append((mid, qos))

    def take_events(self) -> list:
        ev, self.events = self.events, []
        return ev

    def pending_out(self) -> int:
        return 0

    def close(self, final: bool = False, timeout: float = 5.0) -> None:
        pass
