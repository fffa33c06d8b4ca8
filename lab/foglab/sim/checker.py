"""Interleaving checker for the scaling protocol: exhaustive (small systems) or randomized.

A *system* is a pipeline of `ScalingCore`s plus one FIFO channel per ordered pair of instances.
From a system the checker may (a) deliver the head message of any non-empty channel (any message
of a channel declared non-FIFO), or (b) start one of the planned scaling rounds. Exploring every
sequence of such steps covers every asynchronous execution with FIFO channels, including the
cases of thesis 3.3.4 (a round starting before or after a neighbour's message is processed).

Checked in every reachable state (safety):
- no instance whose data path forwards records has a terminated instance among its successors
  (records it forwards would be lost: docs/design.md invariant 4, paper's "no outdated connection");
- no message is delivered to a terminated instance, and no core raises a protocol error;
- every stage keeps at least one live instance.
Checked in every terminal state (quiescence, liveness):
- every started round completed (no instance is still waiting for acks, no created instance
  is still idle: all Starts arrived);
- every live instance's succs/preds equal the true sets of live instances of the next/previous
  stage (consistent views).

The checker drives the cores only through `handle`/`start_round`, so a different core class
(a lock-guarded wrapper, or a deliberately broken subclass in tests) can be plugged in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, Type

from agent.policy.decentralized import Action, Decision, ScalingParams
from agent.protocol.errors import ProtocolError
from agent.protocol.messages import Message
from agent.protocol.scaling import (
    CreateInstance,
    DeletionMode,
    InstanceState,
    Output,
    ScalingCore,
    Send,
)

__all__ = ["Plan", "System", "Violation", "Report", "explore", "random_runs", "build_pipeline"]

Channel = Tuple[str, str]


@dataclass(frozen=True)
class Plan:
    """A scaling round the checker may start on `instance` at any point of the execution."""

    instance: str
    action: Action
    count: int = 1

    def decision(self) -> Decision:
        return Decision(self.action, self.count if self.action is Action.DUPLICATE else 1)


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str
    trace: Tuple[str, ...]


@dataclass
class Report:
    states: int = 0
    terminal_states: int = 0
    schedules: int = 0
    rounds_started: int = 0
    rounds_completed: int = 0
    violations: List[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


class System:
    """Cores + channels; copy-on-write so that exploring a branch copies only what changes."""

    __slots__ = ("cores", "channels", "plans", "stages", "core_cls", "params", "started", "done",
                 "keys", "touched", "dirty", "cow")

    def __init__(self, cores: Dict[str, ScalingCore], plans: FrozenSet[Plan], stages: int,
                 core_cls: Type[ScalingCore], params: ScalingParams) -> None:
        self.cores = cores
        self.channels: Dict[Channel, Tuple[Message, ...]] = {}
        self.plans = plans
        self.stages = stages
        self.core_cls = core_cls
        self.params = params
        self.started = 0
        self.done = 0
        self.keys: Dict[str, Any] = {i: c.key() for i, c in cores.items()}
        self.touched: List[str] = []  # cores changed by the last move (incremental safety)
        self.dirty: Set[str] = set()  # cores changed since the last key() (incremental hashing)
        self.cow = True  # copy a core before changing it (False: a single run, mutate in place)

    def copy(self) -> "System":
        new = object.__new__(System)
        new.cores = dict(self.cores)
        new.channels = dict(self.channels)
        new.plans = self.plans
        new.stages = self.stages
        new.core_cls = self.core_cls
        new.params = self.params
        new.started = self.started
        new.done = self.done
        new.keys = dict(self.keys)
        new.touched = []
        new.dirty = set(self.dirty)
        new.cow = True
        return new

    def key(self) -> Any:
        for iid in self.dirty:
            self.keys[iid] = self.cores[iid].key()
        self.dirty = set()
        return (
            frozenset(self.keys.values()),
            frozenset(kv for kv in self.channels.items() if kv[1]),
            self.plans,
        )

    # ---- moves --------------------------------------------------------------------------------

    def moves(self, non_fifo: FrozenSet[Channel]) -> List[Tuple[Any, ...]]:
        out: List[Tuple[Any, ...]] = []
        for ch in sorted(self.channels):
            q = self.channels[ch]
            if not q:
                continue
            if ch in non_fifo:
                out.extend(("deliver", ch, i) for i in range(len(q)))
            else:
                out.append(("deliver", ch, 0))
        for plan in sorted(self.plans, key=lambda p: (p.instance, p.action.value, p.count)):
            core = self.cores.get(plan.instance)
            if core is not None and core.state is InstanceState.ACTIVE:
                out.append(("start", plan))
        return out

    def apply(self, move: Tuple[Any, ...]) -> Optional[Tuple[str, str]]:
        """Perform one move in place (on a copy); return a (kind, detail) violation or None."""
        self.touched = []
        if move[0] == "start":
            plan: Plan = move[1]
            self.plans = self.plans - {plan}
            core = self._own(plan.instance)
            try:
                outs = core.start_round(plan.decision())
            except ProtocolError as exc:
                return ("protocol_error", str(exc))
            self.started += 1
            return self._perform(core, outs)
        _, ch, index = move
        q = self.channels[ch]
        msg = q[index]
        self.channels[ch] = q[:index] + q[index + 1:]
        core = self.cores.get(ch[1])
        if core is None:
            return ("unknown_destination", f"{msg.type} from {ch[0]} to unknown {ch[1]}")
        if core.terminated:
            return ("message_to_terminated", f"{msg.type} from {ch[0]} to terminated {ch[1]}")
        core = self._own(ch[1])
        was_in_round = core.in_round
        try:
            outs = core.handle(msg)
        except ProtocolError as exc:
            return ("protocol_error", f"{type(exc).__name__}: {exc}")
        if was_in_round and not core.in_round:
            self.done += 1
        return self._perform(core, outs)

    def _own(self, iid: str) -> ScalingCore:
        core = self.cores[iid]
        if self.cow:
            core = core.clone()
            self.cores[iid] = core
        self.touched.append(iid)
        self.dirty.add(iid)
        return core

    def _perform(self, core: ScalingCore, outs: Sequence[Output]) -> Optional[Tuple[str, str]]:
        for o in outs:
            if isinstance(o, Send):
                ch = (core.instance_id, o.dest)
                self.channels[ch] = self.channels.get(ch, ()) + (o.message,)
            elif isinstance(o, CreateInstance):
                if o.instance_id in self.cores:
                    return ("id_collision", o.instance_id)
                self.cores[o.instance_id] = self.core_cls.from_create(
                    o, self.params, deletion_mode=core.deletion_mode)
                self.touched.append(o.instance_id)
                self.dirty.add(o.instance_id)
        return None

    # ---- invariants ---------------------------------------------------------------------------

    def safety(self) -> Optional[Tuple[str, str]]:
        """Check the invariants that the last move can have broken (incremental)."""
        for iid in self.touched:
            c = self.cores[iid]
            if c.terminated:
                if not any(o.stage == c.stage and not o.terminated for o in self.cores.values()):
                    return ("operator_lost", f"stage {c.stage} has no live instance")
                for o in self.cores.values():
                    if o.forwards_data and iid in o.succs:
                        return ("stale_route", f"{o.instance_id} ({o.state.value}) routes to "
                                f"terminated {iid}")
            elif c.forwards_data:
                for sid in c.succs:
                    t = self.cores.get(sid)
                    if t is None or t.terminated:
                        return ("stale_route", f"{iid} ({c.state.value}) routes to "
                                f"{'terminated' if t else 'unknown'} {sid}")
        return None

    def full_safety(self) -> Optional[Tuple[str, str]]:
        live_per_stage = [0] * self.stages
        for c in self.cores.values():
            if not c.terminated:
                live_per_stage[c.stage] += 1
            if c.forwards_data:
                for s in c.succs:
                    t = self.cores.get(s)
                    if t is None or t.terminated:
                        return ("stale_route", f"{c.instance_id} ({c.state.value}) routes to "
                                f"{'terminated' if t else 'unknown'} {s}")
        for stage, n in enumerate(live_per_stage):
            if n == 0:
                return ("operator_lost", f"stage {stage} has no live instance")
        return None

    def quiescence(self) -> Optional[Tuple[str, str]]:
        live: List[Set[str]] = [set() for _ in range(self.stages)]
        for c in self.cores.values():
            if c.terminated:
                continue
            if c.state is not InstanceState.ACTIVE:
                return ("round_not_completed", f"{c.instance_id} still {c.state.value} "
                        f"(pending acks from {sorted(c.pending)})")
            live[c.stage].add(c.instance_id)
        for c in self.cores.values():
            if c.terminated:
                continue
            want_s = live[c.stage + 1] if c.stage + 1 < self.stages else set()
            want_p = live[c.stage - 1] if c.stage > 0 else set()
            if c.succs != want_s or c.preds != want_p:
                return ("inconsistent_view", f"{c.instance_id}: succs {sorted(c.succs)} preds "
                        f"{sorted(c.preds)}, true {sorted(want_s)} / {sorted(want_p)}")
        return None


def build_pipeline(
    sizes: Sequence[int],
    plans: Sequence[Plan] = (),
    *,
    params: Optional[ScalingParams] = None,
    core_cls: Type[ScalingCore] = ScalingCore,
    deletion_mode: DeletionMode = DeletionMode.TWO_PHASE,
) -> System:
    """Instances `s{stage}i{k}`; instance k = 0 of each stage is the keeper; complete bipartite links."""
    params = params or ScalingParams()
    ids = [[f"s{s}i{k}" for k in range(n)] for s, n in enumerate(sizes)]
    cores: Dict[str, ScalingCore] = {}
    for s, row in enumerate(ids):
        for k, iid in enumerate(row):
            cores[iid] = core_cls.initial(
                iid, f"op{s}", s, params,
                succs=ids[s + 1] if s + 1 < len(ids) else (),
                preds=ids[s - 1] if s > 0 else (),
                keeper=(k == 0), deletion_mode=deletion_mode,
            )
    return System(cores, frozenset(plans), len(sizes), core_cls, params)


def _describe(move: Tuple[Any, ...], system: System) -> str:
    if move[0] == "start":
        p: Plan = move[1]
        return f"start {p.action.value} on {p.instance}"
    _, ch, i = move
    m = system.channels[ch][i]
    return f"deliver {m.type} {ch[0]}->{ch[1]}" + (f" (out of order #{i})" if i else "")


def _render(trace: Any) -> Tuple[str, ...]:
    """A trace is a linked list (move, system before the move, previous trace)."""
    labels: List[str] = []
    while trace is not None:
        move, before, trace = trace
        labels.append(_describe(move, before))
    return tuple(reversed(labels))


def explore(
    system: System,
    *,
    non_fifo: Sequence[Channel] = (),
    max_states: int = 2_000_000,
    stop_at_first: bool = True,
) -> Report:
    """Depth-first search over every FIFO-respecting schedule, states deduplicated."""
    nf = frozenset(non_fifo)
    report = Report()
    seen: Set[Any] = set()
    stack: List[Tuple[System, Any]] = [(system, None)]
    while stack:
        sysm, trace = stack.pop()
        k = sysm.key()
        if k in seen:
            continue
        seen.add(k)
        report.states += 1
        if report.states > max_states:
            raise RuntimeError(f"state space larger than {max_states} states")
        moves = sysm.moves(nf)
        if not moves:
            report.terminal_states += 1
            report.rounds_started = max(report.rounds_started, sysm.started)
            bad = sysm.quiescence()
            if bad:
                report.violations.append(Violation(bad[0], bad[1], _render(trace)))
                if stop_at_first:
                    return report
            continue
        for move in reversed(moves):
            nxt = sysm.copy()
            bad = nxt.apply(move) or nxt.safety()
            if bad:
                report.violations.append(Violation(bad[0], bad[1], _render((move, sysm, trace))))
                if stop_at_first:
                    return report
                continue
            if nxt.key() in seen:
                continue
            stack.append((nxt, (move, sysm, trace)))
    return report


def random_runs(
    make_system: Callable[[random.Random], System],
    *,
    schedules: int,
    seed: int = 0,
    non_fifo: Sequence[Channel] = (),
    extra_rounds: int = 0,
    max_steps: int = 100_000,
    stop_at_first: bool = True,
) -> Report:
    """`schedules` random executions; each may also start `extra_rounds` rounds at random times
    on random active instances (including instances created during the run)."""
    rng = random.Random(seed)
    nf = frozenset(non_fifo)
    report = Report()
    for _ in range(schedules):
        sysm = make_system(rng)
        sysm.cow = False
        budget = extra_rounds
        trace: List[str] = []
        for _step in range(max_steps):
            moves = sysm.moves(nf)
            if budget and rng.random() < 0.15:
                active = sorted(i for i, c in sysm.cores.items() if c.state is InstanceState.ACTIVE)
                if active:
                    iid = rng.choice(active)
                    core = sysm.cores[iid]
                    if core.keeper or rng.random() < 0.5:
                        plan = Plan(iid, Action.DUPLICATE, rng.choice((1, 1, 2)))
                    else:
                        plan = Plan(iid, Action.TERMINATE)
                    sysm.plans = sysm.plans | {plan}
                    budget -= 1
                    continue
            if not moves:
                if budget:
                    budget = 0
                    continue
                break
            move = rng.choice(moves)
            label = _describe(move, sysm)
            trace.append(label)
            bad = sysm.apply(move) or sysm.safety()
            report.states += 1
            if bad:
                report.violations.append(Violation(bad[0], bad[1], tuple(trace)))
                break
        else:
            report.violations.append(Violation("no_quiescence", f"{max_steps} steps", tuple(trace)))
        report.schedules += 1
        report.rounds_started += sysm.started
        report.rounds_completed += sysm.done
        if not report.violations:
            bad = sysm.quiescence()
            if bad:
                report.violations.append(Violation(bad[0], bad[1], tuple(trace)))
        if report.violations and stop_at_first:
            break
    return report
