"""fogctl's one MQTT connection: retained snapshots, live streams and MQTT 5 request/response.

Rules of this file:
- paho callbacks only convert and enqueue (aiomqtt style); the caller's thread does the waiting.
  One client, one owner: fogctl publishes only from the calling thread.
- Every failure becomes one of three exceptions with a one-line message: `BrokerUnreachable`
  (exit 3, names host:port), `FogctlError` (exit 1) and `RequestTimeout` (a FogctlError).
- A snapshot of retained topics ends at a *sync marker*, not after a sleep: after the SUBACK we
  publish a marker to our own reply topic (QoS 1). Mosquitto queues the retained messages of a
  subscription on the session before it routes any later publish to it, so when the marker
  arrives every retained message has arrived before it. This makes `fogctl status` fast (one
  round trip) and deterministic in tests.
"""

from __future__ import annotations

import json
import queue
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import identity, topics, wire
from agent.fogctl.config import FogctlConfig

__all__ = ["Connection", "FogctlError", "BrokerUnreachable", "RequestTimeout", "Message"]


class FogctlError(Exception):
    """A failure to report in one line, exit status 1."""


class BrokerUnreachable(FogctlError):
    """No TCP/TLS connection to the broker (exit status 3); names the address."""

    def __init__(self, address: str, reason: str) -> None:
        self.address, self.reason = address, reason
        super().__init__(f"cannot reach the MQTT broker at {address}: {reason}")


class RequestTimeout(FogctlError):
    pass


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


_SYNC = b"\x00fogctl-sync"


