"""A standby copy of each keyed instance's saved state, on another node (Kafka Streams' standby
replica, fed by the state's own changelog).

Why: a keyed instance's state (`<instance>.keyed.json` and its log, agent.instance.keyed_state)
lives on its node's disk. A node lost for good (SD card, power supply) took it, and the instance
re-homed elsewhere (agent.node.rehome) started without its windows: the fault-free run's windows
were missing. Now every save is copied to a standby agent before the inputs it reflects are acked
upstream (`KeyedState.replicated_acks`), so the state a re-homed incarnation needs is the
standby's copy plus what the predecessors still hold and replay.

How:
- The host agent ships what its worker saved: the snapshot in parts, then the log as byte ranges
  appended in order (`Shipper`: one request in flight per instance; a reply says what the standby
  holds, a token (generation, log bytes) that the worker compares with its saves).
- Neither side holds a whole state in memory: the host reads the snapshot a part at a time from
  its open file (`Saved`, `Requests`) and publishes the next part when the broker has acked one
  (WINDOW unacked at most), and scans the log a line at a time for the range it sends; the
  standby writes each part where it goes in a staging file and hashes it in CHUNK pieces. A copy's
  peak is a few parts (about 1 MB), whatever the state's size.
- The standby agent (`ReplicaStore`) keeps `replicas/<instance>.keyed.json` and its log, written
  only by the node that hosts the instance (the daemon checks the hosted record, the topic proves
  the sender) and only at the exact offset it holds (anything else asks for a snapshot again).
- The hosted record names the standby (`extra["standby"]`): a re-home places the instance there
  first, and the standby installs its copy as the instance's state before the worker starts
  (`ReplicaStore.install`): a crash restart's restore.
- The standby is the next online node after the host in name order (`choose_standby`), kept while
  it stays online; a new one gets a snapshot first. A node with no other node online acks on its
  own save (counted: `replica_local_only`), as without replication.

What is not covered: the host and its standby lost together (their copies are both gone), and the
standby's own power cut between an append and the disk (its writes are not fsync'd: the case is
the host's loss, with the standby running).

Everything a standby receives is bus input: sizes are bounded before decoding, the instance id is
checked against a strict pattern before it names a file, the snapshot's SHA-256 is verified.
Sans-IO except `open_saved`, `Saved`, `Requests` and `ReplicaStore` (files).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Set, Tuple

from agent.config import load_pipeline_text
from agent.dataplane.owners import TableError, groups_from_runs
from agent.files import append, write_atomic
from agent.instance.spec import InstanceSpec
from agent.node.statexfer import check_keyed

__all__ = ["PART_BYTES", "MAX_SNAPSHOT_BYTES", "REPLY_TIMEOUT", "WINDOW", "Replication", "Requests", "Saved",
           "Shipper", "ReplicaStore", "choose_standby", "open_saved"]

log = logging.getLogger("agent.node.replicas")

# Raw bytes per request: in base64 plus the header, ~171 KiB, under wire.MAX_CONTROL_BYTES (256 KiB).
PART_BYTES = 128 * 1024
# Snapshot parts published and not yet acked by the broker, per instance: what a copy holds in
# memory on the host is this many parts, whatever the snapshot's size (paho keeps a QoS 1
# message until its PUBACK).
WINDOW = 2
# Bytes read at a time to hash a snapshot (host and standby) or to scan a log.
CHUNK = 64 * 1024
# The largest snapshot a standby keeps (as statexfer.MAX_STATE_BYTES for a hand-over).
MAX_SNAPSHOT_BYTES = 16 << 20
# The largest log a standby keeps before the host must send a snapshot (the host's log is folded
# into a snapshot at about the snapshot's size: keyed_state.LOG_MIN).
MAX_LOG_BYTES = 2 * MAX_SNAPSHOT_BYTES
# No reply within this: the standby is asked again from a snapshot (or another one is chosen).
REPLY_TIMEOUT = 15.0
# A refused request is sent again (from a snapshot) this long after: the refusal may be a hosted
# record still on its way to the standby.
RETRY_AFTER = 1.0

Token = Tuple[int, int]  # (generation, log bytes): what a copy holds
_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_SNAP_GEN = re.compile(rb'^\{"format":\d+,"gen":(\d+),')
# The owned key groups a save carries (agent.instance.keyed_state `owned`): in the snapshot's head,
# before its "applied" object, and second in a log line whose ownership changed. Followed by a
# comma: a line cut inside the list does not match.
_SNAP_OWNED = re.compile(rb'^\{"format":\d+,"gen":\d+,"operator":"(?:[^"\\]|\\.)*","key_groups":\d+,"owned":(\[[0-9,\[\]]*\]),')
_LOG_OWNED = re.compile(rb'^\{"gen":(\d+),"owned":(\[[0-9,\[\]]*\]),', re.M)
# Bytes of a snapshot's head read for its owned groups (a few runs for 128 groups; a head longer
# than this says nothing, as a save without the field).
HEAD_BYTES = 64 * 1024


def owned_runs(text: bytes) -> Optional[list]:
    """Group runs (agent.dataplane.owners.group_runs) out of copied bytes: checked, else None."""
    try:
        runs = json.loads(text)
        groups_from_runs(runs)
    except (ValueError, TableError):
        return None
    return runs


def owned_in_head(head: bytes) -> Optional[list]:
    """The owned groups a snapshot's head names, or None (a save without them)."""
    m = _SNAP_OWNED.match(head)
    return owned_runs(m.group(1)) if m else None


