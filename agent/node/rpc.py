"""Requests to an agent and its replies over MQTT 5: spawn an instance, stop one, ping, steer.

Topics (docs/security.md; built and parsed only by agent.topics): an admin's control request goes
to `agents/<node>/rpc/<admin>`, a node's protocol request (createNode's spawn, a keeper's
hand-over, a re-home) to `agents/<node>/peer/<requester>`, and the reply to
`replies/<requester>/<node>`. The replier computes the reply topic from the request's topic (the
broker's ACL proved who wrote it); the MQTT 5 Response Topic is ignored, so no request can aim a
reply at somebody else's topic. Correlation Data is echoed, and a requester matches replies by it.

Rules of this file: pure (time is passed in; agent.node.bus builds a message's properties from
its correlation). The blocking caller of tools is `agent.node.deploy.RpcClient`; the daemon keeps
its own calls in agent.node.spawns and never blocks on a call. Bodies are parsed with agent.wire
(bounded size and depth) and refused with a ValueError saying why.

Request body (JSON): {"op": "spawn", "spec": {InstanceSpec}} | {"op": "stop", "instance": id,
"forget": true (an undeploy: the stored spec goes too)}
                     | {"op": "set", "instance": id, "fields": {...}}   (a "set" control line,
                       e.g. {"service_time_ms": 5.0}: tests and the demo slow an instance down)
                     | {"op": "ping"} | scale / drain / undrain / pin (agent.control.rpc_schema)
                     | {"op": "state_chunk", "instance": id, "index": i, "manifest": {...},
                       "data": base64} (peer only, never answered: agent.node.statexfer)
                     | {"op": "replica", "instance": id, "gen": g, ...} (peer only: agent.node.replicas)
Reply body (JSON):   {"ok": true, "instance": id, "node": node} | {"ok": false, "error": "..."}
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Optional, Tuple

from agent import wire

OPS = ("spawn", "stop", "set", "ping", "scale", "drain", "undrain", "pin", "state_chunk", "replica")
# What a node may ask another on its peer topic: agent.node.gate.PEER_OPS.
# Keys of a worker's control line itself (agent.node.supervisor): a "set" field may not
# replace them (`control_line(event, **fields)` takes the event under that name).
CONTROL_KEYS = frozenset({"event"})


def encode(body: Dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode_request(payload: bytes) -> Dict[str, Any]:
    """Parse a request; raise ValueError saying what is wrong (the caller replies with it)."""
    body = wire.loads(payload, what="request", expect=dict)
    if body.get("op") not in OPS:
        raise ValueError(f"request without a known 'op' (expected one of {OPS})")
    if body["op"] == "spawn" and not isinstance(body.get("spec"), dict):
        raise ValueError("spawn request without a 'spec' object")
    if body["op"] in ("stop", "set", "state_chunk", "replica") and not isinstance(body.get("instance"), str):
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


class SeenRequests:
    """The requests recently handled, per requester: one that arrives again with the same
    correlation and the same payload is a redelivery (QoS 1 is at least once: a bridge that
    resumes its session after its uplink broke, before its PUBACK passed, gets the request a
    second time, docs/scale.md "Sites") and must not be applied twice. The payload is part of the
    key so that a requester that reuses a correlation for another request is not mistaken for a
    redelivery. Pure: time is an argument.

    Bounded by `capacity` (the oldest entry goes first) and by `ttl` seconds, longer than any
    requester waits (a request's Message Expiry is its requester's timeout)."""

    def __init__(self, capacity: int = 1024, ttl: float = 600.0) -> None:
        self.capacity, self.ttl = capacity, ttl
        self._seen: Dict[Tuple[str, bytes, bytes], float] = {}

    def first(self, requester: str, correlation: Optional[bytes], payload: bytes, now: float) -> bool:
        """True the first time (requester, correlation, payload) is seen within `ttl`, False
        after. A request without correlation data cannot be told apart from another: True."""
        if not correlation:
            return True
        key = (requester, bytes(correlation), hashlib.sha256(payload).digest())
        seen = self._seen.get(key)
        if seen is not None and now - seen <= self.ttl:
            return False
        self._seen.pop(key, None)
        self._seen[key] = now
        while len(self._seen) > self.capacity:
            del self._seen[next(iter(self._seen))]
        return True

    def __len__(self) -> int:
        return len(self._seen)


def correlation_of(msg: Any) -> Optional[bytes]:
    """The Correlation Data of a received paho message, if any (its Response Topic is ignored)."""
    props = getattr(msg, "properties", None)
    cd = getattr(props, "CorrelationData", None) if props is not None else None
    return bytes(cd) if isinstance(cd, (bytes, bytearray)) else None


__all__ = [
    "CONTROL_KEYS",
    "OPS",
    "decode_reply",
    "decode_request",
    "encode",
    "correlation_of",
]
