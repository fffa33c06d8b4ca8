"""The counting sink's spool: plain JSON Lines written in the sink's thread, gzip'ed on close.

Why apart from `Spool`: the sink acks a batch once its line is in the OS file, and compressing
first halved its throughput (docs/spill.md, section 6). Both spools share the on-disk format of
agent.spill.spool (names, `closed/`, salvage, release), so a shipper cannot tell them apart.
"""

from __future__ import annotations

import collections
import gzip
import logging
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple, Union

from agent.spill.spool import (
    SUFFIX,
    ClosedFile,
    SpoolEvent,
    _dir_bytes,
    _fsync_dir,
    _check_name,
    _SpoolBase,
    make_name,
    parse_name,
    salvage_lines,
)

__all__ = ["BatchSpool", "RAW_SUFFIX", "gzip_engine"]

log = logging.getLogger("agent.spill.spool")

RAW_SUFFIX = ".jsonl"  # an open file of BatchSpool: plain JSON Lines, compressed when it is closed


try:  # optional (`pip install 'fog-agent[fast]'`): ISA-L's gzip, about 4x faster than zlib level 1 here
    from isal import igzip as _igzip
except ImportError:  # pragma: no cover - depends on the install
    _igzip = None


def gzip_engine(name: str = "auto") -> str:
    """The gzip implementation BatchSpool uses: "isal" when installed (or asked), else "zlib"."""
    if name not in ("auto", "isal", "zlib"):
        raise ValueError(f"unknown gzip engine {name!r}: expected auto, isal or zlib")
    if name == "isal" and _igzip is None:
        raise ValueError("gzip engine isal asked for but the isal package is not installed")
    return "isal" if name != "zlib" and _igzip is not None else "zlib"


def _gzip_writer(engine: str, fileobj: Any, name: str, level: int) -> gzip.GzipFile:
    """A gzip writer with the file name in the header and mtime 0 (same input: same bytes).
    Both engines write standard gzip (RFC 1952): readers never know which one wrote a file."""
    if engine == "isal":
        return _igzip.IGzipFile(filename=name, mode="wb", fileobj=fileobj, compresslevel=min(level, 3), mtime=0)
    return gzip.GzipFile(filename=name, mode="wb", fileobj=fileobj, compresslevel=level, mtime=0)


