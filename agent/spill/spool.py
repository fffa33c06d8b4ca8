"""Durable local spool: what the fog produced, kept on the agent's disk until the centre has it.

Rules of this file:
- Records are appended as JSON Lines into one gzip file per *kind* ("records", "metrics",
  "events", ...). A file is rotated (closed) when it reaches `rotate_bytes` of compressed data or
  is `rotate_seconds` old; rotation flushes, fsyncs the file, moves it atomically from `open/` to
  `closed/` and fsyncs the directory, so a closed file is complete on disk or absent.
- Only closed files are shipped. The shipper calls `release(file)` once the centre acknowledged a
  file; until then the file stays in `closed/` and survives restarts (resume = ship what is there).
- Disk cap: when open + closed files reach `max_bytes` (open files count their not yet compressed
  input as if incompressible, see `_OpenFile.size`), `append` returns False (back pressure) and
  the spool raises one `spool_full` event; nothing is written and nothing is dropped -- the caller
  keeps the record and retries (or blocks in `wait_writable`). Releasing shipped files clears the
  condition and raises `spool_resumed`. The cap is exceeded by at most one record (plus a gzip trailer).
- A file left in `open/` by a crash is salvaged at start-up: every complete line that reached the
  disk is rewritten into a closed file (`recovered` event). Call `flush()` at the caller's own
  checkpoints to bound what a power cut can lose (a restart of the agent loses nothing: `close()`
  rotates every open file). Every `sync_bytes` of input the compressor is sync-flushed to the OS
  (no fsync), which bounds both the cap's uncertainty and what a crashed process loses.
- The clock is passed in (`clock`), so rotation by age is testable without sleeping.
- Appends are compressed and written by the calling thread, under the spool's lock, before
  `append*` returns; `on_event` is called from the thread that caused the event.
- Lines may be whole batches (a JSON array of records, as the transport delivered them): no
  re-encoding in the sink's thread; readers expand them (`read_records`, Spark's JSON reader).
- gzip level 1 by default: about 3x faster than level 6 for ~25% larger files.
- The counting sink uses `BatchSpool` (batchspool.py) instead: its lines reach the OS file
  in the sink's own thread, uncompressed, and are gzip'ed when a file is closed; measured much
  cheaper for the sink than compressing before the ack (docs/spill.md, section 6).
- `append_lines(..., sync=True)`: when it returns, the stored lines are compressed, sync-flushed
  and in the OS file (they survive a crash of this process; `flush()` adds fsync for a power cut).
- `auto_rotate=False`: size/age rotation happens only in `tick()`/`rotate_all()` (the caller's
  thread), so a caller can make its own bookkeeping durable before a file may leave `open/`.
- Another process may release closed files (the daemon's shipper ships a worker's spool):
  `tick()` and a refused append recount `closed/` from the directory (`SpoolDirs` is the
  shipper-side view of several spool directories: list and release closed files, never write).

The gzip header of each file carries its spool name and opening time, so two files with the same
records still have different bytes: the content-derived file id (sha256 of the bytes, see
`file_id`) identifies one spool file, and a resent copy of it has the same id.

This module holds the on-disk format and its invariants (names, closing, salvaging after a crash,
releasing) and the general `Spool`; the counting sink's `BatchSpool` (batchspool.py) and the
shipper (shipper.py) build on them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Union

__all__ = [
    "ClosedFile",
    "Spool",
    "SpoolDirs",
    "salvage_lines",
    "SpoolEvent",
    "file_id",
    "parse_name",
    "read_records",
]

log = logging.getLogger(__name__)

SUFFIX = ".jsonl.gz"
SEP = "+"  # not allowed in kinds or node names (schema.identifier), so names split unambiguously


@dataclass(frozen=True)
class SpoolEvent:
    """Something an operator should see (published on fog/<cluster>/events by the daemon)."""

    event: str  # "spool_full" | "spool_resumed" | "file_closed" | "recovered"
    at: float
    node: str
    detail: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return {"event": self.event, "ts": self.at, "node": self.node, **self.detail}


@dataclass(frozen=True)
class ClosedFile:
    """A complete, fsync'ed spool file waiting to be shipped."""

    path: Path
    kind: str
    node: str
    date: str  # UTC date the file was opened, YYYY-MM-DD: the landing partition
    seq: int
    size: int

    @property
    def name(self) -> str:
        return self.path.name


