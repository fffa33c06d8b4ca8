"""A blocking MQTT 5 client for tools: retained snapshots, live streams and request/reply.

Used by fogctl (agent.fogctl.client.Connection) and by `fog-agent deploy`, the demo and the tests
(agent.node.deploy.RpcClient): one implementation of the request, correlation and reply wait, so
the two tools cannot drift apart.

Rules of this file:
- paho's network thread (loop_start) only converts and enqueues (aiomqtt style); the caller's
  thread publishes and waits. One client, one owner: publish only from the thread that connected.
- Requests and replies (docs/security.md): a request goes to a topic that names us
  (`agents/<node>/rpc/<identity>`, or a peer topic), with Correlation Data and no Response Topic;
  the replier answers on `replies/<identity>/<replier>`. A reply counts only if it is not
  retained, carries our correlation and comes from the node we asked (the last topic level,
  which the broker's ACL proves).
- A snapshot of retained topics ends at a *sync marker*, not after a sleep: after the SUBACK we
  publish a marker to our own reply topic (QoS 1). Mosquitto queues the retained messages of a
  subscription on the session before it routes any later publish to it, so when the marker
  comes back every retained message has arrived (one round trip, deterministic in tests). Waiting
  for a pause instead never ends while agents publish their state every half second.
- Every failure is one exception with a one-line message: `BrokerUnreachable` (names host:port),
  `RequestTimeout`, or their base `RequestFailed`.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import identity as identity_mod
from agent import topics, wire
from agent.mqtt.settings import BrokerSpec
from agent.mqtt import client as mqttc

__all__ = ["BrokerUnreachable", "Message", "RequestFailed", "RequestTimeout", "Requester", "SYNC_PREFIX"]

SYNC_PREFIX = b"\x00fog-sync:"  # payload prefix of a snapshot's sync marker (never a JSON reply)


class RequestFailed(RuntimeError):
    """A failure to report in one line."""


class RequestTimeout(RequestFailed):
    pass


class BrokerUnreachable(RequestFailed):
    """No TCP/TLS connection to the broker; names the address."""

    def __init__(self, address: str, reason: str) -> None:
        self.address, self.reason = address, reason
        super().__init__(f"cannot reach the MQTT broker at {address}: {reason}")


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    retain: bool = False
    correlation: Optional[bytes] = None

    def text(self) -> str:
        return self.payload.decode("utf-8", "replace")

    def json(self) -> Any:
        return wire.loads(self.payload, what=self.topic)


def request_properties(correlation: bytes, expiry: Optional[float] = None) -> Properties:
    """A request's or a reply's properties: Correlation Data (the reply topic follows from the
    request topic, docs/security.md) and, for a request, a Message Expiry Interval of `expiry`
    seconds (rounded up): a request that waits in a broker's queue longer than its requester
    waits for the reply (a site whose uplink is down, docs/scale.md "Sites") is dropped there
    instead of being applied after the requester gave up."""
    props = Properties(PacketTypes.PUBLISH)
    props.CorrelationData = correlation
    if expiry is not None:
        props.MessageExpiryInterval = max(1, int(-(-float(expiry) // 1)))
    return props


class Requester:
    """A connected MQTT 5 client owned by the calling thread; use as a context manager.

    `identity` names us in request topics and in our reply namespace; by default the user name,
    else the certificate's CN, else the client id (agent.identity)."""

    def __init__(self, broker: BrokerSpec, cluster: str, client_id: Optional[str] = None,
                 identity: Optional[str] = None, timeout: float = 10.0) -> None:
        self.broker = broker
        self.cluster = cluster
        self.client_id = client_id or f"fog-tool-{uuid.uuid4().hex[:12]}"
        self.timeout = timeout
        try:
            self.identity = (topics._check(identity) if identity
                             else identity_mod.identity(broker.username, broker.cert_file, self.client_id))
        except (identity_mod.IdentityError, ValueError) as exc:
            raise RequestFailed(str(exc)) from None
        self.reply_filter = topics.replies_inbox(cluster, self.identity)
        self.reply_topic = topics.replies(cluster, self.identity, self.identity)  # our sync markers
        self._inbox: "queue.Queue[Message]" = queue.Queue()  # everything but replies to us
        self._replies: "queue.Queue[Message]" = queue.Queue()  # replies to our requests
        self._acks: "queue.Queue[Tuple[str, Any]]" = queue.Queue()
        self._connected = threading.Event()
        self._client: Optional[mqtt.Client] = None
        self._filters: List[str] = []  # re-subscribed after an automatic reconnect
        self._filters_lock = threading.Lock()
        self.reconnects = 0

    # -- connection ------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.broker.host}:{self.broker.port}"

    def __enter__(self) -> "Requester":
        self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def connect(self, timeout: Optional[float] = None) -> "Requester":
        """Connect, wait for the CONNACK (`timeout`, default the client's) and subscribe to our
        reply namespace."""
        wait = self.timeout if timeout is None else timeout
        try:
            c = mqttc.make_client(self.broker, self.client_id, reconnect_delay=(1, 5))
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise RequestFailed(f"TLS set-up failed: {exc}") from None
        c.connect_timeout = wait
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.on_subscribe = self._on_subscribe
        c.on_publish = self._on_publish
        self._client = c
        try:
            mqttc.connect_and_wait(c, self.broker, timeout=wait)
        except mqttc.ConnectFailed as exc:
            self._client = None
            if exc.refused:
                raise RequestFailed(f"the broker at {self.address} refused the connection: "
                                    f"{exc.reason.rsplit(': ', 1)[-1]}") from None
            raise BrokerUnreachable(self.address, exc.reason) from None
        # Our own reply topic first: replies and the snapshot sync marker arrive there.
        self._subscribe([self.reply_filter])
        return self

    def close(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            try:
                c.disconnect()
            finally:
                c.loop_stop()

    # -- paho callbacks (network thread): convert and enqueue only ---------------------------------

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        if self._connected.is_set() and not getattr(rc, "is_failure", False):
            # paho reconnected by itself (broker restart): a clean session lost our subscriptions.
            # Subscribing here is paho's documented pattern; the SUBACK is not waited for.
            self.reconnects += 1
            with self._filters_lock:
                filters = list(self._filters)
            if filters:
                client.subscribe([(f, 1) for f in filters])
        if not getattr(rc, "is_failure", False):
            self._connected.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        props = getattr(msg, "properties", None)
        cd = getattr(props, "CorrelationData", None) if props is not None else None
        m = Message(msg.topic, bytes(msg.payload), bool(msg.retain),
                    bytes(cd) if isinstance(cd, (bytes, bytearray)) else None)
        if self._is_reply(m) and not m.payload.startswith(SYNC_PREFIX):
            if not m.retain:  # a reply is never retained (docs/security.md): a leftover or a forgery
                self._replies.put(m)
            return
        self._inbox.put(m)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, rcs: Any, props: Any = None) -> None:
        self._acks.put(("suback", (mid, rcs)))

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any = None, props: Any = None) -> None:
        self._acks.put(("puback", mid))

    # -- helpers -----------------------------------------------------------------------------------

    def _is_reply(self, m: Message) -> bool:
        """A message on our own reply namespace (a reply or a sync marker)."""
        parsed = topics.parse(self.cluster, m.topic)
        return parsed is not None and parsed.kind == "reply" and parsed.node == self.identity

    def _require(self) -> mqtt.Client:
        if self._client is None:
            raise RequestFailed("not connected")
        return self._client

    def _wait_ack(self, kind: str, mid: int, deadline: float) -> Any:
        pending: List[Tuple[str, Any]] = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout(f"no {kind.upper()} from the broker at {self.address} "
                                         f"within {self.timeout:g}s")
                try:
                    k, v = self._acks.get(timeout=left)
                except queue.Empty:
                    continue
                got_mid = v[0] if k == "suback" else v
                if k == kind and got_mid == mid:
                    return v
                pending.append((k, v))
        finally:
            for item in pending:
                self._acks.put(item)

    def _subscribe(self, filters: Sequence[str]) -> None:
        c = self._require()
        rc, mid = c.subscribe([(f, 1) for f in filters])
        if rc != mqtt.MQTT_ERR_SUCCESS:
            raise RequestFailed(f"subscribe to {', '.join(filters)} failed: {mqtt.error_string(rc)}")
        _, rcs = self._wait_ack("suback", mid, time.monotonic() + self.timeout)
        bad = [f for f, r in zip(filters, rcs) if getattr(r, "is_failure", False)]
        if bad:
            raise RequestFailed(f"the broker refused the subscription to {bad[0]} (not authorized?)")
        with self._filters_lock:
            self._filters += [f for f in filters if f not in self._filters]

    def _unsubscribe(self, filters: Sequence[str]) -> None:
        c = self._require()
        c.unsubscribe(list(filters))
        with self._filters_lock:
            self._filters = [f for f in self._filters if f not in filters]
        # Drop whatever live messages of these filters are still queued.
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                properties: Optional[Properties] = None) -> None:
        """Publish and wait for the broker's PUBACK (QoS 1), so that 'done' means delivered."""
        c = self._require()
        info = c.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise RequestFailed(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        if qos > 0:
            self._wait_ack("puback", info.mid, time.monotonic() + self.timeout)

    # -- the three ways to read --------------------------------------------------------------------

    def snapshot(self, filters: Sequence[str], timeout: Optional[float] = None) -> Dict[str, Message]:
        """The retained messages on `filters` now, by topic (empty payloads = cleared, omitted);
        `timeout` (default the client's) bounds the whole snapshot."""
        wait = self.timeout if timeout is None else timeout
        self._subscribe(filters)
        out: Dict[str, Message] = {}
        try:
            marker = SYNC_PREFIX + uuid.uuid4().hex.encode()
            self.publish(self.reply_topic, marker, qos=1)
            deadline = time.monotonic() + wait
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout(f"the broker at {self.address} did not echo our sync marker "
                                         f"within {wait:g}s")
                try:
                    m = self._inbox.get(timeout=left)
                except queue.Empty:
                    continue
                if self._is_reply(m):
                    if m.topic == self.reply_topic and m.payload == marker:
                        break
                    continue  # the marker of an earlier, timed-out snapshot
                if m.payload and any(mqtt.topic_matches_sub(f, m.topic) for f in filters):
                    out[m.topic] = m
        finally:
            self._unsubscribe(filters)
        return out

    def stream(self, filters: Sequence[str], duration: Optional[float] = None,
               include_retained: bool = False) -> Iterator[Message]:
        """Live messages on `filters` until `duration` elapses (None = forever).

        Subscribes before returning (not lazily on the first `next`), so that a caller can say
        "watching" and know that nothing published from then on is missed.
        """
        self._subscribe(filters)
        deadline = None if duration is None else time.monotonic() + duration
        return self._drain_inbox(deadline, include_retained)

    def _drain_inbox(self, deadline: Optional[float], include_retained: bool) -> Iterator[Message]:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            try:
                m = self._inbox.get(timeout=0.5 if left is None else min(left, 0.5))
            except queue.Empty:
                continue
            if self._is_reply(m) or (m.retain and not include_retained):
                continue
            yield m

    def rpc(self, node: str, body: Dict[str, Any], timeout: Optional[float] = None) -> Dict[str, Any]:
        """A control request to `node`'s agent on `agents/<node>/rpc/<identity>`; its reply."""
        return self.request(topics.agent_rpc(self.cluster, node, self.identity), body, timeout)

    def request(self, topic: str, body: Dict[str, Any], timeout: Optional[float] = None) -> Dict[str, Any]:
        """MQTT 5 request/response on a request topic that names us (agents/<node>/rpc/<identity>
        or agents/<node>/peer/<identity>): the reply comes on `replies/<identity>/<node>` with our
        correlation data. A reply that is not a JSON object is RequestFailed."""
        corr = uuid.uuid4().hex.encode()
        target = topics.parse(self.cluster, topic)
        replier = target.node if target is not None and target.kind in ("rpc", "peer") else None
        wait = self.timeout if timeout is None else timeout
        props = request_properties(corr, expiry=wait)
        props.ContentType = "application/json"
        self.publish(topic, json.dumps(body, sort_keys=True).encode(), qos=1, properties=props)
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"no reply on {topic} within {wait:g}s to {body.get('op')} "
                                     "(is the agent online and up to date? behind a site uplink "
                                     "that is down the request is dropped, and one that waits in "
                                     "a broker's queue expires after this timeout: it will not "
                                     "be applied later)")
            try:
                m = self._replies.get(timeout=left)
            except queue.Empty:
                continue
            if m.correlation != corr:
                continue  # a late reply to an earlier request
            sender = topics.parse(self.cluster, m.topic)
            if replier is not None and (sender is None or sender.sender != replier):
                continue  # our correlation, but not from the agent we asked
            try:
                return wire.loads(m.payload, what=f"the reply on {m.topic}", expect=dict)
            except wire.BusInputError as exc:
                raise RequestFailed(str(exc)) from None
