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
Sans-IO except `read_saved` and `ReplicaStore` (files).
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
from typing import Any, Dict, Iterable, List, Optional, Tuple

from agent.files import append, write_atomic
from agent.node.statexfer import check_keyed

__all__ = ["PART_BYTES", "MAX_SNAPSHOT_BYTES", "REPLY_TIMEOUT", "Replication", "Shipper", "ReplicaStore",
           "choose_standby", "read_saved"]

log = logging.getLogger("agent.node.replicas")

# Raw bytes per request: in base64 plus the header, ~171 KiB, under wire.MAX_CONTROL_BYTES (256 KiB).
PART_BYTES = 128 * 1024
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


def choose_standby(me: str, eligible: Iterable[str], current: Optional[str]) -> Optional[str]:
    """The standby for an instance hosted on `me`: the current one while it stays eligible (a new
    one costs a snapshot), else the first eligible node after `me` in name order, wrapping."""
    nodes = sorted(set(eligible) - {me})
    if current in nodes:
        return current
    after = [n for n in nodes if n > me]
    return (after or nodes or [None])[0]


def read_saved(path: Path) -> Optional[Tuple[int, bytes, bytes]]:
    """What a keyed instance's files hold now: (generation, snapshot, log), the log cut to the
    whole lines of that generation. The worker may be saving meanwhile: a snapshot read before a
    newer one replaced it keeps its own lines only (each starts with its generation), so what is
    returned is always one consistent save, never newer than the files. None: nothing saved."""
    try:
        snapshot = path.read_bytes()
    except FileNotFoundError:
        return None
    m = _SNAP_GEN.match(snapshot[:64])
    if m is None:
        raise ValueError(f"{path}: not a keyed snapshot")
    gen = int(m.group(1))
    try:
        log = path.with_name(path.name + ".log").read_bytes()
    except FileNotFoundError:
        log = b""
    prefix = b'{"gen":%d,' % gen
    end = 0
    while end < len(log):
        nl = log.find(b"\n", end)
        if nl < 0 or not log.startswith(prefix, end):
            break
        end = nl + 1
    return gen, snapshot, log[:end]


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

    def set_standby(self, node: Optional[str]) -> bool:
        """True when the standby changed (it gets a snapshot first)."""
        if node == self.standby:
            return False
        self.standby, self.held, self.inflight = node, None, None
        return True

    def due(self, now: float) -> bool:
        return (self.inflight is None and now >= self.retry_at and self.standby is not None and self.wanted != self.given_up
                and (self.held is None or self.held < self.wanted))

    def requests(self, saved: Tuple[int, bytes, bytes], now: float) -> List[Dict[str, Any]]:
        """The requests that bring the standby up to `saved` (read_saved), or [] when it holds it.
        A snapshot goes in parts (answered after the last); then the log, one range a request."""
        gen, snapshot, log = saved
        if self.inflight is not None or self.standby is None:
            return []
        if self.held is not None and self.held[0] == gen:
            start = self.held[1]
            if start >= len(log):
                self.held = (gen, start)
                return []
            data = log[start:start + PART_BYTES]
            self.inflight, self.deadline = (gen, start + len(data)), now + REPLY_TIMEOUT
            return [{"op": "replica", "instance": self.instance, "gen": gen, "offset": start,
                     "data": base64.b64encode(data).decode()}]
        if len(snapshot) > MAX_SNAPSHOT_BYTES:
            raise ValueError(f"keyed state of {len(snapshot)} bytes: more than the {MAX_SNAPSHOT_BYTES} a standby keeps")
        digest = hashlib.sha256(snapshot).hexdigest()
        parts = max(1, -(-len(snapshot) // PART_BYTES))
        self.inflight, self.deadline = (gen, 0), now + REPLY_TIMEOUT
        return [{"op": "replica", "instance": self.instance, "gen": gen, "part": i, "parts": parts,
                 "size": len(snapshot), "sha256": digest,
                 "data": base64.b64encode(snapshot[i * PART_BYTES:(i + 1) * PART_BYTES]).decode()}
                for i in range(parts)]

    def answered(self, result: Dict[str, Any], now: float = 0.0) -> Optional[Token]:
        """The standby's reply: the token it holds now (tell the worker), or None (a snapshot
        next, not before RETRY_AFTER: a refusal answered at once would be a storm)."""
        target, self.inflight = self.inflight, None
        gen, log = result.get("gen"), result.get("log")
        if result.get("ok") is True and target is not None and (gen, log) == target:
            self.held = target
            return target
        self.held, self.retry_at = None, now + RETRY_AFTER
        return None

    def timed_out(self, now: float) -> bool:
        if self.inflight is not None and now >= self.deadline:
            self.inflight, self.held = None, None
            return True
        return False


@dataclass
class _Staged:
    host: str
    gen: int
    size: int
    sha256: str
    parts: Dict[int, bytes] = field(default_factory=dict)


class ReplicaStore:
    """The standby's copies, under `root` (`<state_dir>/replicas`): per instance its snapshot,
    its log and `<instance>.replica.json` ({"host", "gen", "log"}: who may write it, what it holds)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._staged: Dict[str, _Staged] = {}  # instance -> the snapshot being assembled (one each)
        self.counts = {"replica_snapshots": 0, "replica_appends": 0, "replica_refused": 0}

    def _paths(self, instance: str) -> Tuple[Path, Path, Path]:
        base = self.root / f"{instance}.keyed.json"
        return base, base.with_name(base.name + ".log"), self.root / f"{instance}.replica.json"

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
        snap, log, meta_path = self._paths(inst)
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
        write_atomic(meta_path, json.dumps({"host": host, "gen": gen, "log": offset + len(data)}))
        self.counts["replica_appends"] += 1
        return {"ok": True, "instance": inst, "gen": gen, "log": offset + len(data)}

    def _part(self, host: str, inst: str, gen: int, body: Dict[str, Any], data: bytes) -> Optional[Dict[str, Any]]:
        part, parts, size, digest = body.get("part"), body.get("parts"), body.get("size"), body.get("sha256")
        if not (isinstance(parts, int) and isinstance(part, int) and isinstance(size, int)
                and 0 <= part < parts and 0 <= size <= MAX_SNAPSHOT_BYTES and parts == max(1, -(-size // PART_BYTES))
                and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise ValueError("snapshot part: bad part, parts, size or sha256")
        st = self._staged.get(inst)
        if st is None or (st.host, st.gen, st.size, st.sha256) != (host, gen, size, digest):
            st = self._staged[inst] = _Staged(host, gen, size, digest)  # one snapshot at a time each
        st.parts[part] = data
        if len(st.parts) < parts:
            return None
        del self._staged[inst]
        whole = b"".join(st.parts[i] for i in range(parts))
        if len(whole) != size or hashlib.sha256(whole).hexdigest() != digest:
            raise ValueError("snapshot does not match its size and sha256")
        snap, log, meta_path = self._paths(inst)
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(snap, whole.decode("utf-8"))
        log.write_bytes(b"")
        write_atomic(meta_path, json.dumps({"host": host, "gen": gen, "log": 0}))
        self.counts["replica_snapshots"] += 1
        return {"ok": True, "instance": inst, "gen": gen, "log": 0}

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
        if _INSTANCE.fullmatch(instance):
            for p in self._paths(instance):
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
    saves, requests and replies is the whole of its behaviour."""

    def __init__(self, node: str, state_dir: Path) -> None:
        self.node = node
        self.state_dir = state_dir
        self.store = ReplicaStore(state_dir / "replicas")
        self.shippers: Dict[str, Shipper] = {}
        self._calls: Dict[str, str] = {}  # correlation -> instance
        self._counter = 0
        self.counts = {"replica_requests": 0, "replica_timeouts": 0, "replica_local_only": 0,
                       "replica_resyncs": 0, "replica_errors": 0}

    def saved(self, instance: str, gen: int, log: int) -> None:
        """A worker saved its keyed state (its "keyed_saved" line)."""
        sh = self.shippers.setdefault(instance, Shipper(instance))
        sh.wanted = max(sh.wanted, (gen, log))

    def forget(self, instance: str) -> None:
        """The instance left this node (scale-in, hand-over, undeploy): its shipper goes."""
        self.shippers.pop(instance, None)
        self._drop_calls(instance)

    def _drop_calls(self, instance: str) -> None:
        for c in [c for c, i in self._calls.items() if i == instance]:
            del self._calls[c]

    def standby_of(self, instance: str) -> Optional[str]:
        sh = self.shippers.get(instance)
        return sh.standby if sh is not None else None

    def owns(self, correlation: str) -> bool:
        return correlation in self._calls

    def tick(self, now: float, eligible: Iterable[str], publish: Any, tell: Any) -> bool:
        """Choose standbys, expire requests, send what is due. `publish(standby, body,
        correlation or None) -> bool`; `tell(instance, gen, log)` answers a worker. True when a
        standby changed (the hosted record names it)."""
        nodes = sorted(set(eligible) - {self.node})
        changed = False
        for inst, sh in self.shippers.items():
            changed |= sh.set_standby(choose_standby(self.node, nodes, sh.standby))
            if sh.timed_out(now):
                self.counts["replica_timeouts"] += 1
                self._drop_calls(inst)
            if sh.standby is None:  # nobody to copy to: the save alone, as without replication
                if sh.held != sh.wanted and sh.wanted[0] >= 0:
                    sh.held = sh.wanted
                    self.counts["replica_local_only"] += 1
                    tell(inst, *sh.wanted)
                continue
            if sh.due(now):
                self._send(sh, now, publish, tell)
        return changed

    def _send(self, sh: Shipper, now: float, publish: Any, tell: Any) -> None:
        try:
            saved = read_saved(self.state_dir / f"{sh.instance}.keyed.json")
            bodies = sh.requests(saved, now) if saved is not None else []
        except (OSError, ValueError) as exc:
            # Too large or unreadable: acked on the save alone rather than never (a stall).
            self.counts["replica_errors"] += 1
            if self.counts["replica_errors"] <= 5 or self.counts["replica_errors"] % 1000 == 0:
                log.warning("keyed state not copied to %s, acked on its save alone: %s", sh.standby, exc,
                            extra={"instance": sh.instance})
            sh.given_up = sh.wanted
            tell(sh.instance, *sh.wanted)
            return
        if not bodies:
            return
        self._counter += 1
        correlation = f"replica-{self.node}-{self._counter}-{now:.6f}"
        self._calls[correlation] = sh.instance
        self.counts["replica_requests"] += 1
        for i, body in enumerate(bodies):
            last = i == len(bodies) - 1
            if not publish(sh.standby, body, correlation if last else None):
                self._calls.pop(correlation, None)
                sh.inflight = None  # not queued: sent again from the start at the next turn
                sh.held = None
                return

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