def _check_name(kind: str, what: str) -> str:
    if not kind or not all(c.isalnum() or c in "-_." for c in kind):
        raise ValueError(f"invalid {what} {kind!r}: expected letters, digits, '-', '_' or '.'")
    return kind


def make_name(kind: str, node: str, date: str, seq: int) -> str:
    return SEP.join((kind, node, date, f"{seq:010d}")) + SUFFIX


def parse_name(name: str) -> Dict[str, Any]:
    """`records+n1+2026-11-22+0000000007.jsonl.gz` -> kind, node, date, seq (ValueError if not)."""
    if not name.endswith(SUFFIX):
        raise ValueError(f"not a spool file name: {name!r} (expected suffix {SUFFIX})")
    parts = name[: -len(SUFFIX)].split(SEP)
    if len(parts) != 4 or not parts[3].isdigit():
        raise ValueError(f"not a spool file name: {name!r} (expected kind+node+date+seq)")
    datetime.strptime(parts[2], "%Y-%m-%d")
    return {"kind": _check_name(parts[0], "kind"), "node": _check_name(parts[1], "node"),
            "date": parts[2], "seq": int(parts[3])}


def file_id(data: bytes) -> str:
    """Content-derived id of a spool file: identical bytes (a resend) give the same id."""
    return hashlib.sha256(data).hexdigest()


def read_records(data: bytes) -> List[Dict[str, Any]]:
    """Decode a whole spool file (gzip JSON Lines); raises ValueError on any damage."""
    try:
        text = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"not a complete gzip stream ({exc})") from None
    out = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"line {i + 1}: invalid JSON ({exc})") from None
        if isinstance(rec, list) and all(isinstance(r, dict) for r in rec):
            out.extend(rec)  # a batch line
        elif isinstance(rec, dict):
            out.append(rec)
        else:
            raise ValueError(f"line {i + 1}: expected a JSON object or an array of objects")
    return out


class _OpenFile:
    """One gzip file being written; `raw` is the OS file so that its size is the compressed size."""

    def __init__(self, path: Path, opened_at: float, kind: str, date: str, seq: int, level: int):
        self.path, self.opened_at, self.kind, self.date, self.seq = path, opened_at, kind, date, seq
        self.raw = open(path, "xb")
        # filename + mtime in the gzip header make every file's bytes unique (see module doc).
        self.gz = gzip.GzipFile(filename=path.name, mode="wb", fileobj=self.raw,
                                compresslevel=level, mtime=int(opened_at))
        self.records = 0
        self.pending = 0  # uncompressed bytes not yet known to have reached the OS file

    def write(self, line: bytes, sync_bytes: int) -> None:
        self.gz.write(line)
        self.records += 1
        self.pending += len(line)
        if self.pending >= sync_bytes:
            self.gz.flush(zlib.Z_SYNC_FLUSH)
            self.pending = 0

    @property
    def size(self) -> int:
        """Compressed bytes in the OS file plus buffered input counted as if incompressible:
        an upper bound, so that the cap holds without waiting for zlib to emit output."""
        try:
            written = self.raw.tell()
        except ValueError:  # rotated (closed) by another thread since the caller listed the
            return 0  # open files (`rotation_due` reads without the lock); its bytes are closed now
        return written + self.pending


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_closed(closed_dir: Path) -> List[ClosedFile]:
    """The files of a `closed/` directory, oldest first (by sequence number); names that are
    not spool files, and files deleted meanwhile (shipped by another process), are skipped."""
    out = []
    for p in closed_dir.iterdir():
        try:
            meta = parse_name(p.name)
            size = p.stat().st_size
        except (ValueError, FileNotFoundError):
            continue
        out.append(ClosedFile(p, meta["kind"], meta["node"], meta["date"], meta["seq"], size))
    return sorted(out, key=lambda f: f.seq)


def _dir_bytes(path: Path) -> int:
    """Bytes of the files in a directory (one released meanwhile by another process: skipped)."""
    total = 0
    for p in path.iterdir():
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            continue
    return total


