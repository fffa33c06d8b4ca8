"""A keyed keeper's state shipped with its drain hand-over, in chunks under the broker's limit.

Why chunks: the hand-over is a createNode() spawn on the target's peer topic, and a control
payload is at most `wire.MAX_CONTROL_BYTES` (256 KiB; the broker's `max_packet_size` is 1 MiB),
while a keyed operator's state of several MB is normal (docs/operators.md, "Keyed state"). So the
draining agent sends the compacted snapshot (`keyed_saves.load_saved`: snapshot + log, what a restart
would restore) as `state_chunk` requests on the same peer topic just before the spawn (one topic,
one QoS: the broker keeps their order), and the spawn's spec carries only a manifest (size,
SHA-256, chunk count). The target assembles the chunks here and starts the worker only with the
whole, verified state; anything else refuses the spawn, and the draining agent then tries the
next node or restarts the keeper at home (never a keeper without its state).

Everything here comes from the bus and is hostile until checked (docs/security.md): sizes are
bounded before anything is decoded or kept (per chunk, per transfer, all transfers together),
the chunks are keyed by the node that sent them (the topic proves it), a transfer left
incomplete expires, and the content is parsed with `wire.loads` under a size and depth bound.
No path is ever taken from a message: the daemon writes the state under the instance id it
validated. Sans-IO: the caller passes the time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from agent import topics, wire
from agent.instance.keyed_saves import FORMAT, load_saved

__all__ = ["CHUNK_BYTES", "MAX_STATE_BYTES", "MAX_STAGED_BYTES", "STAGE_TTL", "Manifest", "Staging",
           "chunk_bodies", "check_keyed", "snapshot_bytes", "too_large"]

# Raw bytes per chunk: in base64 (x 4/3) plus its JSON header, a chunk request is ~171 KiB,
# under wire.MAX_CONTROL_BYTES (256 KiB) and the broker's max_packet_size (1 MiB).
CHUNK_BYTES = 128 * 1024
# The largest keyed state a drain hand-over carries (128 chunks, ~21 MiB on the wire). A larger one is refused before
# anything stops (agent.node.requests, `Requests.steer`), naming its size and this limit.
MAX_STATE_BYTES = 16 << 20
# What a receiving agent holds in memory for transfers being assembled, all senders together.
MAX_STAGED_BYTES = 2 * MAX_STATE_BYTES
# An incomplete transfer is dropped this long after its last chunk (its spawn never came, or
# failed elsewhere). Longer than the spawn's RPC timeout (daemon.RPC_TIMEOUT, 30 s).
STAGE_TTL = 120.0
# Nesting of a keyed snapshot: 4 levels of its own (groups -> group -> pairs -> pair) plus the
# operator's state values; deeper is refused before parsing.
MAX_STATE_DEPTH = 64

_HEX64 = re.compile(r"[0-9a-f]{64}")
_TRANSFER = re.compile(r"[A-Za-z0-9._-]{1,80}")


def too_large(size: int) -> Optional[str]:
    """Why a keyed state of `size` bytes cannot travel with a hand-over, or None."""
    if size > MAX_STATE_BYTES:
        return f"its keyed state is {size} bytes, more than the {MAX_STATE_BYTES} a hand-over carries"
    return None


@dataclass(frozen=True)
class Manifest:
    """What the spawn's `extra.handover_keyed` says about the chunks sent before it."""

    transfer: str
    size: int
    sha256: str
    chunks: int

    def to_json(self) -> Dict[str, Any]:
        return {"transfer": self.transfer, "bytes": self.size, "sha256": self.sha256, "chunks": self.chunks}

    @staticmethod
    def from_json(d: Any) -> "Manifest":
        """Validated: ValueError saying what is wrong."""
        if not isinstance(d, dict):
            raise ValueError("manifest: expected an object")
        transfer, size, digest, chunks = d.get("transfer"), d.get("bytes"), d.get("sha256"), d.get("chunks")
        if not isinstance(transfer, str) or not _TRANSFER.fullmatch(transfer):
            raise ValueError("manifest: 'transfer' must be 1-80 characters of [A-Za-z0-9._-]")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_STATE_BYTES:
            raise ValueError(f"manifest: 'bytes' must be an integer in 1..{MAX_STATE_BYTES}")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError("manifest: 'sha256' must be 64 lowercase hex digits")
        if chunks != -(-size // CHUNK_BYTES):
            raise ValueError(f"manifest: 'chunks' must be {-(-size // CHUNK_BYTES)} for {size} bytes")
        return Manifest(transfer, size, digest, chunks)

    def chunk_size(self, index: int) -> int:
        return min(CHUNK_BYTES, self.size - index * CHUNK_BYTES)


def snapshot_bytes(path: Path) -> Optional[bytes]:
    """The keyed state saved at `path` (`<instance>.keyed.json` and its log) as one compact JSON
    document: what a restart would restore (states, output counters, applied numbers, unacked
    outputs). None when the instance never saved one."""
    data = load_saved(path)
    return None if data is None else json.dumps(data, separators=(",", ":")).encode()


def chunk_bodies(instance: str, transfer: str, data: bytes) -> Tuple[Manifest, List[Dict[str, Any]]]:
    """The manifest for the spawn's spec and the `state_chunk` request bodies that go before it."""
    m = Manifest(transfer, len(data), hashlib.sha256(data).hexdigest(), -(-len(data) // CHUNK_BYTES))
    bodies = [dict(op="state_chunk", instance=instance, index=i, manifest=m.to_json(),
                   data=base64.b64encode(data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]).decode())
              for i in range(m.chunks)]
    return m, bodies


@dataclass
class _Assembly:
    manifest: Manifest
    parts: Dict[int, bytes] = field(default_factory=dict)
    touched: float = 0.0

    @property
    def have(self) -> int:
        return sum(len(p) for p in self.parts.values())


class Staging:
    """The receiving agent's transfers being assembled, by (sending node, instance)."""

    def __init__(self, max_bytes: int = MAX_STAGED_BYTES, ttl: float = STAGE_TTL) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._by: Dict[Tuple[str, str], _Assembly] = {}

    def staged_bytes(self) -> int:
        return sum(a.manifest.size for a in self._by.values())

    def add(self, sender: str, body: Dict[str, Any], now: float) -> None:
        """One `state_chunk` request from node `sender` (the topic proved it); ValueError if it is
        malformed, does not fit its manifest, or would exceed the staging bound. A chunk of a new
        transfer for the same instance replaces the older transfer."""
        self.expire(now)
        instance, index, data = body.get("instance"), body.get("index"), body.get("data")
        if not isinstance(instance, str):
            raise ValueError("state_chunk without an 'instance' string")
        topics._check(instance)
        m = Manifest.from_json(body.get("manifest"))
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < m.chunks:
            raise ValueError(f"state_chunk: 'index' must be an integer in 0..{m.chunks - 1}")
        want = m.chunk_size(index)
        if not isinstance(data, str) or len(data) != 4 * -(-want // 3):  # checked before decoding
            raise ValueError(f"state_chunk {index}: 'data' must be {want} bytes in base64")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"state_chunk {index}: 'data' is not base64") from None
        if len(raw) != want:
            raise ValueError(f"state_chunk {index}: {len(raw)} bytes, the manifest says {want}")
        key = (sender, instance)
        a = self._by.get(key)
        if a is None or a.manifest != m:
            others = self.staged_bytes() - (a.manifest.size if a is not None else 0)
            if others + m.size > self.max_bytes:
                raise ValueError(f"state_chunk: {m.size} more bytes would exceed the {self.max_bytes} "
                                 "staged for hand-overs")
            a = self._by[key] = _Assembly(m)
        a.parts[index] = raw
        a.touched = now

    def take(self, sender: str, instance: str, manifest: Any) -> bytes:
        """The whole state `manifest` announces, verified (length and SHA-256), and forgotten here;
        ValueError saying what is missing or wrong."""
        m = Manifest.from_json(manifest)
        a = self._by.pop((sender, instance), None)
        if a is None or a.manifest.transfer != m.transfer:
            raise ValueError(f"no keyed state staged from {sender} (transfer {m.transfer})")
        if a.manifest != m or len(a.parts) != m.chunks:
            raise ValueError(f"keyed state incomplete: {len(a.parts)} of {m.chunks} chunks from {sender}")
        data = b"".join(a.parts[i] for i in range(m.chunks))
        if hashlib.sha256(data).hexdigest() != m.sha256:
            raise ValueError("keyed state does not match its SHA-256")
        return data

    def expire(self, now: float) -> None:
        for key in [k for k, a in self._by.items() if now - a.touched > self.ttl]:
            del self._by[key]


def check_keyed(data: bytes, operator: str, key_groups: int) -> Dict[str, Any]:
    """The shipped keyed snapshot parsed under bounds and checked against the spec: the operator
    it belongs to, its key group count (the pipeline's), its format (what `KeyedState.restore`
    reads; the worker's restore checks the contents, as at any restart). ValueError saying what
    is wrong."""
    doc = wire.loads(data, what="keyed state", max_bytes=MAX_STATE_BYTES, max_depth=MAX_STATE_DEPTH, expect=dict)
    if doc.get("operator") != operator:
        raise ValueError(f"keyed state of operator {str(doc.get('operator'))[:80]!r}, the spec's is {operator!r}")
    if doc.get("key_groups") != key_groups:
        raise ValueError(f"keyed state with {str(doc.get('key_groups'))[:20]} key groups, the pipeline says {key_groups}")
    if doc.get("format") not in (1, FORMAT) or not isinstance(doc.get("groups", {}), dict):
        raise ValueError(f"keyed state: not a saved keyed state (format 1 or {FORMAT} with a 'groups' object)")
    return doc
