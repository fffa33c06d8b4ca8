"""The ingest log of a sensor source (agent.operators.taxi.MqttIngestSource): each record it
numbered, with the digest of the delivery it came from, written and synced before the record
leaves (`LogIngest`). A restarted source sends the records its successors had not acked again
under the same numbers, and knows the broker's redeliveries of them by their digests: exactly once
through a kill -9 of the worker or the agent and through a power cut. Not through the loss of the
node's disk: the log lives in `sink_dir` beside the source's position (docs/reliability.md).

One JSON line per entry, `[number, digest, record]`, appended with O_APPEND and fdatasync'd per
batch; a torn last line (a crash mid-write: its records never left) is skipped at load. The file
is rewritten with only the entries not yet acked downstream once it passes `COMPACT_BYTES`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, List, Optional, Sequence

from agent.files import write_atomic

__all__ = ["IngestLog", "COMPACT_BYTES"]

log = logging.getLogger("agent.instance.worker")

COMPACT_BYTES = 4 << 20  # rewrite the log past this size (a few seconds of readings at most stay)


class IngestLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: Optional[int] = None
        self._size = path.stat().st_size if path.exists() else 0

    def append(self, entries: Sequence[Any], keep_from: int) -> None:
        data = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries).encode()
        if self._fd is None:  # kept open: an open per batch costs more than the write
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        os.fdatasync(self._fd)
        self._size += len(data)
        if self._size > COMPACT_BYTES:
            self.compact(keep_from)

    def load(self) -> List[Any]:
        """The entries, oldest first; lines that do not parse are skipped (a torn last line)."""
        try:
            text = self.path.read_text()
        except (OSError, ValueError):
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def compact(self, keep_from: int) -> None:
        """Keep only the entries numbered `keep_from` or above (the rest is acked downstream)."""
        kept = [e for e in self.load() if isinstance(e, list) and e and type(e[0]) is int and e[0] >= keep_from]
        self.close()
        write_atomic(self.path, "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in kept))
        self._size = self.path.stat().st_size
        log.debug("ingest log compacted to %d entries", len(kept))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