class _SpoolBase:
    """What both spools share: their directories (`open/`, `closed/`), limits and clock, their
    events (kept in `events`, passed to `on_event`) and the listing of `closed/`."""

    def __init__(self, directory: Union[str, Path], node: str, max_bytes: int, rotate_bytes: int,
                 rotate_seconds: float, clock: Callable[[], float],
                 on_event: Optional[Callable[[SpoolEvent], None]], compresslevel: int) -> None:
        if max_bytes <= 0 or rotate_bytes <= 0 or rotate_seconds <= 0:
            raise ValueError("max_bytes, rotate_bytes and rotate_seconds must be > 0")
        self.dir = Path(directory)
        self.node = _check_name(node, "node")
        self.max_bytes, self.rotate_bytes, self.rotate_seconds = max_bytes, rotate_bytes, rotate_seconds
        self.clock, self.on_event, self.level = clock, on_event, compresslevel
        self.open_dir, self.closed_dir = self.dir / "open", self.dir / "closed"
        self.open_dir.mkdir(parents=True, exist_ok=True)
        self.closed_dir.mkdir(parents=True, exist_ok=True)
        self.events: List[SpoolEvent] = []
        self._full = False
        self._last_refresh = 0.0
        self._seq = 0

    def closed_files(self) -> List[ClosedFile]:
        """Files ready to ship, oldest first (the daemon's shipper uses `SpoolDirs` instead)."""
        return list_closed(self.closed_dir)

    def _event(self, name: str, now: float, **detail: Any) -> SpoolEvent:
        ev = SpoolEvent(name, now, self.node, dict(detail))
        self.events.append(ev)
        return ev

    def _emit(self, events: List[SpoolEvent]) -> None:
        if self.on_event is not None:
            for ev in events:
                self.on_event(ev)


