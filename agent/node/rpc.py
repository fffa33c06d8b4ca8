"""Requests to an agent and its replies over MQTT 5: spawn an instance, stop one, ping, steer.

Topics (docs/security.md; built and parsed only by agent.topics): an admin's control request goes
to `agents/<node>/rpc/<admin>`, a node's protocol request (createNode's spawn, a keeper's
hand-over, a re-home) to `agents/<node>/peer/<requester>`, and the reply to
`replies/<requester>/<node>`. The replier computes the reply topic from the request's topic (the
broker's ACL proved who wrote it); the MQTT 5 Response Topic is ignored, so no request can aim a
reply at somebody else's topic. Correlation Data is echoed, and a requester matches replies by it.

Rules of this file: the codec and `PendingCalls` are pure (time is passed in); only
`RpcClient` does I/O (a small blocking client for `fog-agent deploy` and tools; the daemon drives
`PendingCalls` from its own event loop and never blocks on a call). Bodies are parsed with
agent.wire (bounded size and depth) and refused with a ValueError saying why.

Request body (JSON): {"op": "spawn", "spec": {InstanceSpec}} | {"op": "stop", "instance": id,
"forget": true (an undeploy: the stored spec goes too)}
                     | {"op": "set", "instance": id, "fields": {...}}   (a "set" control line,
                       e.g. {"service_time_ms": 5.0}: tests and the demo slow an instance down)
                     | {"op": "ping"} | scale / drain / undrain / pin (agent.control.rpc_schema)
Reply body (JSON):   {"ok": true, "instance": id, "node": node} | {"ok": false, "error": "..."}
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from agent import identity as identity_mod
from agent import topics, wire

OPS = ("spawn", "stop", "set", "ping", "scale", "drain", "undrain", "pin")
# What a node may ask another node on its peer topic: createNode()'s spawn (also the carrier
# of a keeper's hand-over and of a re-home, which are spawns of an existing identity).
PEER_OPS = ("spawn",)
# Keys of a worker's control line itself (agent.node.supervisor): a "set" field may not
# replace them (`control_line(event, **fields)` takes the event under that name).
CONTROL_KEYS = frozenset({"event"})

# Payload prefix of a snapshot's sync marker on our own reply topic (never a JSON reply).
_SYNC = b"\x00fog-sync:"


class RpcError(RuntimeError):
    """A call failed: timeout, refused by the remote agent, or undecodable reply."""


def encode(body: Dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode_request(payload: bytes) -> Dict[str, Any]:
    """Parse a request; raise ValueError saying what is wrong (the caller replies with it)."""
    body = wire.loads(payload, what="request", expect=dict)
    if body.get("op") not in OPS:
        raise ValueError(f"request without a known 'op' (expected one of {OPS})")
    if body["op"] == "spawn" and not isinstance(body.get("spec"), dict):
        raise ValueError("spawn request without a 'spec' object")
    if body["op"] in ("stop", "set") and not isinstance(body.get("instance"), str):
        raise ValueError(f"{body['op']} request without an 'instance' string")
    if body["op"] == "set":
        fields = body.get("fields")
        if not isinstance(fields, dict):
            raise ValueError("set request without a 'fields' object")
        clash = sorted(CONTROL_KEYS.intersection(fields))
        if clash:
            raise ValueError(f"set request: field name {clash[0]!r} is reserved by the control line")
    return body


def decode_reply(payload: bytes) -> Dict[str, Any]:
    body = wire.loads(payload, what="reply", expect=dict)
    if not isinstance(body.get("ok"), bool):
        raise ValueError("reply without a boolean 'ok'")
    return body


@dataclass
class Call:
    """One outstanding call: what it was for (opaque `context`) and when to give up."""

    correlation: str
    node: str
    deadline: float
    context: Any = None


@dataclass
class PendingCalls:
    """Outstanding calls by correlation id; the event loop feeds replies and the time."""

    calls: Dict[str, Call] = field(default_factory=dict)

    def add(self, correlation: str, node: str, now: float, timeout: float, context: Any = None) -> Call:
        call = Call(correlation, node, now + timeout, context)
        self.calls[correlation] = call
        return call

    def resolve(self, correlation: str) -> Optional[Call]:
        """The call a reply answers, or None for a late or foreign reply (ignored)."""
        return self.calls.pop(correlation, None)

    def expired(self, now: float) -> List[Call]:
        gone = [c for c in self.calls.values() if c.deadline <= now]
        for c in gone:
            del self.calls[c.correlation]
        return gone

    def __len__(self) -> int:
        return len(self.calls)


def publish_properties(correlation: str) -> Any:
    """A request's properties: Correlation Data only (the reply topic follows from the topic)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)
    props.CorrelationData = correlation.encode()
    return props


