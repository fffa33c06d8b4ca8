"""The agent's MQTT session (aiomqtt's habit: one client, one owner): the paho client of the
daemon, its subscriptions, the marker that says their retained records are in, and what the
connection's life does to the daemon's view of it.

Why a part of its own: the loop reads only `connected`, `retained_in` and `publish`; how a client
is made, what it subscribes, how paho reports a failure and how the session ends are one
protocol with the broker, and the loop's other handlers never touch the client. paho's callbacks
only enqueue typed events (agent.node.loopevents) through `put`; the loop hands the connection's
events back here.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

from agent import topics
from agent.config import MqttSection, resolve_password
from agent.mqtt import client as mqttc
from agent.mqtt.requester import SYNC_PREFIX, request_properties
from agent.mqtt.settings import BrokerSpec
from agent.node import loopevents

log = logging.getLogger(__name__)

SESSION_EXPIRY = 3600  # seconds the broker keeps our session (subscriptions, queued requests)
SESSION = mqttc.Session(persistent=True, expiry=SESSION_EXPIRY)


def broker_of(mqtt: MqttSection) -> BrokerSpec:
    """The broker settings of the agent's [mqtt] section, its password file read now (an unreadable
    one is a ConfigError naming it, exit 78, not a failure in paho's thread)."""
    return dataclasses.replace(mqttc.broker_from(mqtt.host, mqtt.port, mqtt.tls, mqtt.username, resolve_password(mqtt),
                                                 mqtt.keepalive, mqtt.client_id_secret_file),
                               qos=mqtt.qos, max_inflight=mqtt.max_inflight)


def subscriptions(cluster: str, node: str) -> List[Tuple[str, int]]:
    """What every agent subscribes to (QoS 1), besides the latency probes of its core."""
    return [
        (topics.agent_rpc_inbox(cluster, node), 1),
        (topics.agent_peer_inbox(cluster, node), 1),
        (topics.replies_inbox(cluster, node), 1),
        (topics.all_agents_state(cluster), 1),
        (topics.all_agents_status(cluster), 1),
        (topics.all_latency(cluster), 1),
        (topics.all_agents_hosted(cluster), 1),
        (topics.all_agents_rehomed(cluster), 1),
        (topics.all_pipelines(cluster), 1),
        (topics.all_site_managers(cluster), 1),  # after the statuses: a claim counts only if online
    ]