class Spool(_SpoolBase):
    """Append-only, rotated, capped spool of JSON records (thread-safe: a sink and a shipper).

    Typical use from a sink:

        spool = Spool(dir, node="n1", max_bytes=..., on_event=publish_event)
        while not spool.append("records", rec):     # back pressure: the record is NOT stored
            spool.wait_writable(timeout=1.0)         # ... so keep it and wait for the shipper
    """

    def __init__(
        self,
        directory: Union[str, Path],
        node: str,
        *,
        max_bytes: int = 512 * 1024 * 1024,
        rotate_bytes: int = 4 * 1024 * 1024,
        rotate_seconds: float = 60.0,
        clock: Callable[[], float] = time.time,
        on_event: Optional[Callable[[SpoolEvent], None]] = None,
        compresslevel: int = 1,
        sync_bytes: int = 1024 * 1024,
        auto_rotate: bool = True,
    ) -> None:
        super().__init__(directory, node, max_bytes, rotate_bytes, rotate_seconds, clock, on_event, compresslevel)
        self.sync_bytes = sync_bytes
        self.auto_rotate = auto_rotate
        self._lock = threading.Lock()  # every write, rotation and byte count happens under it
        self._writable = threading.Condition(self._lock)
        self._open: Dict[str, _OpenFile] = {}
        self._closed_bytes = 0
        self.stats = {"appended": 0, "rejected": 0, "files_closed": 0, "released": 0,
                      "recovered_records": 0, "full_events": 0}
        self._closed = False  # close() was called: appends raise
        self._recover()
        self._emit(list(self.events))  # recovered files, with what they salvaged

    # ---- public API -------------------------------------------------------------------------

    @property
    def full(self) -> bool:
        """True while the disk cap holds appends back (back pressure)."""
        with self._lock:
            return self._full

    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def append(self, kind: str, record: Mapping[str, Any]) -> bool:
        """Store one record; False means back pressure: it was NOT stored, keep it and retry."""
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        return self.append_lines(kind, [line]) == 1

    def append_many(self, kind: str, records: Iterable[Mapping[str, Any]]) -> int:
        """Store records in order until the cap is hit; returns how many were stored (a prefix)."""
        lines = [(json.dumps(r, separators=(",", ":"), default=str) + "\n").encode() for r in records]
        return self.append_lines(kind, lines)

    def append_lines(self, kind: str, lines: List[bytes], sync: bool = False) -> int:
        """Store pre-encoded JSON lines (each ending in newline); returns how many were stored.

        A line may also hold a JSON array of records (a whole batch as received, no re-encoding):
        `read_records` and Spark's JSON reader both expand it into one row per record.
        `sync=True`: the stored lines are sync-flushed to the OS file before this returns."""
        _check_name(kind, "kind")
        now = self.clock()
        events: List[SpoolEvent] = []
        with self._lock:
            if self._closed:
                raise RuntimeError(f"spool {self.dir} is closed")
            used = self._used()
            if used >= self.max_bytes and now - self._last_refresh >= 0.2:
                self._last_refresh = now
                self._refresh_closed()  # another process may have shipped and released files
                used = self._used()
            stored = 0
            self._maybe_resume(now, used, events)
            for line in lines:
                if used >= self.max_bytes:
                    if not self._full:
                        self._full = True
                        self.stats["full_events"] += 1
                        events.append(self._event("spool_full", now, used_bytes=used,
                                                  max_bytes=self.max_bytes, kind=kind))
                    break
                stored += 1
                used += len(line)
            if stored:
                accepted = lines[:stored] if stored < len(lines) else lines
                events.extend(self._write(kind, accepted, now))
                if sync and kind in self._open:
                    self._sync_flush(self._open[kind])
            self.stats["appended"] += stored
            self.stats["rejected"] += len(lines) - stored
        self._emit(events)
        return stored

    def _write(self, kind: str, lines: List[bytes], now: float) -> List[SpoolEvent]:
        events = []
        f = self._open.get(kind)
        for line in lines:
            if f is None:
                f = self._open_file(kind, now)
            f.write(line, self.sync_bytes)
            if self.auto_rotate and f.size >= self.rotate_bytes:
                events.append(self._rotate(kind, now))
                f = None
        return events

    @staticmethod
    def _sync_flush(f: "_OpenFile") -> None:
        f.gz.flush(zlib.Z_SYNC_FLUSH)  # GzipFile.flush also flushes the OS file object
        f.pending = 0

    def wait_writable(self, timeout: Optional[float] = None) -> bool:
        """Block until the cap no longer holds appends back (or timeout); True if writable."""
        with self._writable:
            return self._writable.wait_for(lambda: not self._full, timeout)

    def tick(self) -> None:
        """Rotate files older than rotate_seconds (and, with auto_rotate=False, files past
        rotate_bytes); recount closed bytes released by another process. Call about every second."""
        now = self.clock()
        with self._lock:
            self._refresh_closed()
            events = [self._rotate(k, now) for k, f in list(self._open.items())
                      if f.records and (now - f.opened_at >= self.rotate_seconds
                                        or f.size >= self.rotate_bytes)]
            self._maybe_resume(now, self._used(), events)
        self._emit(events)

    def rotation_due(self) -> bool:
        """True when `tick()` would close a file now (lets a caller prepare, cheaply)."""
        now = self.clock()
        return any(f.records and (now - f.opened_at >= self.rotate_seconds or f.size >= self.rotate_bytes)
                   for f in list(self._open.values()))

    def rotate_all(self) -> None:
        """Close every open file now (before a clean shutdown, or to ship what is there)."""
        now = self.clock()
        with self._lock:
            events = [self._rotate(k, now) for k in list(self._open)]
        self._emit(events)

    def flush(self) -> None:
        """Push buffered records of open files to disk (sync flush + fsync): bounds crash loss."""
        with self._lock:
            for f in self._open.values():
                self._sync_flush(f)
                f.raw.flush()
                os.fsync(f.raw.fileno())

    def close(self) -> None:
        """Close (rotate) every open file; later appends raise RuntimeError."""
        self.rotate_all()
        with self._lock:
            self._closed = True

    def release(self, f: Union[ClosedFile, Path]) -> None:
        """The centre has this file: delete it and free its bytes (may end back pressure)."""
        path = f.path if isinstance(f, ClosedFile) else Path(f)
        now = self.clock()
        events = []
        with self._lock:
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                return
            self._closed_bytes -= size
            self.stats["released"] += 1
            self._maybe_resume(now, self._used(), events)
        self._emit(events)

    # ---- internals (called with the lock held) -----------------------------------------------

    def _maybe_resume(self, now: float, used: int, events: List[SpoolEvent]) -> None:
        """Back pressure ends when the bytes fall under the cap (a release, or compression of
        bytes that were counted uncompressed)."""
        if self._full and used < self.max_bytes:
            self._full = False
            events.append(self._event("spool_resumed", now, used_bytes=used))
            self._writable.notify_all()

    def _used(self) -> int:
        return self._closed_bytes + sum(f.size for f in list(self._open.values()))

    def _refresh_closed(self) -> None:
        """Recount closed/ from the directory: files another process released free their bytes."""
        self._closed_bytes = _dir_bytes(self.closed_dir)

    def _open_file(self, kind: str, now: float) -> _OpenFile:
        self._seq += 1
        date = datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y-%m-%d")
        path = self.open_dir / make_name(kind, self.node, date, self._seq)
        f = _OpenFile(path, now, kind, date, self._seq, self.level)
        self._open[kind] = f
        return f

    def _rotate(self, kind: str, now: float) -> SpoolEvent:
        f = self._open.pop(kind)
        f.gz.close()  # writes the gzip trailer; does not close the fileobj we passed
        f.raw.flush()
        os.fsync(f.raw.fileno())
        size = f.raw.tell()
        f.raw.close()
        dest = self.closed_dir / f.path.name
        os.replace(f.path, dest)
        _fsync_dir(self.closed_dir)
        _fsync_dir(self.open_dir)
        self._closed_bytes += size
        self.stats["files_closed"] += 1
        return self._event("file_closed", now, file=dest.name, kind=kind, records=f.records, bytes=size)

    def _recover(self) -> None:
        """Start-up: count closed bytes, continue the sequence, salvage files a crash left open."""
        seqs = [0]
        for p in self.closed_dir.iterdir():
            try:
                seqs.append(parse_name(p.name)["seq"])
            except ValueError:
                continue
            self._closed_bytes += p.stat().st_size
        leftovers = []
        for p in sorted(self.open_dir.iterdir()):
            try:
                leftovers.append((parse_name(p.name), p))
                seqs.append(parse_name(p.name)["seq"])
            except ValueError:
                continue
        self._seq = max(seqs)
        now = self.clock()
        for meta, p in leftovers:
            lines = list(_salvage_lines(p.read_bytes()))
            if lines:
                f = self._open_file(meta["kind"], now)
                for line in lines:
                    f.write(line, self.sync_bytes)
                self._rotate(meta["kind"], now)
                self.stats["recovered_records"] += len(lines)
                self._event("recovered", now, file=p.name, records=len(lines))
            p.unlink()
        _fsync_dir(self.open_dir)


