"""The landing zone: verified spill files, partitioned kind/date/node, each file exactly once.

Layout (Hive-style names, so Spark discovers `date` and `node` as columns):

    <landing>/kind=<kind>/date=<YYYY-MM-DD>/node=<node>/<file_id>.jsonl.gz
    <landing>/_ledger.jsonl        one line per landed file (id, kind, date, node, records, bytes)
    <landing>/_tmp/                files being written (Spark ignores names starting with "_")

Why the file id is the file name: landing is "write to _tmp, fsync, rename" and the rename target
is a function of the content only. A resent file finds its target present and is reported as a
duplicate without a second copy; a crash between fsync and rename leaves only a temp file. So the
landing zone never holds a file twice, whatever the network or the shipper do.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Union

from agent.spill.spool import _fsync_dir, file_id, read_records

__all__ = ["CorruptFile", "LandResult", "LandingZone"]


class CorruptFile(ValueError):
    """The assembled bytes are not the file the shipper described (never landed)."""


@dataclass(frozen=True)
class LandResult:
    status: str  # "landed" | "duplicate"
    path: Path
    records: int


def _segment(value: str, what: str) -> str:
    if not value or not all(c.isalnum() or c in "-_." for c in value) or value.startswith((".", "_")):
        raise CorruptFile(f"invalid {what} {value!r} for a landing partition")
    return value


class LandingZone:
    def __init__(self, root: Union[str, Path]) -> None:
        self.root = Path(root)
        self.tmp = self.root / "_tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.ledger = self.root / "_ledger.jsonl"
        self._lock = threading.Lock()

    def path_for(self, kind: str, date: str, node: str, fid: str) -> Path:
        return (self.root / f"kind={_segment(kind, 'kind')}" / f"date={_segment(date, 'date')}"
                / f"node={_segment(node, 'node')}" / f"{fid}.jsonl.gz")

    def contains(self, meta: Any) -> bool:
        try:
            return self.path_for(meta.kind, meta.date, meta.node, meta.file_id).exists()
        except CorruptFile:
            return False

    def land(self, meta: Any, data: bytes, decode: bool = True) -> LandResult:
        """Verify and store one file (meta: kind, date, node, file_id, size). Raises CorruptFile.

        `decode=False` skips decoding every record (size and sha256 are still checked): for an
        agent landing its own spool files on a shared path, where no network touched the bytes."""
        if len(data) != meta.size:
            raise CorruptFile(f"file {meta.name}: expected {meta.size} bytes, got {len(data)}")
        if file_id(data) != meta.file_id:
            raise CorruptFile(f"file {meta.name}: content does not match its id {meta.file_id[:12]}")
        target = self.path_for(meta.kind, meta.date, meta.node, meta.file_id)
        if target.exists():
            return LandResult("duplicate", target, 0)
        records = -1  # unknown (not decoded)
        if decode:
            try:
                records = len(read_records(data))
            except ValueError as exc:
                raise CorruptFile(f"file {meta.name}: {exc}") from None
        with self._lock:
            if target.exists():
                return LandResult("duplicate", target, 0)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.tmp / f"{meta.file_id}.{os.getpid()}.{threading.get_ident()}"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
            with open(self.ledger, "a") as fh:
                fh.write(json.dumps({"file_id": meta.file_id, "name": meta.name, "kind": meta.kind,
                                     "date": meta.date, "node": meta.node, "records": records,
                                     "bytes": len(data), "landed_at": time.time()}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        return LandResult("landed", target, records)

    def files(self) -> Iterator[Path]:
        """Every landed file (for tests and the report)."""
        for p in self.root.glob("kind=*/date=*/node=*/*.jsonl.gz"):
            yield p

    def kinds(self) -> List[str]:
        return sorted(p.name.split("=", 1)[1] for p in self.root.glob("kind=*") if p.is_dir())

    def summary(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for p in self.files():
            kind = p.parent.parent.parent.name.split("=", 1)[1]
            out[kind] = out.get(kind, 0) + 1
        return out
