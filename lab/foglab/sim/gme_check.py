"""Model checker for the GME cores: every delivery order for small systems, random ones for big.

Why: a GME algorithm fails on rare interleavings, never on the happy path. The checker drives the
same core classes as the simulator and the MQTT benchmark, over FIFO channels (one queue per
ordered pair of nodes, as the thesis's system model and docs/design.md invariant 1 require), and
explores which enabled step happens next:

- a node that is idle and has requests left calls `request()`,
- a node in the CS calls `exit()`,
- the oldest message of a non-empty channel is delivered.

Properties checked:
- safety (every reached state): no two nodes of different groups are in the CS together;
- liveness (every terminal state, i.e. nothing enabled): every node made all its requests and
  entered the CS for each of them; a terminal state with a node still requesting is a deadlock.
Each step strictly increases a measure of the global state (the checker verifies it on every
local transition it computes), so the state graph is acyclic, and a search that terminates shows
that every run is finite (`exhaustive_check` gives the argument): "every terminal state is good"
then means every request is eventually served under every schedule.

The exhaustive search reduces the interleavings it explores (persistent sets with the
visibility condition), the states it stores (symmetry inside a group, for 2-FGME) and the memory
per state (interned local states, interned channel contents, a flat tuple of small ints per state
stored as bytes, or as a 128-bit digest with `hash_states=True`); `exhaustive_check`'s docstring
gives the soundness argument of each.

Why one module: the search, its state encoding and the reductions depend on one
another's representation; the soundness argument reads in one place.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import mmap
import os
import pickle
import random
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, Union

from agent.protocol.gme_base import Entered, GmeNode, GmeState, NodeId, Send, two_groups

__all__ = [
    "ALGORITHMS",
    "make_nodes",
    "CheckResult",
    "ReductionUnsound",
    "exhaustive_check",
    "random_check",
    "random_schedule",
]


def _algorithms() -> Dict[str, Callable[..., GmeNode]]:
    from agent.protocol.gme_fgme import FgmeNode
    from agent.protocol.gme_ra1 import Ra1Node
    from agent.protocol.gme_ra2 import Ra2Node

    return {"2fgme": FgmeNode, "ra1": Ra1Node, "ra2": Ra2Node}


ALGORITHMS = ("2fgme", "ra1", "ra2")


def make_nodes(algorithm: str, sizes: Sequence[int], fault: Optional[str] = None) -> List[GmeNode]:
    """Nodes 0..N-1 of `algorithm`, split in consecutive groups of the given sizes."""
    classes = _algorithms()
    if algorithm not in classes:
        raise ValueError(f"unknown GME algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    groups = two_groups(sizes)
    cls = classes[algorithm]
    if fault is not None:
        return [cls(n, groups, fault=fault) for n in sorted(groups)]
    return [cls(n, groups) for n in sorted(groups)]


@dataclass
class CheckResult:
    """Outcome of a check; `ok` is False as soon as one violation was found."""

    states: int = 0
    schedules: int = 0
    safety_violations: int = 0
    deadlocks: int = 0
    protocol_errors: int = 0
    messages: int = 0
    transitions: int = 0  # exhaustive search: transitions executed (after reduction)
    local_states: int = 0  # exhaustive search: distinct node states met
    reduced: bool = False  # exhaustive search: partial-order reduction on
    hashed: bool = False  # exhaustive search: visited set by 128-bit digests (hash compaction)
    symmetry: bool = False  # exhaustive search: states matched up to in-group permutations
    full_expansions: int = 0  # exhaustive search with reduction: states where T = all enabled
    merged: bool = False  # exhaustive search: states equal up to dead variables matched
    layer: int = -1  # compiled sweep: the layer being (or last) explored
    held: int = 0  # compiled search: fingerprints in memory (sweep: at the peak, finished sub-layers dropped)
    sublayers: int = 0  # compiled sweep: sub-layers explored
    unchecked: int = 0  # compiled sweep: states that waited unchecked on disk (memory short)
    collision_bound: Optional[float] = None  # P(some state skipped by a digest collision) <= this
    first_failure: Optional[str] = None
    trace: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.safety_violations == 0 and self.deadlocks == 0 and self.protocol_errors == 0


def _clone_node(node: GmeNode) -> GmeNode:
    new = copy.copy(node)
    for k, v in node.__dict__.items():
        if isinstance(v, (set, dict, list)):
            setattr(new, k, copy.copy(v))
    return new


class _System:
    """Nodes + FIFO channels + per-node request budget; cloneable for the exhaustive search."""

    def __init__(self, nodes: List[GmeNode], requests: int) -> None:
        self.nodes = nodes
        self.left = [requests] * len(nodes)
        self.served = [0] * len(nodes)
        self.chan: Dict[Tuple[NodeId, NodeId], Tuple[object, ...]] = {}
        self.messages = 0

    def clone(self) -> "_System":
        new = _System.__new__(_System)
        new.nodes = [_clone_node(n) for n in self.nodes]
        new.left = list(self.left)
        new.served = list(self.served)
        new.chan = dict(self.chan)
        new.messages = self.messages
        return new

    def key(self) -> Tuple[object, ...]:
        return (
            tuple(n.snapshot() for n in self.nodes),
            tuple(self.left),
            tuple(sorted((k, v) for k, v in self.chan.items() if v)),
        )

    def enabled(self) -> List[Tuple[str, int, int]]:
        ev: List[Tuple[str, int, int]] = []
        for n in self.nodes:
            if n.state is GmeState.IDLE and self.left[n.id] > 0:
                ev.append(("request", n.id, -1))
            elif n.state is GmeState.IN_CS:
                ev.append(("exit", n.id, -1))
        for (a, b), q in sorted(self.chan.items()):
            if q:
                ev.append(("deliver", a, b))
        return ev

    def apply(self, ev: Tuple[str, int, int]) -> None:
        kind, a, b = ev
        if kind == "request":
            self.left[a] -= 1
            outs = self.nodes[a].request()
            src = a
        elif kind == "exit":
            outs = self.nodes[a].exit()
            src = a
        else:
            q = self.chan[(a, b)]
            msg, self.chan[(a, b)] = q[0], q[1:]
            outs = self.nodes[b].receive(msg)  # type: ignore[arg-type]
            src = b
        for o in outs:
            if isinstance(o, Send):
                key = (src, o.to)
                self.chan[key] = self.chan.get(key, ()) + (o.message,)
                self.messages += 1
            elif isinstance(o, Entered):
                self.served[src] += 1

    def unsafe(self) -> bool:
        in_cs = {n.group for n in self.nodes if n.state is GmeState.IN_CS}
        return len(in_cs) > 1

    def describe(self) -> str:
        return ", ".join(f"{n.id}:{n.group}:{n.state.name}" for n in self.nodes)

    def all_served(self) -> bool:
        return all(l == 0 for l in self.left) and all(
            n.state is GmeState.IDLE for n in self.nodes
        ) and all(s == n.entries for s, n in zip(self.served, self.nodes))


# Monotone per-node counters for the acyclicity argument (see `exhaustive_check`) and for the
# compiled sweep's progress measure (gme_fast): 2-FGME's epoch (+1 per Req multicast), RA2's
# sum of VF (a captain's Start raises VF of its target).
_PROGRESS: Dict[str, Callable[[GmeNode], int]] = {
    "2fgme": lambda x: x.epoch,  # type: ignore[attr-defined]
    "ra1": lambda x: 0,
    "ra2": lambda x: sum(x.vf),  # type: ignore[attr-defined]
}

_REQUEST, _EXIT = -1, -2  # event codes; an event code >= 0 is "deliver the head of channel code -> node"


class _CoreError(Exception):
    """A protocol core raised while the exhaustive search ran it (the cause is the core's error).

    Only these count as protocol errors: a MemoryError or a bug of the checker itself must
    propagate, not be reported as a defect of the algorithm."""


class ReductionUnsound(RuntimeError):
    """An assumption the reductions rely on does not hold for this algorithm (never silently ignored)."""


class _LocalStates:
    """Interned local states and a memo of their transitions (the exhaustive search's engine).

    A node is deterministic: the same local state and the same input always give the same next
    state and outputs. A global state is a combination of a few thousand distinct local states,
    so the search runs each (local state, input) through the real core once, and afterwards only
    looks the answer up. Local states and messages are interned to small ints, so a global state
    key is a tuple of ints hashed at C speed, and nothing is copied or re-hashed per step.
    """

    def __init__(self, nodes: Sequence[GmeNode], progress: Callable[[GmeNode], int] = lambda x: 0) -> None:
        self.progress_of = progress
        self.progress: List[int] = []  # per local state: the node's monotone progress counter
        self.phase: List[int] = []  # per local state: 2 * entries - in_cs (+1 per entry, per exit)
        self.allowed: Optional[Set[Tuple[int, int]]] = None  # (sender, receiver) pairs, if checked
        self.objs: List[GmeNode] = []
        self.ids: Dict[Tuple[int, object], int] = {}
        self.in_cs: List[bool] = []
        self.idle: List[bool] = []
        self.msgs: List[object] = []
        self.msg_ids: Dict[object, int] = {}
        self.memo: Dict[Tuple[int, str, int], Tuple[int, Tuple[Tuple[int, int], ...]]] = {}
        self.renames: Dict[Tuple[int, Tuple[int, ...]], int] = {}
        self.renames_msg: Dict[Tuple[int, Tuple[int, ...]], int] = {}
        # dead-variable merging (`exhaustive_check(merge_dead=True)`): classes of
        # (local state, requests left) with equal `live_snapshot`, and what a class does
        self.merge = False
        self.stride = 1  # requests + 1: (sid, left) is keyed as sid * stride + left
        self.class_ids: Dict[Tuple[int, object], int] = {}
        self.class_of: Dict[int, int] = {}
        self.class_rep: List[Tuple[int, int]] = []  # class -> (a local state in it, left)
        self.class_steps: Dict[Tuple[int, str, int], Tuple[Tuple[Tuple[int, int], ...], int]] = {}
        self.class_renames: Dict[Tuple[int, Tuple[int, ...]], int] = {}
        self.class_counter: Dict[int, int] = {}  # class -> the compiled sweep's counter (one per class)
        self.initial = tuple(self.intern(i, x) for i, x in enumerate(nodes))

    def intern(self, index: int, node: GmeNode) -> int:
        key = (index, node.snapshot())
        sid = self.ids.get(key)
        if sid is None:
            sid = self.ids[key] = len(self.objs)
            self.objs.append(node)
            in_cs = node.state is GmeState.IN_CS
            self.in_cs.append(in_cs)
            self.idle.append(node.state is GmeState.IDLE)
            self.progress.append(self.progress_of(node))
            self.phase.append(2 * node.entries - in_cs)
        return sid

    def rename(self, sid: int, perm: Tuple[int, ...]) -> int:
        key = (sid, perm)
        r = self.renames.get(key)
        if r is None:
            node = self.objs[sid]
            r = self.renames[key] = self.intern(perm[node.id], node.renamed(perm))  # type: ignore[attr-defined]
        return r

    def rename_msg(self, mid: int, perm: Tuple[int, ...]) -> int:
        key = (mid, perm)
        r = self.renames_msg.get(key)
        if r is None:
            m = self.msgs[mid]
            m2 = dataclasses.replace(m, sender=perm[m.sender])  # type: ignore[type-var, attr-defined]
            r = self.msg_ids.get(m2)
            if r is None:
                r = self.msg_ids[m2] = len(self.msgs)
                self.msgs.append(m2)
            self.renames_msg[key] = r
        return r

    def klass(self, sid: int, left: int) -> int:
        """The class of local state `sid` with `left` requests to make: equal live snapshots."""
        k = sid * self.stride + left
        c = self.class_of.get(k)
        if c is None:
            node = self.objs[sid]
            key = (node.id, left, node.live_snapshot(left))  # type: ignore[attr-defined]
            c = self.class_ids.get(key)
            if c is None:
                c = self.class_ids[key] = len(self.class_rep)
                self.class_rep.append((sid, left))
            self.class_of[k] = c
        return c

    def rename_class(self, c: int, perm: Tuple[int, ...]) -> int:
        """The class of the renamed members of class `c` (renaming commutes with the live
        snapshot: `renamed` renames every field; `check_rename` verifies it per member)."""
        key = (c, perm)
        r = self.class_renames.get(key)
        if r is None:
            sid, left = self.class_rep[c]
            r = self.class_renames[key] = self.klass(self.rename(sid, perm), left)
        return r

    def check_rename(self, sid: int, left: int, perms: Sequence[Tuple[int, ...]]) -> None:
        c = self.klass(sid, left)
        for p in perms:
            if self.klass(self.rename(sid, p), left) != self.rename_class(c, p):
                raise ReductionUnsound(f"renaming local state {sid} by {p} does not commute with its live snapshot")

    def step(self, index: int, sid: int, kind: str, mid: int) -> Tuple[int, Tuple[Tuple[int, int], ...]]:
        """(next local state, ((to, message id), ...)); raises what the core raises."""
        key = (sid, kind, mid)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        x = _clone_node(self.objs[sid])
        try:
            if kind == "request":
                outs = x.request()
            elif kind == "exit":
                outs = x.exit()
            else:
                outs = x.receive(self.msgs[mid])  # type: ignore[arg-type]
        except Exception as exc:  # the core's failure, told apart from the checker's own errors
            raise _CoreError(exc) from exc
        sends: List[Tuple[int, int]] = []
        for o in outs:
            if type(o) is Send:
                m = o[1]
                k = self.msg_ids.get(m)
                if k is None:
                    k = self.msg_ids[m] = len(self.msgs)
                    self.msgs.append(m)
                sends.append((o[0], k))
        res = (self.intern(index, x), tuple(sends))
        self._check_step(index, sid, kind, mid, res)
        if self.merge:
            self._check_class_step(sid, kind, mid, res)
        self.memo[key] = res
        return res

    def _check_class_step(self, sid: int, kind: str, mid: int, res: Tuple[int, Tuple[Tuple[int, int], ...]]) -> None:
        """Dead-variable merging's assumption, for one local transition: every local state of a
        class, for the same input, sends the same messages and moves to one class."""
        nsid, sends = res
        for left in range(1 if kind == "request" else 0, self.stride):
            after = left - 1 if kind == "request" else left
            val = (sends, self.klass(nsid, after))
            old = self.class_steps.setdefault((self.klass(sid, left), kind, mid), val)
            if old != val:
                raise ReductionUnsound(
                    f"local states {self.class_rep[self.klass(sid, left)][0]} and {sid} have equal live "
                    f"snapshots but differ on {kind} {self.msgs[mid] if mid >= 0 else ''}: {old} vs {val}"
                )

    def _check_step(
        self, index: int, sid: int, kind: str, mid: int, res: Tuple[int, Tuple[Tuple[int, int], ...]]
    ) -> None:
        """The assumptions of `exhaustive_check`'s soundness argument, for one local transition.

        (a) sends follow the declared communication graph (the partial-order reduction's "who may
        enable whose delivery"); (b) the step strictly increases the lexicographic measure
        (progress, requests made, phase, -Reqs in flight, -other messages in flight), so the
        full state graph is acyclic. Checked once per distinct (local state, input)."""
        nsid, sends = res
        if self.allowed is not None:
            for to, _m in sends:
                if (index, to) not in self.allowed:
                    raise ReductionUnsound(f"node {index} sent to {to}, outside the communication graph")
        reqs = sum(1 for _to, m in sends if self.msgs[m].kind == "req")  # type: ignore[attr-defined]
        consumed_req = kind == "deliver" and self.msgs[mid].kind == "req"  # type: ignore[attr-defined]
        delta = (
            self.progress[nsid] - self.progress[sid],
            1 if kind == "request" else 0,
            self.phase[nsid] - self.phase[sid],
            consumed_req - reqs,
            (kind == "deliver" and not consumed_req) - (len(sends) - reqs),
        )
        if not any(delta) or next(d for d in delta if d) < 0:
            raise ReductionUnsound(
                f"node {index}: step {kind} {self.msgs[mid] if mid >= 0 else ''} does not increase the "
                f"acyclicity measure (deltas {delta}); the checker's liveness and reduction arguments need it"
            )


class _DigestSet:
    """A set of fixed-width digests in one flat bytearray (open addressing, linear probing).

    Why: a Python set of 16-byte `bytes` costs ~90 bytes per element (object header, allocator
    rounding, set slot); this table costs `width` bytes per slot at a load factor <= 2/3, 1.5 to
    3 x `width` bytes per state (24-48 for the default 16). The empty slot is all zero
    bytes; a stored digest has its lowest bit forced to 1 (8 * width - 1 bits remain, see
    `collision_bound`). `fixed=True` never doubles (doubling holds the old and the new table at
    once, 3x the memory at the worst moment): the table is allocated at its final size and
    fills up to a load of 0.9, then raises."""

    def __init__(self, capacity: int = 1 << 20, width: int = 16, fixed: bool = False) -> None:
        if capacity & (capacity - 1):
            raise ValueError(f"digest table capacity must be a power of two, got {capacity}")
        self.cap = capacity
        self.mask = capacity - 1
        self.width = width
        self.fixed = fixed
        # a fixed table is an anonymous mapping: zero pages come from the kernel on first touch,
        # where PyPy's bytearray(n) needs about twice n while it builds it
        self.table: Any = mmap.mmap(-1, width * capacity) if fixed else bytearray(width * capacity)
        self.size = 0

    def add(self, digest: bytes) -> bool:
        """Insert; True if the digest was not there yet."""
        w = self.width
        d = digest[:w - 1] + bytes((digest[w - 1] | 1,))
        table, mask = self.table, self.mask
        i = int.from_bytes(d[:8], "little") & mask
        while True:
            o = w * i
            cur = table[o:o + w]
            if cur == d:
                return False
            if not any(cur):
                table[o:o + w] = d
                self.size += 1
                if self.fixed:
                    if 10 * self.size > 9 * self.cap:
                        raise RuntimeError(f"digest table full: {self.size} states in {self.cap} slots")
                elif 3 * self.size > 2 * self.cap:
                    self._grow()
                return True
            i = (i + 1) & mask

    def _grow(self) -> None:
        old, w = self.table, self.width
        self.cap *= 2
        self.mask = self.cap - 1
        self.table = bytearray(w * self.cap)
        self.size = 0
        zero = bytes(w)
        for o in range(0, len(old), w):
            d = bytes(old[o:o + w])
            if d != zero:
                self.add(d)

    def __len__(self) -> int:
        return self.size


_CHUNK = 1 << 26  # bytes of the visited table copied at a time by a checkpoint


def _budgets(requests: Union[int, Sequence[int]], n: int) -> Tuple[int, ...]:
    """Requests per node: one number for all, or one per node (e.g. 2,2,2,1 to measure how the
    state space grows towards 2+2 x 2)."""
    if isinstance(requests, int):
        return (requests,) * n
    if len(requests) != n:
        raise ValueError(f"{len(requests)} request budgets for {n} nodes")
    return tuple(requests)


class _Layout:
    """Where things are in a global state (a flat tuple: n local state ids, n budgets, one
    channel-content id per channel of the communication graph), and the symmetries."""

    def __init__(self, nodes0: Sequence[GmeNode], symmetry: bool) -> None:
        n = self.n = len(nodes0)
        self.groups = groups = [x.group for x in nodes0]
        # who may send to whom: the competitors (2-FGME) or every other node (RA1, RA2)
        senders: List[Tuple[int, ...]] = [
            tuple(sorted(x.competitors)) if hasattr(x, "competitors") else tuple(j for j in range(n) if j != x.id)
            for x in nodes0
        ]
        self.allowed = {(b, i) for i in range(n) for b in senders[i]}
        self.chan_index = chan_index = sorted(self.allowed)  # channels that can ever be non-empty
        self.nch = len(chan_index)
        self.L0, self.C0 = n, 2 * n
        self.slot = slot = {c: self.C0 + k for k, c in enumerate(chan_index)}  # channel -> position
        self.inbound = [[(b, slot[(b, i)]) for b in senders[i]] for i in range(n)]
        self.out_slot = [{to: slot[(i, to)] for to in range(n) if (i, to) in slot} for i in range(n)]
        # permutations inside each group (a group's ids are consecutive), identity left out
        self.perms: List[Tuple[int, ...]] = []
        if symmetry and hasattr(nodes0[0], "renamed"):
            blocks: List[List[int]] = []
            for i, g in enumerate(groups):
                if blocks and groups[blocks[-1][0]] == g:
                    blocks[-1].append(i)
                else:
                    blocks.append([i])
            for choice in itertools.product(*(itertools.permutations(b) for b in blocks)):
                perm = [0] * n
                for b, part in zip(blocks, choice):
                    for src, dst in zip(b, part):
                        perm[src] = dst
                if tuple(perm) != tuple(range(n)):
                    self.perms.append(tuple(perm))
        # per permutation: where each position of the state goes
        self.perm_pos = [
            [p[i] for i in range(n)] + [self.L0 + p[i] for i in range(n)]
            + [slot[(p[a], p[b])] for (a, b) in chan_index]
            for p in self.perms
        ]


def _save_checkpoint(
    path: str, run_id: Tuple[object, ...], gen: int, parts: Dict[str, Any], digests: _DigestSet
) -> None:
    """Write everything the DFS needs to go on; the previous checkpoint stays valid until the new
    one is complete (the visited table and the rest must be of the same moment: a table with
    states added after the stack was saved would make the resumed search skip them unexplored)."""
    table_path = f"{path}.table.{gen}"
    table = digests.table
    with open(table_path, "wb") as f:  # in slices: PyPy copies a whole mmap it writes (12 GB)
        for o in range(0, len(table), _CHUNK):
            f.write(table[o:o + _CHUNK])
    digests.table = None  # type: ignore[assignment]
    try:
        with open(path + ".tmp", "wb") as f:
            pickle.dump({"run_id": run_id, "gen": gen, "table_path": table_path, **parts, "digests": digests},
                        f, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        digests.table = table
    os.replace(path + ".tmp", path)
    old = f"{path}.table.{gen - 1}"
    if os.path.exists(old):
        os.remove(old)


def _load_checkpoint(path: str, run_id: Tuple[object, ...]) -> Optional[Dict[str, Any]]:
    """The saved search, if `path` holds one for the same question (else a clear error)."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        saved = pickle.load(f)
    if saved["run_id"] != tuple(run_id):
        raise ValueError(f"checkpoint {path} is of another check {saved['run_id']}, not {tuple(run_id)}")
    d = saved["digests"]
    size = d.width * d.cap
    d.table = mmap.mmap(-1, size) if d.fixed else bytearray(size)
    with open(saved["table_path"], "rb") as f:
        for o in range(0, size, _CHUNK):
            part = f.read(_CHUNK)
            if len(part) != min(_CHUNK, size - o):
                raise ValueError(f"checkpoint table {saved['table_path']} is truncated")
            d.table[o:o + len(part)] = part
    return saved


def exhaustive_check(
    algorithm: str,
    sizes: Sequence[int] = (2, 2),
    requests: Union[int, Sequence[int]] = 2,
    fault: Optional[str] = None,
    max_states: int = 200_000_000,
    symmetry: bool = False,
    reduction: bool = True,
    hash_states: bool = False,
    progress: Optional[Callable[[CheckResult], None]] = None,
    progress_every: int = 1_000_000,
    digest_slots: Optional[int] = None,
    merge_dead: bool = False,
    check_merges: bool = False,
    checkpoint: Optional[str] = None,
    checkpoint_every: int = 50_000_000,
) -> CheckResult:
    """Explore every reachable state up to the reductions below (DFS). Stops at the first violation.

    Model: nodes are the real cores (deterministic); channel b -> i is FIFO (thesis 5.2.1,
    docs/design.md invariant 1). A transition is one node's step: `request()` (idle, requests left),
    `exit()` (in the CS) or the delivery of the head of one of its input channels. A global state
    is one flat tuple of small ints: local state ids, request budgets, and one interned id per
    channel of the communication graph for its contents (a tuple of message ids). `_LocalStates`
    runs each (local state, input) pair through the core once and memoizes the answer.

    Properties: safety (no two groups in the CS) on every explored state; liveness on every
    terminal state (nothing enabled): every request made and served, everybody idle, else it is
    a deadlock. A core raising is a protocol error.

    Acyclicity (needed by liveness AND by the reduction's soundness proof): every transition
    strictly increases, lexicographically, (sum of the nodes' progress counters `_PROGRESS`,
    requests made, sum of 2*entries - in_cs, -Reqs in flight, -other messages in flight), all
    functions of the global state. So the full state graph has no cycle. A strictly increasing
    measure alone does not bound a run (the epochs are unbounded integers); finiteness follows
    from the search terminating: an infinite run from an explored state s has an infinite
    continuation from an explored successor of s (below: move the first transition of the
    persistent set T to the front, or, if the run has none, put any t in T first; t stays enabled
    and commutes with the whole run), so the explored graph, acyclic too (see merging below),
    would be infinite. A finite search thus means no infinite run, a finite full graph
    (finitely branching, König), every run ends in a terminal state, and "every terminal state
    is good" means every request is served under every schedule.
    By inspection of the cores: 2-FGME's Req handler sends no Req and leaves the epoch; its
    Ack and End handlers send Reqs only through `_multicast_req` (epoch +1), else enter or
    send nothing; RA1 sends Reqs only in `request()`; RA2's Start messages
    raise VF (`_capture`), VF only grows (`_merge` takes maxima), and its handlers otherwise
    answer a Req with at most one Ack or enter. The checker does not take this on faith: every
    step enabled in an explored state (each distinct local transition once, memoized; the
    steps the reduction leaves out included) is checked to increase the measure, else
    ReductionUnsound. (States the reduction never reaches are covered by the inspection only.)

    Partial-order reduction (`reduction=True`), persistent sets [Godefroid 1996, ch. 4] with
    the visibility condition [Peled 1994]. Transitions of different nodes are independent: a step
    touches one node's state, pops the head of one of its non-empty input channels and appends
    to the tail of its output channels; a pop at the head and an append at the tail of a
    non-empty FIFO commute. Two transitions of one node are dependent. At a state s, the set T is
    the enabled transitions of a node set S closed under: j in S, b may send to j, channel b -> j
    empty => b in S (b's move is the only way to enable that delivery of j). T is persistent:
    while nobody in S moves, S's states and the channels between S nodes stay as they are, every
    channel into S from outside stays non-empty (so S's deliveries stay enabled, no new
    transition of S appears) and outside moves only append behind the head S pops. "b may send
    to j" is the algorithm's communication graph (2-FGME: competitors only), verified on every
    computed transition (a send outside it raises ReductionUnsound). Visibility: if T is not
    everything enabled, no transition in T enters or leaves the CS (a candidate that would is
    skipped; the smallest valid candidate is taken, else all enabled transitions).
    Soundness, by induction on the height of a state in the (acyclic) full graph: (1) every
    terminal state reachable from an explored state s is reached: a run from s to a terminal
    state contains a T transition (else T would still be enabled at the end); moving the first
    one to the front gives an equivalent run through an explored successor, of smaller height.
    (2) every violation reachable from s is reached: if the run to the bad state contains a
    T transition, the same; if not, any t in T is independent of the whole run and invisible
    (its node does not move in the run, so t does the same local step at the end), so t followed
    by the run reaches a state with the same nodes in the CS, from the explored successor t(s).
    Protocol errors: a raising step is a step of one node; the same argument (a node that raised
    is stuck) reaches one. No cycle proviso is needed because the full graph is acyclic.

    Symmetry (`symmetry=True`, cores with `renamed(perm)`: 2-FGME): permutations inside each
    group (a group's ids are consecutive, so every cross-group priority comparison, the only ones
    2-FGME makes, keeps its outcome) map runs to runs and keep both properties and the measure.
    A state is matched by its smallest encoding over these permutations; the state itself is
    explored. It composes with (1)-(2) above: a successor matched up to symmetry has a symmetric
    image explored, from which the symmetric image of every terminal/bad state is reached.

    Dead-variable merging (`merge_dead=True`, cores with `live_snapshot(left)`: 2-FGME). The
    node part of the matched key holds, instead of a local state, its class: the node, its
    requests left, and its live snapshot (the variables a future step can read before writing
    them; the core's docstring argues it per state). Two states with equal keys are bisimilar:
    each node's classes react to every input with the same sends and successor classes, and the
    channels and budgets are equal. Every computed local transition is checked for this against
    the class's first recorded answer, for each number of requests left (`ReductionUnsound`
    otherwise); `check_merges=True` also computes the steps of every state matched to an
    explored one, so on small sizes the bisimulation is checked on every reached state (tests).
    Merged states are matched like symmetric ones and compose with (1)-(2) the same way. Two
    states of one path with equal keys have equal measures (the same nodes are finished, and a
    finished node never changes its epoch again; entries follow from budget and state), so no
    path returns to its own key and the matched graph stays acyclic.

    Visited set: exact (`hash_states=False`: the canonical state, a flat tuple of small ints, as
    bytes in a Python set, ~150 bytes per state) or hash compaction (`hash_states=True`: a 128-bit
    BLAKE2b digest of it, one bit forced to 1, in `_DigestSet`, ~30 bytes per state). With hash
    compaction two distinct states can collide and one of them would be skipped unexplored; the
    probability that any collision happened among N states is at most N^2 / 2^128 (127
    uniformly distributed bits, N^2/2 pairs), reported as `collision_bound`. `digest_slots`
    (a power of two) pre-sizes the table for runs that fill most of the memory: 96-bit digests,
    12 bytes a slot, never doubled, bound N^2 / 2^96.
    """
    res = CheckResult(reduced=reduction, hashed=hash_states)
    nodes0 = make_nodes(algorithm, sizes, fault)
    n = len(nodes0)
    groups = [x.group for x in nodes0]
    progress_of = _PROGRESS.get(algorithm, lambda x: 0)
    ls = _LocalStates(nodes0, progress_of)
    # what a checkpoint must match to be resumed: the question asked, not how it is answered
    budgets = _budgets(requests, n)
    run_id = (algorithm, tuple(sizes), budgets, fault, symmetry, reduction, hash_states, digest_slots, merge_dead)
    saved = _load_checkpoint(checkpoint, run_id) if checkpoint else None
    if saved is not None:
        ls = saved["ls"]
        ls.progress_of = progress_of
    merge = ls.merge = merge_dead and hasattr(nodes0[0], "live_snapshot")
    ls.stride = max(budgets) + 1
    res.merged = merge
    in_cs_of, idle_of = ls.in_cs, ls.idle
    lay = _Layout(nodes0, symmetry)
    ls.allowed = lay.allowed
    nch, L0, C0 = lay.nch, lay.L0, lay.C0
    slot, inbound, out_slot, perms, perm_pos = lay.slot, lay.inbound, lay.out_slot, lay.perms, lay.perm_pos

    # channel contents (tuples of message ids) interned to ints; 0 is the empty channel
    chan_objs: List[Tuple[int, ...]] = saved["chan_objs"] if saved else [()]
    chan_ids: Dict[Tuple[int, ...], int] = {q: c for c, q in enumerate(chan_objs)}

    def intern_chan(q: Tuple[int, ...]) -> int:
        c = chan_ids.get(q)
        if c is None:
            c = chan_ids[q] = len(chan_objs)
            chan_objs.append(q)
        return c

    pop_memo: Dict[int, Tuple[int, int]] = {}  # content -> (head message, content without it)
    push_memo: Dict[Tuple[int, int], int] = {}  # (content, message) -> content with it appended

    rename_node = ls.rename_class if merge else ls.rename  # what the node part of a key holds
    res.symmetry = bool(perms)
    # per permutation: memos of renamed ids
    sid_ren: List[Dict[int, int]] = [{} for _ in perms]
    cid_ren: List[Dict[int, int]] = [{} for _ in perms]

    def canonical(state: Tuple[int, ...]) -> Tuple[int, ...]:
        """The smallest image of `state` under the in-group permutations (itself if none).

        The node part (the first n entries) is compared first: an image whose node part is
        already larger than the best one's cannot win, and its channels are not renamed."""
        best = state
        best_nodes = state[:n]
        for pi, p in enumerate(perms):
            pos, sr, cr = perm_pos[pi], sid_ren[pi], cid_ren[pi]
            nodes_img = [0] * n
            for k in range(n):
                sid = state[k]
                r = sr.get(sid)
                if r is None:
                    r = sr[sid] = rename_node(sid, p)
                nodes_img[p[k]] = r
            t_nodes = tuple(nodes_img)
            if t_nodes > best_nodes:
                continue
            img = nodes_img + [0] * (len(state) - n)
            for k in range(n, C0):
                img[pos[k]] = state[k]
            for k in range(C0, len(state)):
                cid = state[k]
                if cid:
                    r = cr.get(cid)
                    if r is None:
                        r = cr[cid] = intern_chan(tuple(ls.rename_msg(m, p) for m in chan_objs[cid]))
                    img[pos[k]] = r
            t = tuple(img)
            if t < best:
                best, best_nodes = t, t_nodes
        return best

    def unwind(path: object) -> List[str]:
        out: List[str] = []
        while path is not None:
            (i, code, mid), path = path  # type: ignore[misc]
            out.append(f"request {i}" if code == _REQUEST else f"exit {i}" if code == _EXIT
                       else f"deliver {code}->{i} {ls.msgs[mid]!r}")
        return out[::-1]

    def describe(state: Sequence[int]) -> str:
        return ", ".join(f"{i}:{groups[i]}:{ls.objs[state[i]].state.name}" for i in range(n))

    blake = hashlib.blake2b
    ARR = "I"

    exact: Set[bytes] = set()
    digests = (_DigestSet(digest_slots, width=12, fixed=True) if digest_slots else _DigestSet())

    def add(t: Tuple[int, ...]) -> bool:
        """Record a canonical state; True if it was new."""
        b = array(ARR, t).tobytes()
        if hash_states:
            return digests.add(blake(b, digest_size=16).digest())
        if b in exact:
            return False
        exact.add(b)
        return True

    checked_renames: Set[int] = set()

    def key(t: Tuple[int, ...]) -> Tuple[int, ...]:
        """What the visited set matches: the node part as classes of equal live snapshots (with
        `merge`), then the smallest image under the in-group permutations."""
        if merge:
            if check_merges:
                for i in range(n):
                    if t[i] * ls.stride + t[L0 + i] not in checked_renames:
                        checked_renames.add(t[i] * ls.stride + t[L0 + i])
                        ls.check_rename(t[i], t[L0 + i], perms)
            t = tuple([ls.klass(t[i], t[L0 + i]) for i in range(n)]) + t[n:]
        return canonical(t) if perms else t

    def events(state: Tuple[int, ...]) -> Tuple[List[List[int]], int]:
        """Enabled events per node (_REQUEST, _EXIT, or the sender whose channel head is
        delivered) and their number."""
        ev_of: List[List[int]] = []
        total = 0
        for i in range(n):
            sid = state[i]
            e: List[int] = []
            if idle_of[sid] and state[L0 + i] > 0:
                e.append(_REQUEST)
            elif in_cs_of[sid]:
                e.append(_EXIT)
            for b, k in inbound[i]:
                if state[k]:
                    e.append(b)
            ev_of.append(e)
            total += len(e)
        return ev_of, total

    def head_of(state: Tuple[int, ...], i: int, code: int) -> int:
        if code < 0:
            return -1
        cid = state[slot[(code, i)]]
        hp = pop_memo.get(cid)
        if hp is None:
            q = chan_objs[cid]
            hp = pop_memo[cid] = (q[0], intern_chan(q[1:]))
        return hp[0]

    def step_of(state: Tuple[int, ...], i: int, code: int) -> Tuple[int, Tuple[Tuple[int, int], ...]]:
        return ls.step(i, state[i], KINDS.get(code, "deliver"), head_of(state, i, code))

    def touch(state: Tuple[int, ...]) -> None:
        """`check_merges`: a merged state's steps are computed too, so that every step of every
        reached state goes through the class check (not only those of the explored member)."""
        ev_of, _ = events(state)
        for i in range(n):
            for code in ev_of[i]:
                step_of(state, i, code)

    KINDS = {_REQUEST: "request", _EXIT: "exit"}
    start_state = tuple(ls.initial) + budgets + (0,) * nch
    add(key(start_state))
    stack: List[Tuple[Any, ...]] = [(start_state, None)]
    res.states = 1
    next_report = progress_every
    if saved is not None:  # the DFS goes on exactly where the checkpoint left it
        stack, res, exact, digests = saved["stack"], saved["res"], saved["exact"], saved["digests"]
        next_report = res.states + progress_every
    next_checkpoint = res.states + checkpoint_every
    gen = saved["gen"] if saved else 0

    def save() -> None:
        nonlocal gen
        gen += 1
        ls.progress_of = None  # a lambda: not picklable, and given again on resume
        try:
            _save_checkpoint(checkpoint, run_id, gen, {"ls": ls, "chan_objs": chan_objs, "stack": stack,
                                                       "res": res, "exact": exact}, digests)
        finally:
            ls.progress_of = progress_of

    while stack:
        state, path = stack.pop()
        ev_of, total = events(state)
        if total == 0:
            res.schedules += 1
            if any(state[L0:C0]) or not all(idle_of[state[i]] for i in range(n)):
                res.deadlocks += 1
                res.first_failure = f"deadlock or unserved request: {describe(state)}"
                res.trace = unwind(path)
                return res
            continue

        chosen: Optional[List[int]] = None  # nodes whose enabled events form T
        try:
            if reduction:
                cands: List[Tuple[int, List[int]]] = []
                seen_sets: Set[int] = set()
                for i in range(n):
                    if not ev_of[i]:
                        continue
                    mask, work = 1 << i, [i]
                    while work:
                        j = work.pop()
                        for b, k in inbound[j]:
                            if not (mask >> b) & 1 and not state[k]:
                                mask |= 1 << b
                                work.append(b)
                    if mask in seen_sets:
                        continue
                    seen_sets.add(mask)
                    members = [j for j in range(n) if (mask >> j) & 1]
                    size = sum(len(ev_of[j]) for j in members)
                    if size < total:
                        cands.append((size, members))
                cands.sort()
                for _, members in cands:
                    ok = True
                    for j in members:
                        if in_cs_of[state[j]]:
                            ok = False  # exit() is visible
                            break
                        for code in ev_of[j]:
                            if in_cs_of[step_of(state, j, code)[0]]:
                                ok = False  # this step enters the CS: visible
                                break
                        if not ok:
                            break
                    if ok:
                        chosen = members
                        break
                if chosen is None:
                    res.full_expansions += 1
            movers = chosen if chosen is not None else range(n)
            if chosen is not None:
                # the steps left out are computed too (memoized, cheap): their acyclicity and
                # communication-graph checks run, and a step that raises is a reachable error
                for i in range(n):
                    if i not in chosen:
                        for code in ev_of[i]:
                            step_of(state, i, code)
            for i in movers:
                for code in ev_of[i]:
                    res.transitions += 1
                    mid = head_of(state, i, code)
                    nsid, sends = ls.step(i, state[i], KINDS.get(code, "deliver"), mid)
                    nxt = list(state)
                    nxt[i] = nsid
                    if code == _REQUEST:
                        nxt[L0 + i] -= 1
                    elif code >= 0:
                        k = slot[(code, i)]
                        nxt[k] = pop_memo[nxt[k]][1]
                    for to, m in sends:
                        k = out_slot[i][to]
                        c = nxt[k]
                        c2 = push_memo.get((c, m))
                        if c2 is None:
                            c2 = push_memo[(c, m)] = intern_chan(chan_objs[c] + (m,))
                        nxt[k] = c2
                    if in_cs_of[nsid] and len({groups[j] for j in range(n) if in_cs_of[nxt[j]]}) > 1:
                        res.safety_violations += 1
                        res.first_failure = f"two groups in the CS: {describe(nxt)}"
                        res.trace = unwind(((i, code, mid), path))
                        return res
                    t = tuple(nxt)
                    if not add(key(t)):
                        if check_merges:
                            touch(t)
                        continue
                    res.states += 1
                    if res.states > max_states:
                        raise RuntimeError(f"state space larger than {max_states} states")
                    stack.append((t, ((i, code, mid), path)))
        except _CoreError as err:  # a core raising is a failure of the algorithm, not of us
            exc = err.__cause__
            res.protocol_errors += 1
            res.first_failure = f"{type(exc).__name__}: {exc}"
            res.trace = unwind(path)
            return res
        if progress is not None and res.states >= next_report:
            next_report += progress_every
            res.local_states = len(ls.objs)
            progress(res)
        if checkpoint and res.states >= next_checkpoint:
            next_checkpoint = res.states + checkpoint_every
            save()
    if hash_states:
        res.collision_bound = res.states * res.states / 2.0 ** (8 * digests.width)
    res.local_states = len(ls.objs)
    return res


def random_schedule(
    algorithm: str,
    sizes: Sequence[int],
    requests: int,
    rng: random.Random,
    fault: Optional[str] = None,
    max_steps: int = 200_000,
) -> CheckResult:
    """One random complete run: at each step one enabled event, chosen uniformly.

    Speed matters here (the test suite runs 10,000 of these per algorithm), so the driver keeps
    the enabled events incrementally instead of recomputing them per step: `actors` holds the
    nodes with a local step (idle with requests left, or in the CS) and `busy` the non-empty
    channels, both as lists with swap-remove. The choice is uniform over actors + busy channels,
    exactly as before; only the bookkeeping changed.
    """
    res = CheckResult(schedules=1)
    nodes = make_nodes(algorithm, sizes, fault)
    n = len(nodes)
    left = [requests] * n
    groups = [x.group for x in nodes]
    chans: List[Deque[object]] = [deque() for _ in range(n * n)]  # channel src->dst at src*n+dst
    busy: List[int] = []  # non-empty channels (unordered, swap-remove)
    busy_pos: List[int] = [-1] * (n * n)
    actors: List[int] = list(range(n)) if requests > 0 else []
    actor_pos: Dict[int, int] = {i: i for i in actors}
    in_cs = [False] * n
    in_cs_groups: Dict[object, int] = {}
    served = [0] * n
    messages = 0
    violation = False
    IN_CS = GmeState.IN_CS

    def add_actor(i: int) -> None:
        actor_pos[i] = len(actors)
        actors.append(i)

    def del_actor(i: int) -> None:
        pos = actor_pos.pop(i)
        last = actors.pop()
        if last != i:
            actors[pos] = last
            actor_pos[last] = pos

    def push(src: int, outs: List[object]) -> None:
        nonlocal messages, violation
        for o in outs:
            if type(o) is Send:
                key = src * n + o[0]  # type: ignore[index]
                q = chans[key]
                if not q:
                    busy_pos[key] = len(busy)
                    busy.append(key)
                q.append(o[1])  # type: ignore[index]
                messages += 1
            elif isinstance(o, Entered):
                served[src] += 1
                in_cs[src] = True
                add_actor(src)
                g = groups[src]
                in_cs_groups[g] = in_cs_groups.get(g, 0) + 1
                if len(in_cs_groups) > 1:
                    violation = True

    rand = rng.random
    for _ in range(max_steps):
        na = len(actors)
        total = na + len(busy)
        if total == 0:
            break
        pick = int(rand() * total)
        try:
            if pick < na:
                i = actors[pick]
                node = nodes[i]
                del_actor(i)
                if in_cs[i]:
                    in_cs[i] = False
                    g = groups[i]
                    in_cs_groups[g] -= 1
                    if not in_cs_groups[g]:
                        del in_cs_groups[g]
                    outs = node.exit()
                    if left[i] > 0:
                        add_actor(i)
                    push(i, outs)
                else:
                    left[i] -= 1
                    push(i, node.request())
            else:
                key = busy[pick - na]
                q = chans[key]
                msg = q.popleft()
                if not q:
                    pos = busy_pos[key]
                    last = busy.pop()
                    if last != key:
                        busy[pos] = last
                        busy_pos[last] = pos
                dst = key % n
                push(dst, nodes[dst].receive(msg))  # type: ignore[arg-type]
        except Exception as exc:
            res.messages = messages
            res.protocol_errors += 1
            res.first_failure = f"{type(exc).__name__}: {exc}"
            return res
        if violation:
            res.messages = messages
            res.safety_violations += 1
            res.first_failure = "two groups in the CS: " + ", ".join(
                f"{x.id}:{x.group}:{x.state.name}" for x in nodes
            )
            return res
    else:
        res.messages = messages
        res.first_failure = f"no terminal state after {max_steps} steps (livelock?)"
        res.deadlocks += 1
        return res
    res.messages = messages
    if any(l for l in left) or any(x.state is not GmeState.IDLE for x in nodes) or served != [
        requests
    ] * n or any(x.state is IN_CS for x in nodes):
        res.deadlocks += 1
        res.first_failure = "deadlock or unserved request: " + ", ".join(
            f"{x.id}:{x.group}:{x.state.name}:served={s}" for x, s in zip(nodes, served)
        )
    return res


def random_check(
    algorithm: str,
    sizes: Sequence[int] = (6, 6),
    requests: int = 2,
    schedules: int = 10_000,
    seed: int = 0,
    fault: Optional[str] = None,
    stop_on_failure: bool = True,
) -> CheckResult:
    """`schedules` independent random runs from one seed (repeatable)."""
    rng = random.Random(seed)
    total = CheckResult()
    for _ in range(schedules):
        r = random_schedule(algorithm, sizes, requests, rng, fault)
        total.schedules += 1
        total.messages += r.messages
        total.safety_violations += r.safety_violations
        total.deadlocks += r.deadlocks
        total.protocol_errors += r.protocol_errors
        if not r.ok and total.first_failure is None:
            total.first_failure = r.first_failure
            if stop_on_failure:
                break
    return total