class SpoolDirs:
    """The shipper's view of several spool directories written by other processes (the agent's
    own spool and one per sink worker under `root`): lists and releases closed files, never
    writes, never salvages (the owning process does that). Same interface as `Spool` for the
    shippers: `node`, `closed_files()`, `release()`."""

    def __init__(self, root: Union[str, Path], node: str) -> None:
        self.root = Path(root)
        self.node = _check_name(node, "node")

    def closed_files(self) -> List[ClosedFile]:
        out = []
        for d in sorted(self.root.glob("*/closed")):
            for p in d.iterdir():
                try:
                    meta = parse_name(p.name)
                    size = p.stat().st_size
                except (ValueError, FileNotFoundError):
                    continue
                out.append(ClosedFile(p, meta["kind"], meta["node"], meta["date"], meta["seq"], size))
        return sorted(out, key=lambda f: (f.seq, str(f.path)))

    def release(self, f: Union[ClosedFile, Path]) -> None:
        path = f.path if isinstance(f, ClosedFile) else Path(f)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        _fsync_dir(path.parent)


def salvage_lines(data: bytes) -> List[bytes]:
    """Every complete JSON line of a (possibly truncated) spool file: gzip, or plain JSON Lines
    (an open `BatchSpool` file)."""
    return list(_salvage_lines(data))


def _salvage_lines(data: bytes) -> Iterator[bytes]:
    """Every complete JSON line decodable from a possibly truncated gzip stream or plain text."""
    if data[:2] != b"\x1f\x8b":
        yield from _valid_lines(data)
        return
    d = zlib.decompressobj(wbits=31)
    try:
        text = d.decompress(data)
    except zlib.error:
        # A damaged tail: decompress in small steps and keep what came out before the damage.
        d, text = zlib.decompressobj(wbits=31), b""
        for i in range(0, len(data), 512):
            try:
                text += d.decompress(data[i:i + 512])
            except zlib.error:
                break
    yield from _valid_lines(text)


def _valid_lines(text: bytes) -> Iterator[bytes]:
    for line in text.split(b"\n")[:-1]:  # the last piece has no newline: incomplete
        try:
            v = json.loads(line)
            if isinstance(v, dict) or (isinstance(v, list) and all(isinstance(r, dict) for r in v)):
                yield line + b"\n"
        except ValueError:
            continue


# ---- the sink's spool: lines written in the caller's thread, compressed by a helper thread -------