def owned_in_log(data: bytes, gen: int) -> Optional[list]:
    """The owned groups the last line of generation `gen` that names them in appended log bytes
    says, or None when no line does."""
    found = None
    for m in _LOG_OWNED.finditer(data):
        if int(m.group(1)) == gen:
            found = m.group(2)
    return owned_runs(found) if found is not None else None


def choose_standby(me: str, eligible: Iterable[str], current: Optional[str]) -> Optional[str]:
    """The standby for an instance hosted on `me`: the current one while it stays eligible (a new
    one costs a snapshot), else the first eligible node after `me` in name order, wrapping."""
    nodes = sorted(set(eligible) - {me})
    if current in nodes:
        return current
    after = [n for n in nodes if n > me]
    return (after or nodes or [None])[0]


class Saved:
    """A keyed instance's saved files, open, never read whole: the snapshot's generation, size and
    open file (a newer save replaces the path with a new file, never this one), read a piece at a
    time. `close` it (or use `with`)."""

    def __init__(self, path: Path, gen: int, fd: int, size: int, inode: int) -> None:
        self.path, self.gen, self.fd, self.size, self._inode = path, gen, fd, size, inode

    def __enter__(self) -> "Saved":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def current(self) -> bool:
        """The path still names this snapshot: no newer one replaced it (the worker truncates the
        log only after replacing the snapshot)."""
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    def digest(self) -> str:
        """The snapshot's SHA-256, read CHUNK bytes at a time."""
        h, at = hashlib.sha256(), 0
        while at < self.size:
            piece = os.pread(self.fd, min(CHUNK, self.size - at), at)
            if not piece:
                raise ValueError(f"{self.path}: shorter than its {self.size} bytes")
            h.update(piece)
            at += len(piece)
        return h.hexdigest()

    def log_range(self, start: int, limit: int) -> bytes:
        """At most `limit` bytes of the log from `start`, cut to the whole lines of this generation
        (a line of another one, or a torn last line, ends them). The log is read from its start a
        line (or CHUNK bytes of a longer one) at a time, up to the line that reaches `start + limit`:
        what is held is `limit` bytes and a line's piece, whatever the log's size."""
        prefix = b'{"gen":%d,' % self.gen
        try:
            fh = open(self.path.with_name(self.path.name + ".log"), "rb")
        except FileNotFoundError:
            return b""
        with fh:
            end = pos = 0  # the end of this generation's whole lines read; the bytes read
            got = bytearray()  # the bytes from `start` read so far, at most `limit`
            line_start = True
            while end < start + limit:
                piece = fh.readline(CHUNK)  # a line, or CHUNK bytes of a longer one
                if not piece or (line_start and not piece.startswith(prefix)):
                    break
                if pos + len(piece) > start and len(got) < limit:
                    skip = max(0, start - pos)
                    got += piece[skip:skip + limit - len(got)]
                pos += len(piece)
                line_start = piece.endswith(b"\n")
                if line_start:
                    end = pos
        return bytes(got[:max(0, min(end, start + limit) - start)])


