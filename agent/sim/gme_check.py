"""Model checker for the GME cores: every delivery order for small systems, random ones for big.

Why: a GME algorithm fails on rare interleavings, never on the happy path. The checker drives the
same core classes as the simulator and the MQTT benchmark, over FIFO channels (one queue per
ordered pair of nodes, as the thesis's system model and DESIGN.md invariant 1 require), and
explores which enabled step happens next:

- a node that is idle and has requests left calls `request()`,
- a node in the CS calls `exit()`,
- the oldest message of a non-empty channel is delivered.

Properties checked:
- safety (every reached state): no two nodes of different groups are in the CS together;
- liveness (every terminal state, i.e. nothing enabled): every node made all its requests and
  entered the CS for each of them; a terminal state with a node still requesting is a deadlock.
Since every run is finite (each node makes a bounded number of requests and each handler emits a
bounded number of messages), "every terminal state is good" means every request is eventually
served under every fair schedule.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from agent.protocol.gme_base import Entered, GmeNode, GmeState, NodeId, Send, two_groups

__all__ = [
    "ALGORITHMS",
    "make_nodes",
    "CheckResult",
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


class _LocalStates:
    """Interned local states and a memo of their transitions (the exhaustive search's engine).

    A node is deterministic: the same local state and the same input always give the same next
    state and outputs. A global state is a combination of a few thousand distinct local states,
    so the search runs each (local state, input) through the real core once, and afterwards only
    looks the answer up. Local states and messages are interned to small ints, so a global state
    key is a tuple of ints hashed at C speed, and nothing is copied or re-hashed per step.
    """

    def __init__(self, nodes: Sequence[GmeNode]) -> None:
        self.objs: List[GmeNode] = []
        self.ids: Dict[Tuple[int, object], int] = {}
        self.in_cs: List[bool] = []
        self.idle: List[bool] = []
        self.msgs: List[object] = []
        self.msg_ids: Dict[object, int] = {}
        self.memo: Dict[Tuple[int, str, int], Tuple[int, Tuple[Tuple[int, int], ...]]] = {}
        self.renames: Dict[Tuple[int, Tuple[int, ...]], int] = {}
        self.renames_msg: Dict[Tuple[int, Tuple[int, ...]], int] = {}
        self.initial = tuple(self.intern(i, x) for i, x in enumerate(nodes))

    def intern(self, index: int, node: GmeNode) -> int:
        key = (index, node.snapshot())
        sid = self.ids.get(key)
        if sid is None:
            sid = self.ids[key] = len(self.objs)
            self.objs.append(node)
            self.in_cs.append(node.state is GmeState.IN_CS)
            self.idle.append(node.state is GmeState.IDLE)
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

    def step(self, index: int, sid: int, kind: str, mid: int) -> Tuple[int, Tuple[Tuple[int, int], ...]]:
        """(next local state, ((to, message id), ...)); raises what the core raises."""
        key = (sid, kind, mid)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        x = _clone_node(self.objs[sid])
        if kind == "request":
            outs = x.request()
        elif kind == "exit":
            outs = x.exit()
        else:
            outs = x.receive(self.msgs[mid])  # type: ignore[arg-type]
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
        self.memo[key] = res
        return res


def exhaustive_check(
    algorithm: str,
    sizes: Sequence[int] = (2, 2),
    requests: int = 2,
    fault: Optional[str] = None,
    max_states: int = 5_000_000,
    symmetry: bool = False,
) -> CheckResult:
    """Explore every delivery order (DFS over distinct states). Stops at the first violation.

    Partial-order reduction, and why it is sound: events at different nodes commute (a step
    reads one node's state and the head of one of its input channels, writes that node's state
    and appends to its output channels). So instead of interleaving all nodes, only the
    lowest-numbered *active* node moves, choosing any of its enabled steps, or choosing to *wait*:
    it becomes passive until a new message reaches it. Every consistent cut of every execution is
    reached this way (each node follows its own history and waits whenever its next step is the
    delivery of a message not yet sent, or whenever it wants to let others overtake it, e.g. a
    node that stays in the CS). Safety is checked on every reached state, hence on every cut, and
    liveness on every state where no step at all is enabled.

    States are matched exactly (same node states, channels, budgets AND waiting set). Skipping a
    state already visited with a smaller waiting set looks sound but is not with DFS caching (it
    missed the fault injected in `test_exhaustive_checker_catches_the_fault_too`), so we do not.

    Speed: local states and messages are interned and transitions memoized (`_LocalStates`);
    a global state is (local state ids, budgets, channel contents as message ids, waiting mask).

    Symmetry (`symmetry=True`, cores with a `renamed(perm)` method: 2-FGME): nodes of one group
    are interchangeable. Groups hold consecutive ids, so a permutation inside each group keeps
    every cross-group priority comparison (the only ones 2-FGME makes) and the group of every
    node: it maps executions to executions and preserves both properties. A state is matched by
    the smallest key over these permutations (node positions, ids inside node states, message
    senders, channel ends and the waiting set all renamed); the state itself is explored as is.
    The waiting-set semantics ("does not move before a new message arrives") does not depend
    on the numbering, so the reduction composes with the partial-order reduction; the injected
    fault is still found with it (tests).
    """
    res = CheckResult()
    nodes0 = make_nodes(algorithm, sizes, fault)
    n = len(nodes0)
    groups = [x.group for x in nodes0]
    ls = _LocalStates(nodes0)
    in_cs_of, idle_of = ls.in_cs, ls.idle
    Chans = Dict[Tuple[int, int], Tuple[int, ...]]
    # stack items: (local state ids, left, chans, waiting mask, path as a linked list)
    start: Tuple[Any, ...] = (ls.initial, (requests,) * n, {}, 0, None)
    visited: Set[Tuple[object, ...]] = set()
    stack: List[Tuple[Any, ...]] = [start]
    inbound = [[(a, i) for a in range(n) if a != i] for i in range(n)]

    def unwind(path: object) -> List[str]:
        out: List[str] = []
        while path is not None:
            ev, path = path  # type: ignore[misc]
            out.append(ev if isinstance(ev, str) else repr(ev))
        return out[::-1]

    def describe(sids: Sequence[int]) -> str:
        return ", ".join(
            f"{i}:{groups[i]}:{ls.objs[sid].state.name}" for i, sid in enumerate(sids)
        )

    perms: List[Tuple[int, ...]] = []
    if symmetry and hasattr(nodes0[0], "renamed"):
        blocks: List[List[int]] = []
        for i, g in enumerate(groups):
            if blocks and groups[blocks[-1][0]] == g:
                blocks[-1].append(i)
            else:
                blocks.append([i])
        for choice in itertools.product(*(itertools.permutations(b) for b in blocks)):
            p = tuple(x for part in choice for x in part)
            perm = [0] * n
            for b, part in zip(blocks, choice):
                for src, dst in zip(b, part):
                    perm[src] = dst
            if tuple(perm) != tuple(range(n)):
                perms.append(tuple(perm))

    def canonical(sids: Tuple[int, ...], left: Tuple[int, ...], waiting: int, chans: Chans) -> Any:
        best = (sids, left, waiting, tuple(sorted(chans.items())))
        for p in perms:
            ns = [0] * n
            nl = [0] * n
            w = 0
            for i in range(n):
                ns[p[i]] = ls.rename(sids[i], p)
                nl[p[i]] = left[i]
                if (waiting >> i) & 1:
                    w |= 1 << p[i]
            ch = tuple(sorted(
                ((p[a], p[b]), tuple(ls.rename_msg(m, p) for m in q)) for (a, b), q in chans.items()
            ))
            k = (tuple(ns), tuple(nl), w, ch)
            if k < best:
                best = k
        return best

    while stack:
        sids, left, chans, waiting, path = stack.pop()
        key = canonical(sids, left, waiting, chans) if perms else (
            sids, left, waiting, tuple(sorted(chans.items())))
        if key in visited:
            continue
        visited.add(key)
        res.states += 1
        if res.states > max_states:
            raise RuntimeError(f"state space larger than {max_states} states")
        mover = -1
        any_event = False
        mine: List[Tuple[str, int, int]] = []
        for i in range(n):
            sid = sids[i]
            ev: List[Tuple[str, int, int]] = []
            if idle_of[sid] and left[i] > 0:
                ev.append(("request", i, -1))
            elif in_cs_of[sid]:
                ev.append(("exit", i, -1))
            for c in inbound[i]:
                if c in chans:
                    ev.append(("deliver", c[0], i))
            if ev:
                any_event = True
                if not (waiting >> i) & 1:
                    mover, mine = i, ev
                    break
        if not any_event:
            res.schedules += 1
            if any(left) or not all(idle_of[sid] for sid in sids):
                res.deadlocks += 1
                res.first_failure = f"deadlock or unserved request: {describe(sids)}"
                res.trace = unwind(path)
                return res
            continue
        if mover < 0:
            continue  # every node with a step chose to wait: this branch adds nothing
        stack.append((sids, left, chans, waiting | (1 << mover), ("wait %d" % mover, path)))
        for ev in mine:
            kind, a, b = ev
            nchans: Chans = dict(chans)
            nleft = left
            mid = -1
            if kind == "request":
                nl = list(left)
                nl[mover] -= 1
                nleft = tuple(nl)
            elif kind == "deliver":
                q = nchans[(a, b)]
                if len(q) == 1:
                    del nchans[(a, b)]
                else:
                    nchans[(a, b)] = q[1:]
                mid = q[0]
            try:
                nsid, sends = ls.step(mover, sids[mover], kind, mid)
            except Exception as exc:  # a core raising is a failure of the algorithm, not of us
                res.protocol_errors += 1
                res.first_failure = f"{type(exc).__name__}: {exc}"
                res.trace = unwind((ev, path))
                return res
            nwait = waiting
            for to, m in sends:
                k2 = (mover, to)
                nchans[k2] = nchans.get(k2, ()) + (m,)
                nwait &= ~(1 << to)  # a new message wakes its receiver
            nsids = sids[:mover] + (nsid,) + sids[mover + 1:]
            if in_cs_of[nsid]:
                in_cs = {groups[i] for i in range(n) if in_cs_of[nsids[i]]}
                if len(in_cs) > 1:
                    res.safety_violations += 1
                    res.first_failure = f"two groups in the CS: {describe(nsids)}"
                    res.trace = unwind((ev, path))
                    return res
            stack.append((nsids, nleft, nchans, nwait, (ev, path)))
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
