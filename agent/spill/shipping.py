"""Shipping closed spool files to the centre, sans-IO: the wire format and `ShipperCore`.

Why apart from the drivers (shipper.py): the collector's core reads the same wire format and is
sans-IO too; it must not import paho to decode a chunk.

Rules of this file:
- `ShipperCore` is sans-IO: it receives files (bytes), acks and the current time, and returns the
  MQTT publications to make. It never reads a clock or a socket; `MqttShipper` is the thin driver
  (one paho client, one owner thread) and `PathShipper` the shared-filesystem variant.
- A file's id is the sha256 of its bytes (`spool.file_id`): a resent file has the same id, so the
  collector stores it once and acks the duplicate.
- Wire format, topic `fog/<cluster>/spill/<node>/chunk`, QoS 1: one JSON header line, a newline,
  then the raw chunk bytes. The header carries the chunk's own sha256, so the collector detects a
  damaged chunk before it is assembled, and answers a NACK naming the chunks to resend.
- A file stays in the spool until the collector's ack (`fog/<cluster>/spill/<node>/ack`,
  {"file_id", "status": "landed"|"duplicate"}) arrives. No ack within the timeout: the whole file
  is sent again, with exponential back-off (so a collector that is down for long does not flood
  the broker's queue). At most `window` files are in flight.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from agent import topics, wire
from agent.spill.spool import ClosedFile, file_id

__all__ = [
    "Ack",
    "ChunkHeader",
    "FileMeta",
    "Outgoing",
    "ShipperCore",
    "ack_topic",
    "chunk_subscription",
    "chunk_topic",
    "decode_chunk",
    "encode_chunk",
    "meta_for",
    "split_file",
]


WIRE_VERSION = 1


def chunk_topic(cluster: str, node: str) -> str:
    return topics.spill_chunk(cluster, node)


def ack_topic(cluster: str, node: str) -> str:
    return topics.spill_ack(cluster, node)


def chunk_subscription(cluster: str) -> str:
    """What the collector subscribes to: every node's chunks."""
    return topics.all_spill_chunks(cluster)


@dataclass(frozen=True)
class FileMeta:
    """What the collector needs to land a file: its id and its landing partition."""

    file_id: str
    name: str
    kind: str
    node: str
    date: str
    size: int


@dataclass(frozen=True)
class ChunkHeader:
    file_id: str
    name: str
    kind: str
    node: str
    date: str
    size: int  # whole file
    index: int
    count: int
    sha256: str  # of this chunk's bytes

    def __post_init__(self) -> None:
        if not (0 <= self.index < self.count):
            raise ValueError(f"chunk index {self.index} outside 0..{self.count - 1}")
        if len(self.file_id) != 64 or len(self.sha256) != 64:
            raise ValueError("file_id and sha256 must be 64 hex digits")

    @property
    def meta(self) -> FileMeta:
        return FileMeta(self.file_id, self.name, self.kind, self.node, self.date, self.size)


@dataclass(frozen=True)
class Outgoing:
    topic: str
    payload: bytes
    file_id: str = ""
    index: int = -1


@dataclass(frozen=True)
class Ack:
    """Collector -> shipper: landed / duplicate (done), or nack with the chunks to resend."""

    file_id: str
    status: str  # "landed" | "duplicate" | "nack"
    missing: Tuple[int, ...] = ()
    reason: str = ""

    def encode(self) -> bytes:
        return json.dumps({"file_id": self.file_id, "status": self.status,
                           "missing": list(self.missing), "reason": self.reason}).encode()

    @classmethod
    def decode(cls, payload: bytes) -> "Ack":
        d = wire.loads(payload, what="spill ack", expect=dict)
        if d.get("status") not in ("landed", "duplicate", "nack"):
            raise ValueError(f"unknown ack status {d.get('status')!r}")
        try:
            return cls(str(d["file_id"]), d["status"], tuple(int(i) for i in d.get("missing", ())),
                       str(d.get("reason", "")))
        except (KeyError, TypeError) as exc:  # bus input: one ValueError, never another type
            raise ValueError(f"spill ack: {type(exc).__name__}: {str(exc)[:80]}") from None


def encode_chunk(header: ChunkHeader, body: bytes) -> bytes:
    h = {"v": WIRE_VERSION, **{k: getattr(header, k) for k in header.__dataclass_fields__}}
    return json.dumps(h, separators=(",", ":")).encode() + b"\n" + body


def decode_chunk(payload: bytes) -> Tuple[ChunkHeader, bytes]:
    """Split a chunk message; raises ValueError if the header is unreadable (body not checked)."""
    head, sep, body = payload.partition(b"\n")
    if not sep:
        raise ValueError("chunk without header line")
    h = wire.loads(head, what="chunk header")  # wire.BusInputError is a ValueError
    if not isinstance(h, dict) or h.pop("v", None) != WIRE_VERSION:
        raise ValueError(f"chunk header: expected wire version {WIRE_VERSION}")
    try:
        return ChunkHeader(**h), body
    except TypeError as exc:
        raise ValueError(f"chunk header: {exc}") from None