def _file_digest(path: Path, size: int) -> Optional[str]:
    """The SHA-256 of a file read CHUNK bytes at a time, None unless it is `size` bytes long."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while True:
            piece = fh.read(CHUNK)
            if not piece:
                break
            h.update(piece)
            n += len(piece)
    return h.hexdigest() if n == size else None


def open_saved(path: Path) -> Optional[Saved]:
    """What a keyed instance's files hold now (`Saved`: its snapshot open, its generation read
    from the snapshot's first bytes), None when nothing is saved. The worker may be saving
    meanwhile: a snapshot replaced after it was opened stays the one read (each log line starts
    with its generation, so only that generation's lines go with it), so what is sent is always
    one consistent save, never newer than the files."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        m = _SNAP_GEN.match(os.pread(fd, 64, 0))
        if m is None:
            raise ValueError(f"{path}: not a keyed snapshot")
        st = os.fstat(fd)
        return Saved(path, int(m.group(1)), fd, st.st_size, st.st_ino)
    except BaseException:
        os.close(fd)
        raise


class Requests:
    """The requests that bring a standby up to one save, made one at a time (an iterator with
    `len`, what is left): one log range, or a snapshot's parts, each read from the snapshot's
    open file when its turn comes (a copy of the file's descriptor: `close` it, or exhaust it)."""

    def __init__(self, bodies: Iterable[Dict[str, Any]] = (), *, instance: str = "", saved: Optional[Saved] = None,
                 digest: str = "") -> None:
        self._bodies = list(bodies)
        self._fd, self._part, self._parts = -1, 0, 0
        if saved is not None:
            self._instance, self._gen, self._size, self._digest = instance, saved.gen, saved.size, digest
            self._parts = max(1, -(-saved.size // PART_BYTES))
            self._fd = os.dup(saved.fd)

    def __len__(self) -> int:
        return len(self._bodies) + self._parts - self._part

    def __iter__(self) -> "Requests":
        return self

    def __next__(self) -> Dict[str, Any]:
        if self._bodies:
            return self._bodies.pop(0)
        if self._part >= self._parts:
            self.close()
            raise StopIteration
        i = self._part
        data = os.pread(self._fd, PART_BYTES, i * PART_BYTES) if self._size else b""
        if len(data) != min(PART_BYTES, self._size - i * PART_BYTES):
            self.close()
            raise OSError(f"snapshot of {self._instance}: part {i} short ({len(data)} bytes)")
        self._part += 1
        if self._part >= self._parts:
            self.close()
        return {"op": "replica", "instance": self._instance, "gen": self._gen, "part": i, "parts": self._parts,
                "size": self._size, "sha256": self._digest, "data": base64.b64encode(data).decode()}

    def close(self) -> None:
        self._part = self._parts
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


@dataclass
class Shipper:
    """The host's side for one keyed instance: what its standby holds, what is on its way."""

    instance: str
    standby: Optional[str] = None
    held: Optional[Token] = None  # what the standby said it holds (None: it needs a snapshot)
    wanted: Token = (-1, -1)  # the newest save the worker reported
    inflight: Optional[Token] = None  # what the standby holds once it answers the request sent
    deadline: float = 0.0
    given_up: Token = (-1, -1)  # a save that could not be copied (too large): acked on its own
    retry_at: float = 0.0  # after a refusal: not asked again before this
    # The requests of `inflight` not published yet, and the message ids of those the broker has
    # not acked (Replication: at most WINDOW of them at a time)
    outgoing: Optional[Requests] = field(default=None, repr=False)
    correlation: str = ""
    unacked: Set[int] = field(default_factory=set)

    def _reset(self) -> None:
        self.inflight = None
        self.unacked = set()
        if self.outgoing is not None:
            self.outgoing.close()
            self.outgoing = None

    def set_standby(self, node: Optional[str]) -> bool:
        """True when the standby changed (it gets a snapshot first)."""
        if node == self.standby:
            return False
        self.standby, self.held = node, None
        self._reset()
        return True

    def due(self, now: float) -> bool:
        return (self.inflight is None and now >= self.retry_at and self.standby is not None and self.wanted != self.given_up
                and (self.held is None or self.held < self.wanted))

    def requests(self, saved: Saved, now: float) -> Requests:
        """The requests that bring the standby up to `saved` (open_saved), none when it holds it.
        A snapshot goes in parts (answered after the last), each read when it is taken; then the
        log, one range a request. Empty too when the files changed while the log was read (a
        newer snapshot: asked again at the next turn)."""
        gen = saved.gen
        if self.inflight is not None or self.standby is None:
            return Requests()
        if self.held is not None and self.held[0] == gen:
            start = self.held[1]
            data = saved.log_range(start, PART_BYTES)
            if not saved.current():
                return Requests()  # a newer snapshot: the log may be another generation's now
            if not data:
                self.held = (gen, start)
                return Requests()
            self.inflight, self.deadline = (gen, start + len(data)), now + REPLY_TIMEOUT
            return Requests([{"op": "replica", "instance": self.instance, "gen": gen, "offset": start,
                              "data": base64.b64encode(data).decode()}])
        if saved.size > MAX_SNAPSHOT_BYTES:
            raise ValueError(f"keyed state of {saved.size} bytes: more than the {MAX_SNAPSHOT_BYTES} a standby keeps")
        out = Requests(instance=self.instance, saved=saved, digest=saved.digest())
        self.inflight, self.deadline = (gen, 0), now + REPLY_TIMEOUT
        return out

    def answered(self, result: Dict[str, Any], now: float = 0.0) -> Optional[Token]:
        """The standby's reply: the token it holds now (tell the worker), or None (a snapshot
        next, not before RETRY_AFTER: a refusal answered at once would be a storm)."""
        target = self.inflight
        self._reset()
        gen, log = result.get("gen"), result.get("log")
        if result.get("ok") is True and target is not None and (gen, log) == target:
            self.held = target
            return target
        self.held, self.retry_at = None, now + RETRY_AFTER
        return None

    def timed_out(self, now: float) -> bool:
        if self.inflight is not None and now >= self.deadline:
            self._reset()
            self.held = None
            return True
        return False


@dataclass
class _Staged:
    host: str
    gen: int
    size: int
    sha256: str
    parts: Set[int] = field(default_factory=set)  # written to the staging file at part * PART_BYTES


class ReplicaStore:
    """The standby's copies, under `root` (`<state_dir>/replicas`): per instance its snapshot,
    its log and `<instance>.replica.json` ({"host", "gen", "log"}: who may write it, what it holds).
    A snapshot being received is staged in `<instance>.keyed.json.part`, each part written where
    it goes, so what a copy holds in memory is one part, whatever the snapshot's size."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._staged: Dict[str, _Staged] = {}  # instance -> the snapshot being assembled (one each)
        # instance -> (its host, the groups its copy says it owns): `owned`
        self._owned: Optional[Dict[str, Tuple[str, list]]] = None
        self.counts = {"replica_snapshots": 0, "replica_appends": 0, "replica_refused": 0}

    def _paths(self, instance: str) -> Tuple[Path, Path, Path]:
        base = self.root / f"{instance}.keyed.json"
        return base, base.with_name(base.name + ".log"), self.root / f"{instance}.replica.json"

    def _staging(self, instance: str) -> Path:
        return self.root / f"{instance}.keyed.json.part"

    def meta(self, instance: str) -> Optional[Dict[str, Any]]:
        try:
            data = json.loads(self._paths(instance)[2].read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def apply(self, host: str, body: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """One request from `host` (the daemon checked that it hosts the instance). The reply, or
        None for a snapshot part that is not the last (the last one answers for all)."""
        try:
            return self._apply(host, body)
        except (ValueError, TypeError, binascii.Error) as exc:
            self.counts["replica_refused"] += 1
            return {"ok": False, "error": f"replica refused: {exc}"[:300]}

    def _apply(self, host: str, body: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        inst, gen = body.get("instance"), body.get("gen")
        if not isinstance(inst, str) or not _INSTANCE.fullmatch(inst):
            raise ValueError("instance id is not a valid name")
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise ValueError("gen is not a non-negative integer")
        data = base64.b64decode(str(body.get("data", "")), validate=True)
        if len(data) > PART_BYTES:
            raise ValueError(f"a part of {len(data)} bytes (at most {PART_BYTES})")
        snap, log, _ = self._paths(inst)
        if "part" in body:
            return self._part(host, inst, gen, body, data)
        offset = body.get("offset")
        meta = self.meta(inst)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError("offset is not a non-negative integer")
        if meta is None or meta.get("host") != host or meta.get("gen") != gen or meta.get("log") != offset:
            raise ValueError(f"not at {gen}/{offset} for {host}: a snapshot first")
        if offset + len(data) > MAX_LOG_BYTES:
            raise ValueError(f"log past {MAX_LOG_BYTES} bytes: a snapshot first")
        append(log, data)
        owned = owned_in_log(data, gen)
        if owned is None:
            owned = meta.get("owned")
        self._set_meta(inst, {"host": host, "gen": gen, "log": offset + len(data)}, owned)
        self.counts["replica_appends"] += 1
        return {"ok": True, "instance": inst, "gen": gen, "log": offset + len(data)}

    def _part(self, host: str, inst: str, gen: int, body: Dict[str, Any], data: bytes) -> Optional[Dict[str, Any]]:
        part, parts, size, digest = body.get("part"), body.get("parts"), body.get("size"), body.get("sha256")
        if not (isinstance(parts, int) and isinstance(part, int) and isinstance(size, int)
                and 0 <= part < parts and 0 <= size <= MAX_SNAPSHOT_BYTES and parts == max(1, -(-size // PART_BYTES))
                and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise ValueError("snapshot part: bad part, parts, size or sha256")
        if len(data) != min(PART_BYTES, size - part * PART_BYTES):
            raise ValueError(f"snapshot part {part} of {len(data)} bytes: not its share of {size}")
        snap, log, _ = self._paths(inst)
        staging = self._staging(inst)
        self.root.mkdir(parents=True, exist_ok=True)
        st = self._staged.get(inst)
        if st is None or (st.host, st.gen, st.size, st.sha256) != (host, gen, size, digest):
            st = self._staged[inst] = _Staged(host, gen, size, digest)  # one snapshot at a time each
            staging.unlink(missing_ok=True)
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            view = memoryview(data)
            at = part * PART_BYTES
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
        finally:
            os.close(fd)
        st.parts.add(part)
        if len(st.parts) < parts:
            return None
        del self._staged[inst]
        if _file_digest(staging, size) != digest:
            staging.unlink(missing_ok=True)
            raise ValueError("snapshot does not match its size and sha256")
        os.replace(staging, snap)
        log.write_bytes(b"")
        with open(snap, "rb") as fh:
            owned = owned_in_head(fh.read(HEAD_BYTES))
        self._set_meta(inst, {"host": host, "gen": gen, "log": 0}, owned)
        self.counts["replica_snapshots"] += 1
        return {"ok": True, "instance": inst, "gen": gen, "log": 0}

    def _set_meta(self, inst: str, meta: Dict[str, Any], owned: Any) -> None:
        if isinstance(owned, list):
            meta["owned"] = owned
        write_atomic(self._paths(inst)[2], json.dumps(meta))
        if self._owned is not None:
            if isinstance(owned, list):
                self._owned[inst] = (str(meta["host"]), owned)
            else:
                self._owned.pop(inst, None)

    def owned(self, hosts: Iterable[str]) -> Dict[str, list]:
        """instance -> the key groups its copy says it owns (group runs), for the copies of
        `hosts` whose saves name them: in this node's retained state while their host is offline,
        where its re-home reads them (agent.node.rehome, `standby_groups`). Read from the files
        once, then kept."""
        if self._owned is None:
            self._owned = {}
            for inst, host in self.instances().items():
                runs = (self.meta(inst) or {}).get("owned")
                if isinstance(runs, list):
                    self._owned[inst] = (host, runs)
        wanted = set(hosts)
        return {i: runs for i, (host, runs) in self._owned.items() if host in wanted}

    def hosts(self) -> Set[str]:
        """The nodes whose copies are held here."""
        return set(self.instances().values())

    def install(self, instance: str, state_dir: Path, operator: str, key_groups: int) -> Optional[str]:
        """Make the copy of `instance` its state in `state_dir` (a re-home placed it here): what a
        crash restart there would restore. The copy goes either way. Returns what was installed
        (for the log), None when there is no copy; ValueError when it does not check against the
        spec (the instance then starts as it would have without one)."""
        if not _INSTANCE.fullmatch(instance):
            return None
        snap, log, _ = self._paths(instance)
        meta = self.meta(instance)
        if meta is None or not snap.exists():
            self.forget(instance)
            return None
        try:
            check_keyed(snap.read_bytes(), operator, key_groups)  # bounded parse, the spec's shape
            state_dir.mkdir(parents=True, exist_ok=True)
            target = state_dir / f"{instance}.keyed.json"
            target_log = target.with_name(target.name + ".log")
            if log.exists():
                os.replace(log, target_log)
            else:
                target_log.unlink(missing_ok=True)
            os.replace(snap, target)
        except OSError as exc:
            raise ValueError(str(exc)) from exc
        finally:
            self.forget(instance)
        return f"generation {meta.get('gen')}, {meta.get('log')} log bytes, from {meta.get('host')}"

    def forget(self, instance: str) -> None:
        self._staged.pop(instance, None)
        if self._owned is not None:
            self._owned.pop(instance, None)
        if _INSTANCE.fullmatch(instance):
            for p in (*self._paths(instance), self._staging(instance)):
                p.unlink(missing_ok=True)

    def instances(self) -> Dict[str, str]:
        """instance -> the host that writes its copy."""
        out: Dict[str, str] = {}
        for p in self.root.glob("*.replica.json") if self.root.is_dir() else ():
            inst = p.name[:-len(".replica.json")]
            meta = self.meta(inst)
            if meta is not None and isinstance(meta.get("host"), str):
                out[inst] = meta["host"]
        return out


class Replication:
    """The daemon's side of replication, for both roles: the host's shippers (one per keyed
    instance it runs) and the standby's store. The daemon passes in what this needs from it (the
    time, the eligible standbys, how to publish and how to tell a worker), so the sequence of
    saves, requests and replies is the whole of its behaviour.

    `publish(standby, body, correlation or None)` returns False when the request was not queued,
    True when it is out of the host's hands, or the message id to wait for: then the next part of
    a snapshot goes when the broker acks one (`published`), at most WINDOW of them unacked."""

    def __init__(self, node: str, state_dir: Path) -> None:
        self.node = node
        self.state_dir = state_dir
        self.store = ReplicaStore(state_dir / "replicas")
        self.shippers: Dict[str, Shipper] = {}
        self._calls: Dict[str, str] = {}  # correlation -> instance
        self._mids: Dict[int, str] = {}  # message id of a part not acked yet -> instance
        self._counter = 0
        self.counts = {"replica_requests": 0, "replica_timeouts": 0, "replica_local_only": 0,
                       "replica_resyncs": 0, "replica_errors": 0}

    def saved(self, instance: str, gen: int, log: int) -> None:
        """A worker saved its keyed state (its "keyed_saved" line)."""
        sh = self.shippers.setdefault(instance, Shipper(instance))
        sh.wanted = max(sh.wanted, (gen, log))

    def forget(self, instance: str) -> None:
        """The instance left this node (scale-in, hand-over, undeploy): its shipper goes."""
        sh = self.shippers.pop(instance, None)
        if sh is not None:
            sh._reset()
        self._drop_calls(instance)

    def _drop_calls(self, instance: str) -> None:
        for c in [c for c, i in self._calls.items() if i == instance]:
            del self._calls[c]
        for m in [m for m, i in self._mids.items() if i == instance]:
            del self._mids[m]

    def standby_of(self, instance: str) -> Optional[str]:
        sh = self.shippers.get(instance)
        return sh.standby if sh is not None else None

    def with_standby(self, spec: Dict[str, Any]) -> Dict[str, Any]:
        """`spec` (an entry of our hosted record) naming the standby that holds the copy of its
        keyed state, if any: a re-home of it starts there first (agent.node.spawns)."""
        standby = self.standby_of(str(spec.get("instance")))
        extra = {k: v for k, v in (spec.get("extra") or {}).items() if k != "standby"}
        if standby is not None:
            extra["standby"] = standby
        return dict(spec, extra=extra)

    def install_copy(self, spec: InstanceSpec, counters: Dict[str, int]) -> None:
        """A re-home placed a keyed instance on its standby (us): our copy of its state becomes
        its state, restored as after a crash. A drain hand-over brings its own state instead."""
        if not (spec.restart and spec.extra.get("min_epoch") and spec.extra.get("standby") == self.node
                and not spec.extra.get("handover_keyed")):
            return
        try:
            groups = load_pipeline_text(spec.pipeline_toml, f"pipeline {spec.pipeline}").operator(spec.operator).key_groups
            what = self.store.install(spec.instance, self.state_dir, spec.operator, groups)
        except (ValueError, KeyError) as exc:
            log.error("standby copy of the keyed state not installed: %s", exc, extra={"instance": spec.instance})
            return
        if what is not None:
            counters["replicas_installed"] = counters.get("replicas_installed", 0) + 1
            log.warning("re-homed with the standby copy of its keyed state: %s", what, extra={"instance": spec.instance})

    def owns(self, correlation: str) -> bool:
        return correlation in self._calls

    def waits_for(self, mid: int) -> bool:
        """A part of a snapshot waits for this message id's PUBACK (`published`)."""
        return mid in self._mids

    def tick(self, now: float, eligible: Iterable[str], publish: Any, tell: Any) -> bool:
        """Choose standbys, expire requests, send what is due. `publish(standby, body,
        correlation or None)` (see the class); `tell(instance, gen, log)` answers a worker. True
        when a standby changed (the hosted record names it)."""
        nodes = sorted(set(eligible) - {self.node})
        changed = False
        for inst, sh in self.shippers.items():
            if sh.set_standby(choose_standby(self.node, nodes, sh.standby)):
                changed = True
                self._drop_calls(inst)
            if sh.timed_out(now):
                self.counts["replica_timeouts"] += 1
                self._drop_calls(inst)
            if sh.standby is None:  # nobody to copy to: the save alone, as without replication
                if sh.held != sh.wanted and sh.wanted[0] >= 0:
                    sh.held = sh.wanted
                    self.counts["replica_local_only"] += 1
                    tell(inst, *sh.wanted)
                continue
            if sh.outgoing is not None:
                self._pump(sh, now, publish)
            elif sh.due(now):
                self._send(sh, now, publish, tell)
        return changed

    def published(self, mid: int, now: float, publish: Any) -> None:
        """The broker acked message `mid`: a part of a snapshot is out, the next one may go."""
        inst = self._mids.pop(mid, None)
        sh = self.shippers.get(inst) if inst is not None else None
        if sh is not None and mid in sh.unacked:
            sh.unacked.discard(mid)
            self._pump(sh, now, publish)

    def _send(self, sh: Shipper, now: float, publish: Any, tell: Any) -> None:
        try:
            saved = open_saved(self.state_dir / f"{sh.instance}.keyed.json")
            if saved is None:
                return
            with saved:
                bodies = sh.requests(saved, now)
        except (OSError, ValueError) as exc:
            # Too large or unreadable: acked on the save alone rather than never (a stall).
            self._give_up(sh, exc, tell)
            return
        if not len(bodies):
            return
        self._counter += 1
        sh.correlation = f"replica-{self.node}-{self._counter}-{now:.6f}"
        self._calls[sh.correlation] = sh.instance
        self.counts["replica_requests"] += 1
        sh.outgoing, sh.unacked = bodies, set()
        self._pump(sh, now, publish)

    def _give_up(self, sh: Shipper, exc: Exception, tell: Any) -> None:
        self.counts["replica_errors"] += 1
        if self.counts["replica_errors"] <= 5 or self.counts["replica_errors"] % 1000 == 0:
            log.warning("keyed state not copied to %s, acked on its save alone: %s", sh.standby, exc,
                        extra={"instance": sh.instance})
        sh.given_up = sh.wanted
        tell(sh.instance, *sh.wanted)

    def _pump(self, sh: Shipper, now: float, publish: Any) -> None:
        """Publish the next requests of `sh.outgoing` while fewer than WINDOW wait for a PUBACK;
        the last one carries the correlation its reply answers."""
        while sh.outgoing is not None and len(sh.unacked) < WINDOW:
            try:
                body = next(sh.outgoing, None)
            except OSError as exc:  # the snapshot could not be read: from a snapshot again, later
                log.warning("keyed state not copied to %s: %s", sh.standby, exc, extra={"instance": sh.instance})
                self._calls.pop(sh.correlation, None)
                sh._reset()
                sh.held, sh.retry_at = None, now + RETRY_AFTER
                return
            if body is None:
                sh.outgoing = None
                return
            last = len(sh.outgoing) == 0
            handle = publish(sh.standby, body, sh.correlation if last else None)
            if not handle:
                self._calls.pop(sh.correlation, None)
                sh._reset()  # not queued: sent again from the start at the next turn
                sh.held = None
                return
            sh.deadline = now + REPLY_TIMEOUT  # the reply is due after the last part
            if last:
                sh.outgoing = None
            if handle is not True:
                sh.unacked.add(int(handle))
                self._mids[int(handle)] = sh.instance

    def on_reply(self, correlation: str, replier: str, result: Dict[str, Any], now: float,
                 publish: Any, tell: Any) -> None:
        inst = self._calls.pop(correlation, None)
        sh = self.shippers.get(inst) if inst is not None else None
        if sh is None or sh.standby != replier or sh.inflight is None:
            return  # a late reply (timed out, or the standby changed since)
        token = sh.answered(result, now)
        if token is None:
            self.counts["replica_resyncs"] += 1
            log.info("standby %s asks for a snapshot: %s", replier, str(result.get("error"))[:200],
                     extra={"instance": inst})
        else:
            tell(sh.instance, *token)
        if sh.due(now):
            self._send(sh, now, publish, tell)

    def drop_unlisted(self, host: str, listed: Iterable[str]) -> None:
        """The copies `host` writes for instances its hosted record no longer lists go: they left
        it (scale-in, hand-over, undeploy). A dead host's retained record keeps listing them."""
        keep = set(listed)
        for inst, h in self.store.instances().items():
            if h == host and inst not in keep:
                self.store.forget(inst)