def reply_properties(correlation: bytes) -> Any:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)
    props.CorrelationData = correlation
    return props


def correlation_of(msg: Any) -> Optional[bytes]:
    """The Correlation Data of a received paho message, if any (its Response Topic is ignored)."""
    props = getattr(msg, "properties", None)
    cd = getattr(props, "CorrelationData", None) if props is not None else None
    return bytes(cd) if isinstance(cd, (bytes, bytearray)) else None


class RpcClient:
    """Blocking caller for tools (deploy, demo): one paho client, its own network thread.

    Only the caller's thread publishes (paho is not safe to publish from several threads); the
    network thread's callbacks only put replies into a queue.
    """

    def __init__(self, host: str, port: int, cluster: str, client_id: Optional[str] = None,
                 username: Optional[str] = None, password: Optional[str] = None,
                 identity: Optional[str] = None, cert_file: Optional[str] = None,
                 ca_file: Optional[str] = None, key_file: Optional[str] = None, tls_insecure: bool = False) -> None:
        import paho.mqtt.client as mqtt

        self.cluster = cluster
        self.client_id = client_id or f"fog-tool-{uuid.uuid4().hex[:10]}"
        # agent.identity: user name, else the certificate's CN, else the client id
        self.identity = topics._check(identity) if identity else identity_mod.identity(username, cert_file, self.client_id)
        self.reply_filter = topics.replies_inbox(cluster, self.identity)
        self.reply_topic = topics.replies(cluster, self.identity, self.identity)  # the sync marker's
        self._replies: "queue.SimpleQueue[Tuple[str, str, bytes]]" = queue.SimpleQueue()
        self._retained: "queue.SimpleQueue[Tuple[str, bytes]]" = queue.SimpleQueue()
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv5)
        if username:
            c.username_pw_set(username, password)
        if ca_file:  # the role's broker: TLS, and the certificate's CN is our identity
            c.tls_set(ca_certs=ca_file, certfile=cert_file, keyfile=key_file)
            if tls_insecure:
                c.tls_insecure_set(True)
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.on_subscribe = lambda *a, **k: self._subscribed.set()
        self._client = c
        self._host, self._port = host, port

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any = None) -> None:
        if not reason.is_failure:
            client.subscribe(self.reply_filter, qos=1)
            self._connected.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        parsed = topics.parse(self.cluster, msg.topic)
        if parsed is not None and parsed.kind == "reply" and parsed.node == self.identity:
            if msg.retain:
                return  # a reply is never retained (docs/security.md): a leftover or a forgery
            if msg.topic == self.reply_topic and msg.payload.startswith(_SYNC):
                self._retained.put((msg.topic, msg.payload))  # a snapshot's sync marker
            else:
                cd = correlation_of(msg)
                self._replies.put(((cd or b"").decode(errors="replace"), parsed.sender or "", msg.payload))
        else:
            self._retained.put((msg.topic, msg.payload))

    def connect(self, timeout: float = 10.0) -> "RpcClient":
        self._client.connect(self._host, self._port, keepalive=10)
        self._client.loop_start()
        if not self._connected.wait(timeout) or not self._subscribed.wait(timeout):
            self.close()
            raise RpcError(f"cannot connect to the broker at {self._host}:{self._port} within {timeout}s")
        return self

    def close(self) -> None:
        try:
            self._client.disconnect()
        finally:
            self._client.loop_stop()

    def __enter__(self) -> "RpcClient":
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1) -> None:
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc != 0:
            raise RpcError(f"publish to {topic} failed with rc={info.rc}")
        info.wait_for_publish(timeout=10)

    def snapshot(self, topic_filter: str, settle: float = 0.3, timeout: float = 10.0) -> Dict[str, bytes]:
        """Retained messages under a filter, ended by a *sync marker*, not by silence.

        Why: waiting for `settle` s of silence never ends when agents publish their state more
        often than that (three agents every 0.5 s hung `fog-agent deploy` for 8 min). After the
        SUBACK we publish a marker to our own reply topic (QoS 1); Mosquitto queues a
        subscription's retained messages on the session before it routes any later publish to
        it, so when the marker comes back every retained message has arrived (fogctl's client
        does the same). `timeout` is a hard deadline for the whole snapshot; `settle` is kept
        for callers of the old signature and ignored.
        """
        import paho.mqtt.client as mqtt

        del settle
        while True:  # forget messages of an earlier snapshot that arrived after it ended
            try:
                self._retained.get_nowait()
            except queue.Empty:
                break
        hard_deadline = time.monotonic() + timeout
        acked = threading.Event()
        self._client.on_subscribe = lambda *a, **k: acked.set()
        rc, _mid = self._client.subscribe(topic_filter, qos=1)
        if rc != 0 or not acked.wait(timeout):
            raise RpcError(f"cannot subscribe to {topic_filter} (rc={rc})")
        marker = _SYNC + uuid.uuid4().hex.encode()
        info = self._client.publish(self.reply_topic, marker, qos=1)
        if info.rc != 0:
            self._client.unsubscribe(topic_filter)
            raise RpcError(f"sync marker to {self.reply_topic} not queued (rc={info.rc})")
        out: Dict[str, bytes] = {}
        try:
            while True:
                left = hard_deadline - time.monotonic()
                if left <= 0:
                    raise RpcError(f"snapshot of {topic_filter}: the broker did not echo our sync "
                                   f"marker within {timeout:g}s")
                try:
                    topic, payload = self._retained.get(timeout=left)
                except queue.Empty:
                    continue
                if topic == self.reply_topic:
                    if payload == marker:
                        break
                    continue  # the marker of an earlier, timed-out snapshot
                if mqtt.topic_matches_sub(topic_filter, topic):
                    out[topic] = payload
        finally:
            self._client.unsubscribe(topic_filter)
        return out

    def call(self, node: str, body: Dict[str, Any], timeout: float = 30.0) -> Dict[str, Any]:
        """Send one request to `node`'s agent and wait for its reply; raise RpcError on failure."""
        correlation = uuid.uuid4().hex
        props = publish_properties(correlation)
        topic = topics.agent_rpc(self.cluster, node, self.identity)
        info = self._client.publish(topic, encode(body), qos=1, properties=props)
        if info.rc != 0:
            raise RpcError(f"request to {node} not queued (rc={info.rc})")
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RpcError(f"no reply from agent {node} within {timeout}s to {body.get('op')}")
            try:
                corr, sender, payload = self._replies.get(timeout=left)
            except queue.Empty:
                continue
            if corr != correlation or sender != node:
                continue  # a late reply to an earlier call, or not from the node we asked
            try:
                return decode_reply(payload)
            except ValueError as exc:
                raise RpcError(f"bad reply from {node}: {exc}") from None


__all__ = [
    "CONTROL_KEYS",
    "Call",
    "OPS",
    "PEER_OPS",
    "PendingCalls",
    "RpcClient",
    "RpcError",
    "decode_reply",
    "decode_request",
    "encode",
    "correlation_of",
    "publish_properties",
    "reply_properties",
]