class _RawFile:
    """One plain JSON Lines file of a BatchSpool, appended with os.write only."""

    __slots__ = ("path", "fd", "kind", "opened_at", "size")

    def __init__(self, path: Path, kind: str, opened_at: float) -> None:
        self.path, self.kind, self.opened_at = path, kind, opened_at
        self.fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self.size = 0


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is in the OS file (a regular file rarely writes short, but may)."""
    n = os.write(fd, data)
    while n < len(data):
        data = data[n:]
        n = os.write(fd, data)


class BatchSpool(_SpoolBase):
    """The spool of a counting sink: a line is in the OS file when `append_line` returns, so the
    caller may record its ids and ack right after, with no thread hand-off and no wait.

    Why a second spool class (docs/spill.md, issue 7): the sink acks a batch only once its spool
    line is handed to the OS. With `Spool` that meant waiting for gzip first (~2 us per taxi
    record here): about half its throughput. Here the line (the
    batch body as it arrived) is written as it is, with one `os.write`, into a plain JSON Lines
    file in `open/` (`kind+node+date+seq.jsonl`). Closing a file costs the appending thread only
    an `os.close`; a compressor thread then, per file, in this order:

    1. calls `before_close()` (the sink fsyncs its ids file: every id of the file is durable
       before the file may be shipped, so a shipped file can never come back after a crash);
    2. fsyncs the plain file, gzips it (`open/<name>.gz.tmp`, fsync; zlib and crc32 release the
       GIL, so this runs beside the sink), renames it into `closed/`, fsyncs the directory;
    3. deletes the plain file.

    - gzip engine: ISA-L (`isal` package, optional extra `fast`) when installed, else zlib;
      level 1 (isal: 0.55 us per taxi record, ratio 0.37; zlib: 2.2 us, 0.40, measured here).
    - The gzip header has the file name and mtime 0: the same plain file always compresses to the
      same bytes (same engine), hence the same file id. A crash between 2 and 3 leaves both; the restart deletes
      the plain file if its gzip is in `closed/`, else (already shipped and released) compresses
      it again: the collector answers `duplicate`, nothing lands twice.
    - Start-up: every plain file in `open/` (a crash) keeps its complete JSON lines (`recovered`
      event; a gzip file of the older `Spool` format there too) and is closed as above; `*.tmp`
      files are deleted; sequence numbers continue after the highest present.
    - Rotation: by size in `close_full_files()` (raw bytes x the compressed/raw ratio of the last
      file compressed, 1.0 before the first: `rotate_bytes` keeps meaning compressed bytes), by age
      in `tick()` (and every open file while full); the size limit is at most half the cap; the
      caller calls both once its bookkeeping of the appended lines is written.
    - Cap: closed (compressed) + plain (raw, not compressed yet) bytes against `max_bytes`; at the
      cap `append_line` returns False (nothing written, nothing dropped, one `spool_full` event);
      files released by another process (the daemon's shipper) are noticed by recounting
      `closed/`, at most every 0.2 s while full; `spool_resumed` once under the cap again.
      Exceeded by at most one line.
    - Durability: an appended line survives a crash of this process (OS page cache); `flush()`
      fsyncs the open files; closed files are fsync'ed.

    Threads: every public method belongs to one thread (the sink's); the compressor only touches
    files handed to it and, under `_count_lock`, the byte counts.
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
        before_close: Optional[Callable[[], None]] = None,
        compresslevel: int = 1,
        engine: str = "auto",
    ) -> None:
        super().__init__(directory, node, max_bytes, rotate_bytes, rotate_seconds, clock, on_event, compresslevel)
        self.engine = gzip_engine(engine)
        self.before_close = before_close
        self._open: Dict[str, _RawFile] = {}
        self._open_bytes = 0  # raw bytes of the files still appended to (owner thread only)
        self._count_lock = threading.Lock()
        self._closed_bytes = 0  # files in closed/ (under _count_lock)
        self._handed_bytes = 0  # raw bytes handed to the compressor, not compressed yet (idem)
        self._ratio = 1.0  # compressed / raw bytes of the last file compressed
        # Raw bytes at which a file is closed by size: rotate_bytes / ratio, at most half the cap
        # (an open file alone must never fill the cap: only closed files can be shipped, released).
        self._limit = max(1, min(rotate_bytes, max_bytes // 2))
        self._stopping = False
        self.stats = {"appended": 0, "rejected": 0, "files_closed": 0, "recovered_records": 0,
                      "full_events": 0}
        self._todo: Deque[Tuple[Path, int]] = collections.deque()
        self._work = threading.Condition()
        self._idle = True
        self._recover()
        self._thread = threading.Thread(target=self._compressor, name=f"spool-gz-{node}", daemon=True)
        self._thread.start()

    # ---- the owner's API ---------------------------------------------------------------------

    @property
    def full(self) -> bool:
        """True while the disk cap holds appends back (back pressure)."""
        return self._full

    def used_bytes(self) -> int:
        return self._closed_bytes + self._handed_bytes + self._open_bytes

    def append_line(self, kind: str, line: bytes) -> bool:
        """Write one JSON line (ending in newline) of `kind`; True: it is in the OS file.
        False: the cap holds it back, nothing was written; keep it and call again later."""
        if self._stopping:
            raise RuntimeError(f"spool {self.dir} is closed")
        if self._full or self._closed_bytes + self._handed_bytes + self._open_bytes >= self.max_bytes:
            if self._check_cap(kind) >= self.max_bytes:
                self.stats["rejected"] += 1
                return False
        f = self._open.get(kind)
        if f is None:
            f = self._open_file(_check_name(kind, "kind"), self.clock())
        _write_all(f.fd, line)
        f.size += len(line)
        self._open_bytes += len(line)
        self.stats["appended"] += 1
        return True

    def close_full_files(self) -> None:
        """Close the files past the size limit (cheap: call after every append). Call it only
        once the caller's bookkeeping of the lines appended so far is written (flushed to the
        OS): `before_close` then makes that durable before the file may be shipped."""
        for kind, f in list(self._open.items()):
            if f.size >= self._limit:
                self._hand_over(kind)

    def tick(self) -> None:
        """Close files older than `rotate_seconds` (see `close_full_files` for when to call it);
        notice files released by another process (recount `closed/`: while full, or every 5 s
        for `used_bytes`; a stale count only errs high). Call about every second."""
        now = self.clock()
        for kind, f in list(self._open.items()):
            # Full: close the open files too; compressed and shipped they free room, kept open
            # they would hold the cap until rotate_seconds.
            if now - f.opened_at >= self.rotate_seconds or (self._full and f.size):
                self._hand_over(kind)
        if self._full or now - self._last_refresh >= 5.0:
            self._last_refresh = now
            self._refresh_closed()
        self._check_cap(None)

    def flush(self) -> None:
        """fsync the open files: bounds what a power cut can lose."""
        for f in self._open.values():
            os.fsync(f.fd)

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until every file handed to the compressor is in `closed/` (tests, shutdown)."""
        with self._work:
            return self._work.wait_for(lambda: not self._todo and self._idle, timeout)

    def close(self) -> None:
        """Close every open file, compress everything, stop the compressor thread."""
        for kind in list(self._open):
            self._hand_over(kind)
        with self._work:
            self._stopping = True
            self._work.notify_all()
        self._thread.join()

    def release(self, f: Union[ClosedFile, Path]) -> None:
        """The centre has this file: delete it (another process may do this instead)."""
        path = f.path if isinstance(f, ClosedFile) else Path(f)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        self._refresh_closed()
        self._check_cap(None)

    # ---- which files are still here (a sink acking once its files landed: agent.spill.ackhold) ----

    def open_name(self, kind: str) -> Optional[str]:
        """The name of the kind's file being appended to (the one `append_line` just wrote)."""
        f = self._open.get(kind)
        return f.path.name if f is not None else None

    def unshipped(self) -> List[str]:
        """The names of every file still here (open, being compressed or closed and not released),
        by sequence number: at start, what a previous incarnation wrote and the centre lacks."""
        names = {p.name for p in self.open_dir.iterdir() if p.name.endswith(RAW_SUFFIX)}
        names |= {p.name[: -len(".gz")] for p in self.closed_dir.iterdir() if p.name.endswith(SUFFIX)}
        seqs = {}
        for n in names:
            try:
                seqs[n] = parse_name(n + ".gz")["seq"]
            except ValueError:
                continue  # not a spool file (the shipper ignores it too)
        return sorted(seqs, key=seqs.__getitem__)

    def holds(self, name: str) -> bool:
        """False once the file `name` (as `open_name` gave it) left the spool: the shipper releases
        a file only once the centre has it. The plain file is looked at first: the compressor
        renames the gzip into closed/ before it deletes the plain file, so one of them is seen."""
        return (self.open_dir / name).exists() or (self.closed_dir / (name + ".gz")).exists()

    def close_files(self, names: Iterable[str]) -> None:
        """Close the named files still appended to (same rules as `close_full_files`)."""
        wanted = set(names)
        for kind, f in list(self._open.items()):
            if f.path.name in wanted:
                self._hand_over(kind)

    # ---- internals ---------------------------------------------------------------------------

    def _check_cap(self, kind: Optional[str]) -> int:
        """At or over the cap: recount closed/ (rate-limited), raise spool_full (an append was
        refused: `kind`) or spool_resumed (under the cap again). Returns the bytes used."""
        now = self.clock()
        used = self.used_bytes()
        if used >= self.max_bytes and now - self._last_refresh >= 0.2:
            self._last_refresh = now
            self._refresh_closed()
            used = self.used_bytes()
        events = []
        if used >= self.max_bytes and not self._full and kind is not None:
            self._full = True
            self.stats["full_events"] += 1
            events.append(self._event("spool_full", now, used_bytes=used, max_bytes=self.max_bytes, kind=kind))
        elif used < self.max_bytes and self._full:
            self._full = False
            events.append(self._event("spool_resumed", now, used_bytes=used))
        self._emit(events)
        return used

    def _refresh_closed(self) -> None:
        """Recount closed/ (another process releases files); under _count_lock, so that the
        compressor's rename + count is atomic to it."""
        with self._count_lock:
            self._closed_bytes = _dir_bytes(self.closed_dir)

    def _open_file(self, kind: str, now: float) -> _RawFile:
        self._seq += 1
        date = datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y-%m-%d")
        name = make_name(kind, self.node, date, self._seq)[: -len(".gz")]
        f = _RawFile(self.open_dir / name, kind, now)
        self._open[kind] = f
        return f

    def _hand_over(self, kind: str) -> None:
        """Stop appending to the kind's file and queue it for compression (the rest is the
        compressor's: the appending thread never waits for a disk here)."""
        f = self._open.pop(kind)
        os.close(f.fd)
        with self._count_lock:
            self._handed_bytes += f.size
        self._open_bytes -= f.size
        with self._work:
            self._todo.append((f.path, f.size))
            self._work.notify_all()

    def _compressor(self) -> None:
        while True:
            with self._work:
                self._idle = True
                self._work.notify_all()
                self._work.wait_for(lambda: bool(self._todo) or self._stopping)
                if not self._todo:
                    return
                path, raw_size = self._todo.popleft()
                self._idle = False
            try:
                self._compress(path, raw_size)
            except OSError as exc:  # pragma: no cover - disk trouble: the file stays in open/
                log.error("spool %s: cannot compress %s: %s (retried at the next start)", self.dir, path, exc)
                self._emit([self._event("compress_failed", self.clock(), file=path.name, error=str(exc))])

    def _compress(self, path: Path, raw_size: int) -> None:
        """open/<name>.jsonl -> closed/<name>.jsonl.gz: complete and fsync'ed, or absent."""
        if self.before_close is not None:
            self.before_close()  # the caller's bookkeeping of these lines is durable first
        gz_name = path.name + ".gz"
        tmp = self.open_dir / (gz_name + ".tmp")
        records = 0
        with open(path, "rb") as src, open(tmp, "wb") as out:
            os.fsync(src.fileno())  # the plain file is complete on disk: a recompression is identical
            with _gzip_writer(self.engine, out, gz_name, self.level) as gz:
                while True:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    records += chunk.count(b"\n")
                    gz.write(chunk)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        with self._count_lock:
            os.replace(tmp, self.closed_dir / gz_name)
            self._closed_bytes += size
            self._handed_bytes -= raw_size
        _fsync_dir(self.closed_dir)
        path.unlink()
        _fsync_dir(self.open_dir)
        if raw_size:
            self._ratio = size / raw_size
            self._limit = max(1, min(int(self.rotate_bytes / max(self._ratio, 1e-3)), self.max_bytes // 2))
        self.stats["files_closed"] += 1
        self._emit([self._event("file_closed", self.clock(), file=gz_name, kind=parse_name(gz_name)["kind"],
                                records=records, bytes=size)])

    def _recover(self) -> None:
        """Start-up: continue the sequence; keep the complete lines of what a crash left in
        `open/` and queue those files for compression (a plain file whose gzip is already in
        `closed/` was compressed before the crash: deleted)."""
        now = self.clock()
        seqs = [0]
        for d in (self.open_dir, self.closed_dir):
            for p in d.iterdir():
                if p.name.endswith(".tmp"):
                    p.unlink()  # an interrupted compression or repair: its source is still there
                    continue
                try:
                    seqs.append(parse_name(p.name if p.name.endswith(SUFFIX) else p.name + ".gz")["seq"])
                except ValueError:
                    continue
        self._seq = max(seqs)
        for p in sorted(self.open_dir.iterdir()):
            raw_name = p.name[: -len(".gz")] if p.name.endswith(SUFFIX) else p.name
            try:
                parse_name(raw_name + ".gz")
            except ValueError:
                continue
            if (self.closed_dir / (raw_name + ".gz")).exists():
                p.unlink()
                continue
            data = p.read_bytes()
            lines = salvage_lines(data)
            text = b"".join(lines)
            if text != data or p.name != raw_name:  # a torn tail, or an older gzip open file
                if lines:
                    tmp = self.open_dir / (raw_name + ".tmp")
                    with open(tmp, "wb") as out:
                        out.write(text)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(tmp, self.open_dir / raw_name)
                if p.name != raw_name or not lines:
                    p.unlink()
            if lines:
                self.stats["recovered_records"] += len(lines)
                self._emit([self._event("recovered", now, file=p.name, records=len(lines))])
                self._handed_bytes += len(text)
                self._todo.append((self.open_dir / raw_name, len(text)))
        _fsync_dir(self.open_dir)
        self._refresh_closed()