class Connection:
    """A connected MQTT 5 client owned by the calling thread; use as a context manager."""

    def __init__(self, cfg: FogctlConfig) -> None:
        self.cfg = cfg
        self.client_id = cfg.client_id or f"fogctl-{uuid.uuid4().hex[:12]}"
        # docs/security.md: requests name their sender, replies come to replies/<identity>/+
        # (agent.identity: user name, else the certificate's CN, else the client id).
        try:
            self.identity = identity.identity(cfg.username, cfg.cert, self.client_id)
        except identity.IdentityError as exc:
            raise FogctlError(str(exc)) from None
        self.reply_filter = topics.replies_inbox(cfg.cluster, self.identity)
        self.reply_topic = topics.replies(cfg.cluster, self.identity, self.identity)  # sync markers
        self._inbox: "queue.Queue[Message]" = queue.Queue()
        self._acks: "queue.Queue[Tuple[str, Any]]" = queue.Queue()
        self._connected = threading.Event()
        self._connect_rc: Optional[Any] = None
        self._client: Optional[mqtt.Client] = None
        self._filters: List[str] = []  # re-subscribed after an automatic reconnect
        self._filters_lock = threading.Lock()
        self.reconnects = 0

    # -- connection ------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        host, port = self.cfg.address
        return f"{host}:{port}"

    def __enter__(self) -> "Connection":
        self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def connect(self) -> None:
        host, port = self.cfg.address
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv5)
        if self.cfg.username is not None:
            c.username_pw_set(self.cfg.username, self.cfg.resolved_password())
        if self.cfg.cafile or self.cfg.cert:
            try:
                c.tls_set(ca_certs=self.cfg.cafile, certfile=self.cfg.cert, keyfile=self.cfg.key)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise FogctlError(f"TLS set-up failed: {exc}") from None
            if self.cfg.insecure:
                c.tls_insecure_set(True)
        c.connect_timeout = self.cfg.timeout
        c.reconnect_delay_set(1, 5)  # `watch` comes back within seconds of a broker restart
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.on_subscribe = self._on_subscribe
        c.on_publish = self._on_publish
        self._client = c
        try:
            c.connect(host, port, keepalive=self.cfg.keepalive)
        except (OSError, ssl.SSLError) as exc:
            self._client = None
            raise BrokerUnreachable(self.address, _reason(exc)) from None
        c.loop_start()
        if not self._connected.wait(self.cfg.timeout):
            self.close()
            raise BrokerUnreachable(self.address, f"no CONNACK within {self.cfg.timeout:g}s")
        rc = self._connect_rc
        if rc is not None and getattr(rc, "is_failure", False):
            self.close()
            raise FogctlError(f"the broker at {self.address} refused the connection: {rc}")
        # Our own reply topic first: rpc replies and the snapshot sync marker arrive there.
        self._subscribe([self.reply_filter])

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
        self._connect_rc = rc
        self._connected.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        corr = None
        props = getattr(msg, "properties", None)
        if props is not None and hasattr(props, "CorrelationData"):
            corr = props.CorrelationData
        self._inbox.put(Message(msg.topic, bytes(msg.payload), bool(msg.retain), corr))

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, rcs: Any, props: Any = None) -> None:
        self._acks.put(("suback", (mid, rcs)))

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any = None, props: Any = None) -> None:
        self._acks.put(("puback", mid))

    # -- helpers -----------------------------------------------------------------------------------

    def _is_reply(self, m: Message) -> bool:
        """A message on our own reply namespace (a reply or a sync marker)."""
        parsed = topics.parse(self.cfg.cluster, m.topic)
        return parsed is not None and parsed.kind == "reply" and parsed.node == self.identity

    def _require(self) -> mqtt.Client:
        if self._client is None:
            raise FogctlError("not connected")
        return self._client

    def _wait_ack(self, kind: str, mid: int, deadline: float) -> Any:
        pending: List[Tuple[str, Any]] = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout(f"no {kind.upper()} from the broker at {self.address} within {self.cfg.timeout:g}s")
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
            raise FogctlError(f"subscribe to {', '.join(filters)} failed: {mqtt.error_string(rc)}")
        _, rcs = self._wait_ack("suback", mid, time.monotonic() + self.cfg.timeout)
        bad = [f for f, r in zip(filters, rcs) if getattr(r, "is_failure", False)]
        if bad:
            raise FogctlError(f"the broker refused the subscription to {bad[0]} (not authorized?)")
        with self._filters_lock:
            self._filters += [f for f in filters if f not in self._filters]

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                properties: Optional[Properties] = None) -> None:
        """Publish and wait for the broker's PUBACK (QoS 1), so that 'done' means delivered."""
        c = self._require()
        info = c.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise FogctlError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        if qos > 0:
            self._wait_ack("puback", info.mid, time.monotonic() + self.cfg.timeout)

    # -- the three ways fogctl reads -------------------------------------------------------------

    def snapshot(self, filters: Sequence[str]) -> Dict[str, Message]:
        """The retained messages on `filters` now, by topic (empty payloads = cleared, omitted)."""
        self._subscribe(filters)
        marker = _SYNC + uuid.uuid4().hex.encode()
        self.publish(self.reply_topic, marker, qos=1)
        deadline = time.monotonic() + self.cfg.timeout
        out: Dict[str, Message] = {}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"the broker at {self.address} did not echo our sync marker within {self.cfg.timeout:g}s")
            try:
                m = self._inbox.get(timeout=left)
            except queue.Empty:
                continue
            if self._is_reply(m):
                if m.topic == self.reply_topic and m.payload == marker:
                    break
                continue
            if m.payload:
                out[m.topic] = m
        self._unsubscribe(filters)
        return out

    def _unsubscribe(self, filters: Sequence[str]) -> None:
        c = self._require()
        c.unsubscribe(list(filters))
        with self._filters_lock:
            self._filters = [f for f in self._filters if f not in filters]
        # Drop whatever live messages of these filters are still queued.
        keep: List[Message] = []
        while True:
            try:
                m = self._inbox.get_nowait()
            except queue.Empty:
                break
            if self._is_reply(m):
                keep.append(m)
        for m in keep:
            self._inbox.put(m)

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
        return self.request(topics.agent_rpc(self.cfg.cluster, node, self.identity), body, timeout)

    def request(self, topic: str, body: Dict[str, Any], timeout: Optional[float] = None) -> Dict[str, Any]:
        """MQTT 5 request/response on a request topic that names us (agent.topics.agent_rpc):
        the reply comes on `replies/<identity>/<node>` with our correlation data (the agent
        computes the reply topic from the request's topic; no Response Topic is sent)."""
        corr = uuid.uuid4().hex.encode()
        target = topics.parse(self.cfg.cluster, topic)
        replier = target.node if target is not None and target.kind in ("rpc", "peer") else None
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = corr
        props.ContentType = "application/json"
        self.publish(topic, json.dumps(body, sort_keys=True).encode(), qos=1, properties=props)
        wait = self.cfg.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"no reply on {topic} within {wait:g}s (is the agent online and up to date?)")
            try:
                m = self._inbox.get(timeout=left)
            except queue.Empty:
                continue
            if m.retain or not self._is_reply(m) or m.correlation != corr:
                continue  # replies are never retained (docs/security.md)
            sender = topics.parse(self.cfg.cluster, m.topic)
            if replier is not None and sender is not None and sender.sender != replier:
                continue  # our correlation, but not from the agent we asked
            try:
                reply = wire.loads(m.payload, what=f"the reply on {m.topic}", expect=dict)
            except wire.BusInputError as exc:
                raise FogctlError(str(exc)) from None
            return reply


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror or exc})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error ({exc.reason or exc})"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__

