"""Collector core: chunks in, verified files out, acks back -- sans-IO (time is an argument).

Rules of this file:
- A chunk whose bytes do not match the sha256 in its header is never kept: the core answers a
  NACK naming it, and the shipper resends it. A header that cannot be parsed is counted and
  dropped (no file id to answer to; the shipper's timeout resends the file).
- When every chunk of a file is present, the file is handed to the landing zone (`land`), which
  checks the whole-file id and the gzip/JSON content again. A file that fails is dropped with a
  whole-file NACK; it is never landed.
- A chunk of a file already landed is answered "duplicate" at once (the shipper resent it because
  the first ack was lost or late): exactly once is the landing zone's property, the ack is only
  the shipper's permission to delete.
- Partial files older than `partial_timeout` are forgotten (the shipper resends them anyway).
- The sender is the node in the chunk's topic (`fog/<c>/spill/<node>/chunk`), which the broker's
  ACL lets only that node write (docs/security.md); a header naming another node is a forgery
  (it would land in that node's partition and steal its acks): counted, logged, never kept.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from agent.spill.landing import CorruptFile, LandResult
from agent.spill.shipping import Ack, ChunkHeader, FileMeta, ack_topic, decode_chunk

__all__ = ["CollectorCore", "Reply"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reply:
    topic: str
    ack: Ack


@dataclass
class _Partial:
    header: ChunkHeader
    chunks: Dict[int, bytes] = field(default_factory=dict)
    first_seen: float = 0.0


class CollectorCore:
    def __init__(self, cluster: str, land: Callable[[FileMeta, bytes], LandResult],
                 is_landed: Callable[[FileMeta], bool], partial_timeout: float = 600.0) -> None:
        self.cluster = cluster
        self._land, self._is_landed = land, is_landed
        self.partial_timeout = partial_timeout
        self._partials: Dict[str, _Partial] = {}
        self.landed: List[LandResult] = []
        self.stats = {"chunks": 0, "corrupt_chunks": 0, "bad_headers": 0, "files_landed": 0,
                      "duplicates": 0, "corrupt_files": 0, "records_landed": 0, "forged_senders": 0}

    def on_chunk(self, payload: bytes, now: float, sender: Optional[str] = None) -> List[Reply]:
        """`sender`: the node named by the chunk's topic (None: trust the header, sans-IO tests)."""
        self.stats["chunks"] += 1
        try:
            header, body = decode_chunk(payload)
        except ValueError as exc:
            self.stats["bad_headers"] += 1
            log.warning("dropping spill chunk with unreadable header: %s", exc)
            return []
        if sender is not None and header.node != sender:
            self.stats["forged_senders"] += 1
            log.warning("dropping spill chunk from %s that claims to come from node %.64r", sender, header.node)
            return []
        reply_to = ack_topic(self.cluster, header.node)
        meta = header.meta
        if self._is_landed(meta):
            self.stats["duplicates"] += 1
            self._partials.pop(header.file_id, None)
            return [Reply(reply_to, Ack(header.file_id, "duplicate"))]
        if hashlib.sha256(body).hexdigest() != header.sha256:
            self.stats["corrupt_chunks"] += 1
            log.warning("spill chunk %d/%d of %s from %s is corrupt: asking for it again",
                        header.index + 1, header.count, header.name, header.node)
            return [Reply(reply_to, Ack(header.file_id, "nack", (header.index,), "chunk checksum"))]
        part = self._partials.get(header.file_id)
        if part is None or part.header.count != header.count:
            part = self._partials[header.file_id] = _Partial(header, first_seen=now)
        part.chunks[header.index] = body
        if len(part.chunks) < header.count:
            return []
        del self._partials[header.file_id]
        data = b"".join(part.chunks[i] for i in range(header.count))
        try:
            result = self._land(meta, data)
        except CorruptFile as exc:
            self.stats["corrupt_files"] += 1
            log.warning("spill file rejected, asking for all of it again: %s", exc)
            return [Reply(reply_to, Ack(header.file_id, "nack", (), str(exc)))]
        if result.status == "duplicate":
            self.stats["duplicates"] += 1
        else:
            self.stats["files_landed"] += 1
            self.stats["records_landed"] += result.records
            self.landed.append(result)
        return [Reply(reply_to, Ack(header.file_id, result.status))]

    def expire(self, now: float) -> int:
        old = [fid for fid, p in self._partials.items() if now - p.first_seen > self.partial_timeout]
        for fid in old:
            del self._partials[fid]
        return len(old)

    @property
    def partial_files(self) -> int:
        return len(self._partials)

    def missing(self, file_id: str) -> Optional[Tuple[int, ...]]:
        p = self._partials.get(file_id)
        if p is None:
            return None
        return tuple(i for i in range(p.header.count) if i not in p.chunks)