class AgentBus:
    """The one client of the daemon; `connected` and `retained_in` are the loop's to read."""

    def __init__(self, broker: BrokerSpec, client_id: str, cluster: str, node: str,
                 put: Callable[[loopevents.LoopEvent], None], connect_timeout: Optional[float], started: float) -> None:
        self.broker = broker
        self.client_id = client_id
        self.cluster = cluster
        self.node = node
        self.put = put
        self.connect_timeout = connect_timeout
        self.started = started
        self.client: Any = None
        self.connected = False
        self.ever_connected = False
        self.retained_in = False  # the retained records of this connection's subscriptions are in
        self.marker = b""  # what marks their end (see `mark`)
        self.last_puback = -1e9
        self.failures = mqttc.FailureLog(broker.host, broker.port, log, extra={"node": node})
        self.paho_error: Optional[str] = None  # paho's last error log line (a TLS alert, ...)

    def start(self) -> None:
        c = mqttc.make_client(self.broker, self.client_id, SESSION, max_inflight=self.broker.max_inflight,
                              reconnect_delay=(1, 10),
                              will=mqttc.Will(topics.agent_status(self.cluster, self.node), b"offline"))
        put = self.put
        c.on_connect = lambda cl, ud, flags, reason, props=None: put(
            loopevents.Connected(not reason.is_failure, str(reason), bool(getattr(flags, "session_present", False)))
        )
        c.on_disconnect = lambda cl, ud, flags, reason, props=None: put(loopevents.Disconnected(str(reason)))
        # A failed (re)connect that paho retries by itself -> ConnectFailed; paho reports a
        # lost connection without its cause (a TLS alert from the broker rejecting our
        # certificate reads as "Unspecified error"): the cause is in its error log line.
        mqttc.FailureLog.watch(c, lambda why: put(loopevents.ConnectFailed(why)),
                               lambda why: put(loopevents.PahoError(why)))
        c.on_message = lambda cl, ud, msg: put(loopevents.MqttMessage(msg))
        c.on_publish = lambda cl, ud, mid, reason=None, props=None: put(loopevents.Puback(mid))
        mqttc.connect(c, self.broker, SESSION, blocking=False)
        self.client = c
        c.loop_start()

    def publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1,
                correlation: Optional[bytes] = None) -> Union[bool, int]:
        """False when not queued, else the message id (true: paho's ids start at 1), whose PUBACK
        some callers wait for (replicas.Replication.published). Queued includes a message paho
        took while the connection is down (`mqttc.publish_taken`): it goes out at the reconnect,
        so a spawn request must not be asked of another node as well (invariant 7). `correlation`:
        a request's or a reply's Correlation Data (agent.node.rpc)."""
        if self.client is None:
            return False
        properties = request_properties(correlation) if correlation is not None else None
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if not mqttc.publish_taken(info.rc, qos):
            # paho does not raise on a full queue (docs/design.md section 6): say so, never drop silently.
            log.warning("publish to %s not queued (rc=%s)", topic, info.rc, extra={"node": self.node})
            return False
        return getattr(info, "mid", 0) or True

    def connack(self, event: loopevents.Connected) -> bool:
        """True when the broker accepted the connection; a refusal is one more failed attempt."""
        if not event.ok:
            self.failures.failed(f"the broker refused the connection: {event.reason}")
            return False
        self.paho_error = None
        self.failures.connected()
        self.connected = self.ever_connected = True
        return True

    def trouble(self, event: Union[loopevents.ConnectFailed, loopevents.PahoError, loopevents.Disconnected]) -> None:
        """A failed attempt (paho retries; each distinct reason logged once, the last kept for the
        exit message of `connect_timeout`), paho's error line (the cause of what follows), or a
        lost connection."""
        if isinstance(event, loopevents.ConnectFailed):
            self.failures.failed(event.why)
        elif isinstance(event, loopevents.PahoError):
            self.paho_error = event.why  # already mqttc.paho_error()'d by FailureLog.watch
        else:
            reason = self.paho_error or event.reason  # the cause rather than "Unspecified error"
            self.paho_error = None
            if self.connected:
                self.connected = False
                log.warning("disconnected from broker: %s", reason, extra={"node": self.node})
            else:
                self.failures.failed(f"connection closed before CONNACK: {reason}")

    def subscribe(self, probes: Iterable[str]) -> None:
        """Our subscriptions, the latency core's `probes` at QoS 0 (TCP_NODELAY is set on the
        client's socket: agent.mqtt.client.nodelay)."""
        self.client.subscribe(subscriptions(self.cluster, self.node) + [(t, 0) for t in probes])

    def mark(self) -> None:
        """The broker sends a subscription's retained messages before it handles our next publish
        (one connection, in order): when this marker comes back, they are all in."""
        self.retained_in = False
        self.marker = SYNC_PREFIX + uuid.uuid4().hex.encode()
        self.publish(topics.replies(self.cluster, self.node, self.node), self.marker, qos=1)

    def marked(self, payload: bytes) -> bool:
        """True once per connection: `payload` (on our own reply topic) is this connection's marker."""
        if self.retained_in or payload != self.marker:
            return False
        self.retained_in = True
        return True

    def online(self) -> None:
        self.publish(topics.agent_status(self.cluster, self.node), b"online", retain=True)

    def gave_up(self, now: float) -> Optional[str]:
        """Why the agent stops, when it never reached the broker within `connect_timeout`."""
        if self.connect_timeout is None or self.ever_connected or now - self.started <= self.connect_timeout:
            return None
        last = f" ({self.failures.last})" if self.failures.last else ""
        return f"no broker at {self.broker.host}:{self.broker.port} after {self.connect_timeout}s{last}"

    def close(self, last_state: Callable[[], bytes]) -> None:
        """Leave as a clean exit: `last_state()` (no instances) and "offline", both retained, then
        disconnect (the broker then drops the Will)."""
        c = self.client
        if c is None:
            return
        if self.connected:
            self.publish(topics.agent_state(self.cluster, self.node), last_state(), retain=True)
            info = c.publish(topics.agent_status(self.cluster, self.node), b"offline", qos=1, retain=True)
            try:
                info.wait_for_publish(timeout=1.0)
            except (RuntimeError, ValueError):
                pass
        c.disconnect()
        c.loop_stop()


__all__ = ["AgentBus", "SESSION", "SESSION_EXPIRY", "broker_of", "subscriptions"]
