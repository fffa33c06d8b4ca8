"""`agent.operators.filesink:file_sink`: records as JSON lines in local files, rotated, exactly once.

Files (under the instance's sink directory, `<sink_dir>/<instance>/`):
- `<instance>-000001.jsonl.part`: the open file; `<instance>-000001.jsonl` once rotated (complete:
  a reader takes only `*.jsonl`). One record per line, with its id:
  `{"id": ["<source instance>", <seq>], "record": <the record>}`.
- `<sink_dir>/<instance>.ids`: one line `<source instance> <seq>` per record written, the
  counting sink's format (agent.operators.builtin.CountingSink), so `read_sink_ids` and every
  verifier read a file sink as they read a counting sink.

Why the id is on each line: exactly once needs the data and the ids to agree after a crash
between the two writes. The order per `record` call is the counting sink's with its spool:
data lines handed to the OS (flushed) -> ids appended (flushed) -> the worker acks. A crash after
the data and before the ids leaves lines whose ids the ids file lacks; at start the sink reads
the ids of the open file's lines (`_adopt`), appends the missing ones to the ids file, and the
predecessors' replay of those records is then dropped as duplicates. A torn last line (a crash
in the middle of a write) was never acked: it is cut off before appending resumes.

Rotation: a file is closed when it reaches `rotate_bytes` (after the call that crossed it) or is
`rotate_seconds` old (checked every turn of the worker's loop through `settle`; 0: by size only).
Closing: fsync the file, fsync the ids file, rename `.part` -> `.jsonl`, fsync the directory. So
a `.jsonl` file is complete on disk together with its ids, and only the `.part` file can hold
lines whose ids are not in the ids file.

fsync policy (`fsync` param):
- "rotate" (default): fsync at each rotation and at a clean close. Every acked record survives a
  crash of the worker or the agent (it is in the OS page cache); a power cut may lose the records
  acked since the last rotation (at most `rotate_bytes` / `rotate_seconds` of them), never
  duplicate one (the lines that survive carry their ids).
- "batch": fsync the file and the ids file before each ack. Nothing acked is lost to a power cut;
  two fsyncs per batch (a Pi's SD card: milliseconds each).

The clock is passed in (`clock`), so rotation by age is tested without sleeping.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from agent.dataplane.envelope import Item
from agent.operators.builtin import OperatorContext, Param, Publication, SinkOperator, _read_ids, sink_ids_path

__all__ = ["FileSink", "file_sink", "read_lines"]

DEFAULT_ROTATE_BYTES = 64 << 20
DEFAULT_ROTATE_SECONDS = 3600.0
FSYNC_POLICIES = ("rotate", "batch")
PART = ".part"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _line_id(line: bytes) -> Optional[Tuple[str, int]]:
    """The id of one complete line, or None (not ours: skipped, never guessed)."""
    try:
        v = json.loads(line)
        src, seq = v["id"]
    except (ValueError, TypeError, KeyError):
        return None
    return (src, seq) if isinstance(src, str) and isinstance(seq, int) else None


class FileSink(SinkOperator):
    """Appends each new record as one JSON line; drops a record id seen before (see the module
    docstring for the files, the order of the writes and the fsync policy)."""

    keeps_records = True  # reads its records, never changes them
    deferred = True  # `settle` is the worker's per-turn call: rotation by age happens there

    def __init__(self, ctx: OperatorContext, clock: Callable[[], float] = time.time) -> None:
        p = ctx.params
        self.rotate_bytes = int(p.get("rotate_bytes", DEFAULT_ROTATE_BYTES))
        self.rotate_seconds = float(p.get("rotate_seconds", DEFAULT_ROTATE_SECONDS))
        self.fsync = str(p.get("fsync", "rotate"))
        if self.fsync not in FSYNC_POLICIES or self.rotate_bytes < 1 or self.rotate_seconds < 0:
            raise ValueError(f"file_sink: bad params {p!r} (check-config says which)")
        self.clock = clock
        self.name = ctx.instance
        self.dir = Path(ctx.sink_dir) / ctx.instance
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ids_path = sink_ids_path(ctx.sink_dir, ctx.instance)
        self.seen: Dict[str, Set[int]] = {}
        if self.ids_path.exists():
            for src, seq in _read_ids(self.ids_path):
                self.seen.setdefault(src, set()).add(seq)
        self._ids = open(self.ids_path, "a", buffering=1 << 16)
        self.number = max((self._number(f) for f in self.dir.iterdir()), default=0)
        self._data: Any = None
        self._opened_at = 0.0
        self._size = 0
        self._done = 0
        self.duplicates = 0
        self.closed_files = 0
        self.adopted = self._adopt()
        self.recorded = sum(len(s) for s in self.seen.values())

    # ---- files ----------------------------------------------------------------------------------

    def _number(self, f: Path) -> int:
        stem = f.name[:-len(PART)] if f.name.endswith(PART) else f.name
        head, _, tail = stem.rpartition("-")
        if head != self.name or not tail.endswith(".jsonl") or not tail[:-6].isdigit():
            return 0
        return int(tail[:-6])

    def _path(self, number: int, part: bool) -> Path:
        return self.dir / f"{self.name}-{number:06d}.jsonl{PART if part else ''}"

    def _adopt(self) -> int:
        """The open file a crash left: cut a torn last line, record the ids of its lines that the
        ids file lacks (a crash between the two writes), and keep appending to it."""
        part = self._path(self.number, True)
        if not part.exists():
            return 0
        raw = part.read_bytes()
        whole = raw[:raw.rfind(b"\n") + 1]
        if len(whole) != len(raw):
            with open(part, "r+b") as fh:
                fh.truncate(len(whole))
                os.fsync(fh.fileno())
        missing: List[str] = []
        for line in whole.splitlines():
            rid = _line_id(line)
            if rid is not None and rid[1] not in self.seen.setdefault(rid[0], set()):
                self.seen[rid[0]].add(rid[1])
                missing.append(f"{rid[0]} {rid[1]}\n")
        if missing:
            self._write_ids("".join(missing))
            os.fsync(self._ids.fileno())
        self._data = open(part, "ab")
        self._size = len(whole)
        self._opened_at = self.clock()
        return len(missing)

    def _open(self) -> None:
        self.number += 1
        self._data = open(self._path(self.number, True), "ab")
        self._size = 0
        self._opened_at = self.clock()

    def _rotate(self) -> None:
        """Close the open file: complete on disk with its ids, then renamed to `.jsonl`."""
        if self._data is None:
            return
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()
        self._data = None
        self._ids.flush()
        os.fsync(self._ids.fileno())
        os.replace(self._path(self.number, True), self._path(self.number, False))
        _fsync_dir(self.dir)
        self.closed_files += 1

    # ---- the writes (apart, so a test can crash between them) ------------------------------------

    def _write_data(self, data: bytes) -> None:
        self._data.write(data)
        self._data.flush()  # in the OS page cache: survives a crash of this process
        if self.fsync == "batch":
            os.fsync(self._data.fileno())

    def _write_ids(self, lines: str) -> None:
        self._ids.write(lines)
        self._ids.flush()
        if self.fsync == "batch":
            os.fsync(self._ids.fileno())

    # ---- the sink contract --------------------------------------------------------------------------

    def record(self, items: List[Item]) -> List[Publication]:
        fresh: List[Item] = []
        batch: Set[Tuple[str, int]] = set()
        for it in items:
            rid = (it[0], it[1])
            if rid[1] in self.seen.get(rid[0], ()) or rid in batch:
                self.duplicates += 1
                continue
            batch.add(rid)
            fresh.append(it)
        if fresh:
            data = b"".join(json.dumps({"id": [s, q], "record": r}, separators=(",", ":")).encode() + b"\n"
                            for s, q, r in fresh)
            if self._data is None:
                self._open()
            try:
                self._write_data(data)
            except OSError:  # e.g. the disk is full: no torn line may stay for the next call to extend
                self._data.truncate(self._size)
                raise
            self._size += len(data)
            self._write_ids("".join(f"{s} {q}\n" for s, q, _ in fresh))
            for s, q, _ in fresh:  # only once both are written: a failed write leaves them unseen
                self.seen.setdefault(s, set()).add(q)
            self.recorded += len(fresh)
            if self._size >= self.rotate_bytes:
                self._rotate()
        self._done += 1
        return []

    def settle(self) -> int:
        """Every call so far is recorded (`record` wrote it before returning); rotate by age."""
        if self._data is not None and self.rotate_seconds and self.clock() - self._opened_at >= self.rotate_seconds:
            self._rotate()
        done, self._done = self._done, 0
        return done

    def close(self) -> None:
        """A clean exit closes the open file too: what was written is complete and durable."""
        self._rotate()
        self._ids.flush()
        os.fsync(self._ids.fileno())
        self._ids.close()

    def stats(self) -> Dict[str, Any]:
        return {"recorded": self.recorded, "duplicates_dropped": self.duplicates, "files_closed": self.closed_files,
                "open_bytes": self._size if self._data is not None else 0, "ids_adopted": self.adopted}


class _Factory:
    def __init__(self, build: Callable[[OperatorContext], SinkOperator]) -> None:
        self.build = build


file_sink = _Factory(FileSink)
file_sink.params_schema = {  # type: ignore[attr-defined]
    "rotate_bytes": Param("integer", min=1),
    "rotate_seconds": Param("number", min=0),
    "fsync": Param("string", choices=FSYNC_POLICIES),
}


def read_lines(directory: Path, complete_only: bool = False) -> List[Tuple[Tuple[str, int], Any]]:
    """Every (id, record) of a file sink's directory, file by file in order (for readers and
    tests; a torn last line is skipped). `complete_only`: the rotated `.jsonl` files alone."""
    out: List[Tuple[Tuple[str, int], Any]] = []
    for f in sorted(Path(directory).iterdir()):
        if not (f.name.endswith(".jsonl") or (f.name.endswith(".jsonl" + PART) and not complete_only)):
            continue
        for line in f.read_bytes().splitlines():
            rid = _line_id(line)
            if rid is not None:
                out.append((rid, json.loads(line)["record"]))
    return out
