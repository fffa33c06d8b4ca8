"""The MQTT client of one worker: paho with exactly one owner thread.

Rules of this file (from paho issues #354/#787 and docs/design.md section 6):
- one owner thread: the thread that created the Transport is the only one that may call
  `publish`, `subscribe` or `poll` (checked; a second thread raises). We never call
  `loop_start()`: `poll()` runs paho's network loop in the owner thread, so callbacks run there
  too, and they only convert and enqueue (aiomqtt style). The loop is `mqttc.loop_once`, not
  paho's `loop()`, whose wake-up socket pair costs a syscall per publish for nothing here;
- every publish return code is checked. For QoS > 0 only MQTT_ERR_QUEUE_SIZE means paho did not
  take the message: once taken, paho keeps it whatever its first socket write returned
  (MQTT_ERR_NO_CONN, or MQTT_ERR_CONN_LOST when the broker goes away during the write) and sends
  it after the reconnect, so retrying it ourselves would send it twice. For QoS 0 anything but
  SUCCESS/NO_CONN is a rejection. A rejection raises `PublishRejected`: the caller keeps the data
  and retries later;
- persistent session: the inbox keeps filling while a worker restarts (invariant 2 and issue 10).
  MQTT 3.1.1 by default (`clean_session` false): the data path uses no MQTT 5 feature, and paho's
  3.1.1 packets cost less CPU per message (no Properties object per PUBLISH and PUBACK;
  docs/measurement.md, "Cheap cuts of the data plane"). The session's life is the broker's
  `persistent_client_expiration` (ansible/roles/mosquitto). A final exit clears the session so the
  broker does not keep queues of instances that are gone for good: MQTT 3.1.1 has no session
  expiry, so the client connects once more with a clean session, which discards the old one
  (MQTT 5, `mqtt5=True`: DISCONNECT with expiry 0, as before);
- reconnects with exponential backoff; if the broker lost the session, subscriptions are renewed;
- a manual-ack transport PUBACKs a packet id at most once per connection, until the broker
  delivers that id again as a new message (`ack`). After a reconnect the broker sends again,
  flagged dup, what it had in flight; the owner may have acked one of those on the new
  connection already (a delivery of the old one it still held), and then acks its dup too.
  After such a second PUBACK, of a packet id it no longer held, Mosquitto 2.0.11 sent the next
  new message ahead of those it had queued for the client while it was away (docs/results.md,
  R23: a sensor reading 17.6 s ahead of 878).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Union

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt.settings import BrokerSpec
from agent.mqtt import client as mqttc

log = logging.getLogger(__name__)
# packet ids a manual-ack transport remembers having PUBACKed on its connection (`ack`)
ACKED_MIDS = 4096

__all__ = [
    "Transport",
    "poll_all",
    "TransportError",
    "PublishRejected",
    "Received",
    "PubAck",
    "Connected",
    "Disconnected",
    "Event",
]

SESSION_EXPIRY = 3600  # MQTT 5 only: seconds a broker keeps an absent worker's inbox (crash-restart window)
DATA_MQTT5 = False  # the data path's protocol: MQTT 3.1.1 (see the rules at the top); the bench's raw part uses it too
FINAL_CLEAN_TIMEOUT = 2.0  # MQTT 3.1.1 final exit: the clean-session connect that deletes the session


class TransportError(Exception):
    """Root of transport errors."""


class PublishRejected(TransportError):
    """paho refused a publish (queue full, message id space exhausted, bad topic)."""

    def __init__(self, topic: str, rc: int) -> None:
        super().__init__(f"publish to {topic} rejected by paho: {mqtt.error_string(rc)} (rc={rc})")
        self.rc = rc


@dataclass(frozen=True)
class Received:
    """A delivery. mid, qos and dup matter only on a manual-ack transport: `ack(mid, qos)` PUBACKs
    it; dup: the broker sends it again (it was in flight to an earlier connection of the session)."""

    topic: str
    payload: bytes
    mid: int = 0
    qos: int = 0
    dup: bool = False


@dataclass(frozen=True)
class PubAck:
    mid: int


@dataclass(frozen=True)
class Connected:
    session_present: bool


@dataclass(frozen=True)
class Disconnected:
    reason: str


Event = Union[Received, PubAck, Connected, Disconnected]


class Transport:
    def __init__(self, client_id: str, broker: BrokerSpec, persistent: bool = True, mqtt5: bool = DATA_MQTT5,
                 manual_ack: bool = False) -> None:
        self.broker = broker
        self.client_id = client_id
        self.persistent = persistent
        self.events: Deque[Event] = deque()
        self._owner = threading.get_ident()
        self._subs: Dict[str, int] = {}
        self._pending_sub: Dict[int, str] = {}
        self._connected = False
        self._backoff = 0.1
        self._next_reconnect = 0.0
        # Fencing (re-homing on): after a lost connection, reconnect only once the owner says so
        # (`allow_reconnect`), see agent.instance.worker. Off: reconnect at once, with backoff.
        self.gate_reconnect = False
        self._allowed_until = float("inf")
        self.published = 0
        self.rejected = 0
        self.reconnects = 0
        # manual acks: packet ids PUBACKed on this connection, until delivered again as new (`ack`);
        # the last ACKED_MIDS only (the broker's dups come with the reconnect, at most its window)
        self._acked_mids: Dict[int, None] = {}
        self.acks_skipped = 0
        self._session = mqttc.Session(mqtt5=mqtt5, persistent=persistent, expiry=SESSION_EXPIRY)
        # max_queued 0: bounded by our flow control instead (flow.OutLink)
        c = mqttc.make_client(broker, client_id, self._session, max_inflight=broker.max_inflight, max_queued=0,
                              manual_ack=manual_ack)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        c.on_subscribe = self._on_subscribe
        self.client = c

    # ---- callbacks: convert and enqueue only ----------------------------------------------------

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        if rc.is_failure:
            self.events.append(Disconnected(f"connect refused: {rc}"))
            return
        self._connected = True
        self._backoff = 0.1
        self._acked_mids.clear()  # a new connection: the broker sends again what we did not ack on it
        self.events.append(Connected(bool(flags.session_present)))

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self._lost()
        self.events.append(Disconnected(str(rc)))

    def _lost(self) -> None:
        """The connection is gone; fenced (gate_reconnect): wait for allow_reconnect()."""
        if self._connected and self.gate_reconnect:
            self._allowed_until = 0.0
        self._connected = False

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        if not msg.dup:
            self._acked_mids.pop(msg.mid, None)  # the broker uses the id again: a new message to ack
        self.events.append(Received(msg.topic, msg.payload, msg.mid, msg.qos, bool(msg.dup)))

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any = None, props: Any = None) -> None:
        self.events.append(PubAck(mid))

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, rcs: Any, props: Any = None) -> None:
        topic = self._pending_sub.pop(mid, None)
        if topic is not None:
            if any(getattr(r, "is_failure", False) for r in rcs):
                self.events.append(Disconnected(f"subscribe to {topic} refused: {rcs}"))
            else:
                self._subs[topic] = 1

    # ---- owner-thread API -------------------------------------------------------------------------

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise TransportError("paho client used from a thread that does not own it")

    @property
    def connected(self) -> bool:
        return self._connected

    def connect(self, timeout: float = 10.0) -> bool:
        """Connect and wait for CONNACK; returns whether the broker kept our session. No
        connection, a refused one or no CONNACK: mqttc.ConnectFailed (a ConnectionError)."""
        self._check_owner()
        present = mqttc.connect_and_wait(self.client, self.broker, self._session, timeout, threaded=False)
        for i, ev in enumerate(self.events):  # the Connected event our callback queued: answered here
            if isinstance(ev, Connected):
                del self.events[i]
                break
        return present

    def subscribe(self, topic: str, qos: Optional[int] = None, timeout: float = 10.0) -> None:
        """Subscribe and wait for the SUBACK (invariant 2 needs to know it is in place)."""
        self._check_owner()
        q = self.broker.qos if qos is None else qos
        rc, mid = self.client.subscribe(topic, qos=q)
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise TransportError(f"subscribe to {topic}: {mqtt.error_string(rc)}")
        self._pending_sub[mid] = topic
        deadline = time.monotonic() + timeout
        while mid in self._pending_sub:
            if time.monotonic() > deadline:
                raise TransportError(f"no SUBACK for {topic} within {timeout}s")
            mqttc.loop_once(self.client, 0.05)
        if topic not in self._subs:
            raise TransportError(f"subscribe to {topic} refused by the broker")

    def publish(self, topic: str, payload: Union[bytes, str], qos: Optional[int] = None, retain: bool = False) -> int:
        """Hand one message to paho; returns its mid (PubAck(mid) follows for QoS > 0)."""
        self._check_owner()
        q = self.broker.qos if qos is None else qos
        info = self.client.publish(topic, payload, qos=q, retain=retain)
        if not mqttc.publish_taken(info.rc, q):  # see the rules at the top
            self.rejected += 1
            raise PublishRejected(topic, info.rc)
        self.published += 1
        return int(info.mid)

    def poll(self, timeout: float) -> None:
        """Run the network loop once (owner thread); reconnect with backoff when disconnected."""
        self._check_owner()
        if self._connected or self.client.is_connected():
            rc = mqttc.loop_once(self.client, timeout)  # paho's loop without its wake-up socket pair
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                return
            self._lost()
        now = time.monotonic()
        if now >= self._allowed_until:
            time.sleep(timeout)  # fenced: the owner has not allowed a reconnect (yet)
            return
        if now < self._next_reconnect:
            time.sleep(min(timeout, self._next_reconnect - now))
            return
        try:
            self.client.reconnect()
            self.reconnects += 1
            deadline = time.monotonic() + 2.0
            while not self._connected and time.monotonic() < deadline:
                mqttc.loop_once(self.client, 0.05)
            if self._connected:
                self._allowed_until = float("inf")
                self._renew_subscriptions()
                return
        except (OSError, ValueError) as exc:
            log.warning("reconnect to %s:%s failed: %s", self.broker.host, self.broker.port, exc)
        self._next_reconnect = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 5.0)

    @property
    def reconnect_held(self) -> bool:
        """Disconnected and not allowed to reconnect (gate_reconnect)."""
        return not self._connected and time.monotonic() >= self._allowed_until

    def allow_reconnect(self, for_s: float = 10.0) -> None:
        """Reconnect attempts may go on for `for_s` seconds; after that, ask again (the check
        that allowed them is only that fresh)."""
        self._allowed_until = time.monotonic() + for_s
        self._next_reconnect = 0.0

    def _renew_subscriptions(self) -> None:
        """Subscribe again to every topic after each reconnect, even when the broker says it kept
        our session: a broker that restarted from an older save (SIGKILL between autosaves)
        presents a session without the subscriptions made since (docs/reliability.md, seed
        12004). MQTT replaces an identical subscription without interrupting its flow, so on an
        intact session this costs one SUBSCRIBE and loses nothing."""
        for topic in list(self._subs):
            rc, mid = self.client.subscribe(topic, qos=self.broker.qos)
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                self._pending_sub[mid] = topic

    def ack(self, mid: int, qos: int) -> None:
        """PUBACK one delivery (a manual-ack transport). Only while connected: after a reconnect
        the broker sends it again itself, and paho refuses acks it cannot send. A packet id
        already PUBACKed on this connection is not acked again (the dup of a delivery acked
        since the reconnect: see the rules above) until the broker delivers it as new."""
        self._check_owner()
        if qos > 0 and self._connected:
            if mid in self._acked_mids:
                self.acks_skipped += 1
                return
            self._acked_mids[mid] = None
            if len(self._acked_mids) > ACKED_MIDS:
                del self._acked_mids[next(iter(self._acked_mids))]
            self.client.ack(mid, qos)

    def socket(self) -> Any:
        """The connected socket to wait on, or None (disconnected)."""
        return self.client.socket() if self._connected else None

    def pending_out(self) -> int:
        """Messages paho still holds (unsent or waiting for PUBACK)."""
        return len(self.client._out_messages)  # noqa: SLF001 - no public accessor in paho 2.x

    def close(self, final: bool = False, timeout: float = 5.0) -> None:
        """Flush what paho holds (bounded), then disconnect; `final` deletes the session."""
        self._check_owner()
        # Write out what paho holds, but never READ on the way out: paho PUBACKs every delivery
        # it reads (before our code sees it), so a message read now would be gone from the
        # broker without being processed. Left unread, it stays in our persistent session and
        # the next incarnation gets it (read now, it would be lost at a node restart).
        held = self._connected  # only a session we hold is ours to clear (fencing: see _clear_session)
        deadline = time.monotonic() + timeout
        while self._connected and self.client.want_write() and time.monotonic() < deadline:
            if self.client.loop_write() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                break
        props = None
        if final and self._session.mqtt5:
            props = Properties(PacketTypes.DISCONNECT)
            props.SessionExpiryInterval = 0
        try:
            self.client.disconnect(properties=props)
            self.client.loop_write()  # send the DISCONNECT; reading now could PUBACK a delivery
        except (OSError, ValueError):
            pass
        if final and held and self._session.persistent and not self._session.mqtt5:
            self._clear_session()

    def _clear_session(self) -> None:
        """MQTT 3.1.1 final exit: connect with our client id and a clean session, which makes the
        broker discard the persistent one (its queue of messages for an instance gone for good),
        then disconnect. The clean session has no subscription, so nothing is delivered to it:
        reading its CONNACK cannot take (and PUBACK) a message. Only when we were connected at
        close: a fenced worker (re-homing, agent.instance.worker) may have a new incarnation
        elsewhere using this client id and session. Best effort: a broker we cannot reach now
        keeps the session until its `persistent_client_expiration`."""
        c = mqttc.make_client(self.broker, self.client_id, mqttc.CLEAN_311)
        try:
            mqttc.connect_and_wait(c, self.broker, mqttc.CLEAN_311, FINAL_CLEAN_TIMEOUT, threaded=False)
            c.disconnect()
            c.loop_write()  # paho closes the socket once the DISCONNECT is written
        except (OSError, ValueError) as exc:  # ConnectFailed is an OSError
            log.warning("final exit: could not clear the MQTT session of %s: %s", self.client_id, exc)

    def take_events(self) -> List[Event]:
        out = list(self.events)
        self.events.clear()
        return out


def poll_all(transports: List["Transport"], timeout: float, disconnected_poll: float = 0.05) -> None:
    """Wait until one of several transports' sockets is readable (or writable with data to write),
    up to `timeout`, then run each one's network loop once without waiting: one process with
    more than one connection (a chain's members, an `mqtt_source`'s ingest connection) reacts to
    each at once instead of sleeping in one while the other has work."""
    socks, writers = [], []
    for t in transports:
        sock = t.socket()
        if sock is None:
            timeout = min(timeout, disconnected_poll)
            continue
        socks.append(sock)
        if t.client.want_write():
            writers.append(sock)
    if timeout > 0 and (writers or socks):
        try:
            select.select(socks, writers, [], timeout)
        except (OSError, ValueError):
            pass  # a socket closed under us: the loops below notice it
    elif timeout > 0:
        time.sleep(timeout)
    for t in transports:
        t.poll(0.0)