def split_file(meta: FileMeta, data: bytes, chunk_bytes: int) -> List[Tuple[ChunkHeader, bytes]]:
    count = max(1, -(-len(data) // chunk_bytes))
    out = []
    for i in range(count):
        body = data[i * chunk_bytes:(i + 1) * chunk_bytes]
        out.append((ChunkHeader(meta.file_id, meta.name, meta.kind, meta.node, meta.date, meta.size,
                                i, count, hashlib.sha256(body).hexdigest()), body))
    return out


@dataclass
class _Flight:
    meta: FileMeta
    chunks: List[Tuple[ChunkHeader, bytes]]
    token: Any  # what the driver needs to release the file (its spool path)
    due: float = 0.0  # when to (re)send; 0 = now
    attempts: int = 0
    resend: Set[int] = field(default_factory=set)  # chunk indexes asked for by a nack


class ShipperCore:
    """Which chunks to publish when; pure (time is an argument)."""

    def __init__(self, cluster: str, node: str, *, chunk_bytes: int = 256 * 1024,
                 ack_timeout: float = 5.0, max_backoff: float = 60.0, window: int = 4) -> None:
        self.cluster, self.node = cluster, node
        self.chunk_bytes, self.ack_timeout, self.max_backoff, self.window = (
            chunk_bytes, ack_timeout, max_backoff, window)
        self.topic = chunk_topic(cluster, node)
        self._queue: List[_Flight] = []  # waiting for a window slot, in spool order
        self._flight: Dict[str, _Flight] = {}
        self._known: Set[str] = set()
        self.stats = {"files_sent": 0, "files_acked": 0, "chunks_sent": 0, "file_resends": 0,
                      "chunk_resends": 0, "nacks": 0, "duplicates_acked": 0}

    def knows(self, fid: str) -> bool:
        return fid in self._known

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._flight)

    def add(self, meta: FileMeta, data: bytes, token: Any = None) -> None:
        if meta.file_id in self._known:
            return
        self._known.add(meta.file_id)
        self._queue.append(_Flight(meta, split_file(meta, data, self.chunk_bytes), token))

    def poll(self, now: float) -> List[Outgoing]:
        """Chunks to publish now: new files entering the window, nacked chunks, timed-out files."""
        while self._queue and len(self._flight) < self.window:
            fl = self._queue.pop(0)
            self._flight[fl.meta.file_id] = fl
        out: List[Outgoing] = []
        for fl in self._flight.values():
            if fl.resend:
                idx = sorted(fl.resend)
                fl.resend.clear()
                self.stats["chunk_resends"] += len(idx)
                out.extend(self._out(fl, idx))
                fl.due = now + self.ack_timeout
            elif now >= fl.due:
                if fl.attempts:
                    self.stats["file_resends"] += 1
                else:
                    self.stats["files_sent"] += 1
                out.extend(self._out(fl, range(len(fl.chunks))))
                fl.due = now + min(self.max_backoff, self.ack_timeout * (2 ** fl.attempts))
                fl.attempts += 1
        self.stats["chunks_sent"] += len(out)
        return out

    def send_failed(self, fid: str, now: float) -> None:
        """The driver could not hand a chunk to the client (disconnected, queue full): retry soon."""
        fl = self._flight.get(fid)
        if fl is not None:
            fl.due = min(fl.due, now + min(1.0, self.ack_timeout))

    def on_ack(self, ack: Ack, now: float) -> Optional[Any]:
        """Returns the token of a file now safely at the centre (release it), else None."""
        fl = self._flight.get(ack.file_id)
        if fl is None:
            return None  # an ack for a file already released (a resend's second ack)
        if ack.status == "nack":
            self.stats["nacks"] += 1
            fl.resend.update(i for i in ack.missing if 0 <= i < len(fl.chunks))
            if not ack.missing:  # the whole file was rejected (assembled but bad): send all again
                fl.due = now
            return None
        if ack.status == "duplicate":
            self.stats["duplicates_acked"] += 1
        del self._flight[ack.file_id]
        self._known.discard(ack.file_id)
        self.stats["files_acked"] += 1
        return fl.token

    def _out(self, fl: _Flight, indexes: Any) -> List[Outgoing]:
        return [Outgoing(self.topic, encode_chunk(*fl.chunks[i]), fl.meta.file_id, i) for i in indexes]


def meta_for(f: ClosedFile, data: bytes) -> FileMeta:
    return FileMeta(file_id(data), f.name, f.kind, f.node, f.date, len(data))
