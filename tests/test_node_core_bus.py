"""agent.node.bus on its own: what the connection's events do to the loop's view of it, the marker
of the retained records and the broker settings of the [mqtt] section, with a recording client
instead of paho and no broker."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Tuple

import pytest

from agent import topics
from agent.config import MqttSection, TlsSection
from agent.mqtt.settings import BrokerSpec
from agent.node import loopevents
from agent.node.bus import AgentBus, broker_of, subscriptions
from agent.schema import ConfigError


class _Client:
    def __init__(self) -> None:
        self.sent: List[Tuple[str, bytes, bool]] = []
        self.subscribed: List[Any] = []

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Any = None) -> Any:
        self.sent.append((topic, payload, retain))
        return SimpleNamespace(rc=0, mid=len(self.sent))

    def subscribe(self, subs: Any) -> None:
        self.subscribed.append(subs)


def _bus(timeout: Any = 5.0) -> AgentBus:
    bus = AgentBus(BrokerSpec("h", 1), "fog-agent-c-n1", "c", "n1", lambda e: None, timeout, 100.0)
    bus.client = _Client()
    return bus


def test_only_this_connections_marker_says_the_retained_records_are_in() -> None:
    bus = _bus()
    assert bus.connack(loopevents.Connected(True, "Success", False)) and bus.connected and bus.ever_connected
    bus.subscribe(["fog/c/latency/ping/n1/+"])
    assert bus.client.subscribed == [subscriptions("c", "n1") + [("fog/c/latency/ping/n1/+", 0)]]
    bus.mark()
    first = bus.marker
    assert bus.client.sent == [(topics.replies("c", "n1", "n1"), first, False)] and not bus.retained_in
    bus.mark()  # a reconnect: the first marker is stale
    assert not bus.marked(first) and not bus.retained_in
    assert bus.marked(bus.marker) and bus.retained_in
    assert not bus.marked(bus.marker)  # once per connection


def test_a_lost_connection_names_the_cause_paho_logged_and_a_refusal_counts_as_an_attempt() -> None:
    bus = _bus()
    assert not bus.connack(loopevents.Connected(False, "Not authorized", False)) and not bus.connected
    assert bus.failures.last == "the broker refused the connection: Not authorized"
    bus.connack(loopevents.Connected(True, "Success", False))
    assert bus.failures.last is None
    bus.trouble(loopevents.PahoError("TLS alert: certificate revoked"))
    bus.trouble(loopevents.Disconnected("Unspecified error"))
    assert not bus.connected and bus.paho_error is None
    bus.trouble(loopevents.Disconnected("Unspecified error"))  # before any CONNACK: a failed attempt
    assert bus.failures.last == "connection closed before CONNACK: Unspecified error"


def test_the_agent_gives_up_only_when_it_never_reached_the_broker_in_time() -> None:
    bus = _bus(timeout=5.0)
    assert bus.gave_up(105.0) is None
    bus.trouble(loopevents.ConnectFailed("connection refused"))
    assert bus.gave_up(105.1) == "no broker at h:1 after 5.0s (connection refused)"
    bus.connack(loopevents.Connected(True, "Success", False))
    assert bus.gave_up(1e6) is None and _bus(timeout=None).gave_up(1e6) is None


def test_a_clean_exit_leaves_the_empty_state_and_offline_retained() -> None:
    bus = _bus()
    bus.client.disconnect = bus.client.loop_stop = lambda: None
    bus.client.publish = (lambda orig: lambda *a, **k: SimpleNamespace(**vars(orig(*a, **k)),
                                                                    wait_for_publish=lambda timeout: True))(bus.client.publish)
    bus.close(lambda: b"{}")  # never connected: nothing said
    assert bus.client.sent == []
    bus.connack(loopevents.Connected(True, "Success", False))
    bus.close(lambda: b"{}")
    assert bus.client.sent == [(topics.agent_state("c", "n1"), b"{}", True), (topics.agent_status("c", "n1"), b"offline", True)]


def test_the_broker_settings_are_the_mqtt_sections_with_the_password_file_read_at_start(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    tls = TlsSection("/ca.pem", "/c.pem", "/c.key", insecure=True)
    mqtt = MqttSection(host="b.local", port=8883, keepalive=7, username="n1", password_file=str(tmp_path / "pw"),
                       qos=2, max_inflight=9, tls=tls, client_id_secret_file="/site.secret")
    assert broker_of(mqtt) == BrokerSpec("b.local", 8883, keepalive=7, qos=2, max_inflight=9, username="n1",
                                         password="s3cret", ca_file="/ca.pem", cert_file="/c.pem", key_file="/c.key",
                                         tls_insecure=True, id_secret_file="/site.secret")
    assert broker_of(MqttSection(password="p")) == BrokerSpec("127.0.0.1", 1883, password="p")  # no TLS: none of it
    with pytest.raises(ConfigError):
        broker_of(MqttSection(password_file=str(tmp_path / "missing")))

