"""Discrete-time simulator of the decentralized scaling protocol (thesis 3.4), seeded.

The simulator drives the real `ScalingCore` (or any class passed as `core_cls`, e.g. a
lock-guarded wrapper) over per-link FIFO channels with per-message delays in steps. Like the
paper's simulator, messages sent at step t are processed at step t + delay (delay >= 1).

Cost model (why it scales): the load of an operator is shared evenly by its active instances
(the paper's assumption), so per step the simulator computes one load per operator; an operator
whose per-instance load ratio lies strictly between `down` and `up` cannot scale and costs
nothing more. Only instances of operators outside that band are asked to decide, and only
instances that start a round (and the neighbours they message) run protocol code. The per-step
cost is therefore O(operators + instances deciding + protocol messages).

Per step it records: active instances, ideal instances (load / (r*C)), accuracy, % of ideal
throughput (processed / offered records), protocol messages sent, and stale routes (an instance
that forwards records holding a terminated instance in its successors: every record it sends
there would be lost). After the last step it stops deciding, lets every round finish, and counts
instances whose routing tables differ from the true neighbour sets.

Per-operator centralized baseline (thesis 3.4.2): every `period` steps the operator's keeper
computes the target ceil(L / (r*C)) when the load ratio leaves [down, up] and orders the needed
duplications / terminations, which run through the same protocol (same message costs).
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple, Type

from agent.policy.decentralized import Action, Decision, ScalingParams
from agent.protocol.errors import ProtocolError
from agent.protocol.messages import Message
from agent.protocol.scaling import (
    Activate,
    CreateInstance,
    InstanceState,
    Output,
    ScalingCore,
    Send,
    Terminate,
)

__all__ = ["SimConfig", "SimResult", "simulate", "LOADS", "BASELINES"]

LOADS = ("brownian", "sinusoidal", "monotonic")
BASELINES = ("decentralized", "centralized")


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    steps: int = 200
    operators: int = 5
    instances: int = 14
    pipelines: int = 1
    capacity: float = 500.0
    target_ratio: float = 0.7
    up: float = 0.8
    down: float = 0.6
    period: int = 5
    delay_min: int = 1
    delay_max: int = 1
    load: str = "brownian"
    volatility: float = 0.08  # Brownian: std-dev of the log-load increment per step
    baseline: str = "decentralized"
    r_secure: bool = False
    max_drain_steps: int = 10_000

    def __post_init__(self) -> None:
        if self.load not in LOADS:
            raise ValueError(f"load: expected one of {LOADS}, found {self.load!r}")
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline: expected one of {BASELINES}, found {self.baseline!r}")
        if not 1 <= self.delay_min <= self.delay_max:
            raise ValueError(f"delays: expected 1 <= min <= max, found {self.delay_min}-{self.delay_max}")
        if self.operators < 1 or self.instances < 1 or self.pipelines < 1 or self.period < 1:
            raise ValueError("operators, instances, pipelines and period must be >= 1")

    def params(self) -> ScalingParams:
        return ScalingParams(self.capacity, self.target_ratio, self.up, self.down, self.r_secure)


@dataclass
class SimResult:
    config: SimConfig
    load: List[float] = field(default_factory=list)
    instances: List[int] = field(default_factory=list)
    ideal: List[float] = field(default_factory=list)
    accuracy: List[float] = field(default_factory=list)
    throughput_pct: List[float] = field(default_factory=list)
    messages: List[int] = field(default_factory=list)
    stale_routes: List[int] = field(default_factory=list)
    op0_load: List[float] = field(default_factory=list)
    op0_instances: List[int] = field(default_factory=list)
    lost_records: float = 0.0
    delayed_records: float = 0.0
    protocol_errors: int = 0
    messages_to_terminated: int = 0
    inconsistent_views: int = 0
    rounds_started: int = 0
    rounds_open_at_end: int = 0
    drain_steps: int = 0
    wall_seconds: float = 0.0

    def summary(self) -> Dict[str, Any]:
        """The `--json` object (deterministic: no wall-clock figures in it)."""
        n = max(1, len(self.accuracy))
        c = self.config
        return {
            "seed": c.seed,
            "steps": c.steps,
            "operators": c.operators,
            "pipelines": c.pipelines,
            "initial_instances": c.operators * c.instances * c.pipelines,
            "baseline": c.baseline,
            "load": c.load,
            "r_secure": c.r_secure,
            "delays": [c.delay_min, c.delay_max],
            "final_instances": self.instances[-1] if self.instances else 0,
            "messages_total": sum(self.messages),
            "rounds_started": self.rounds_started,
            "accuracy_mean": round(sum(self.accuracy) / n, 6),
            "ideal_throughput_pct_mean": round(sum(self.throughput_pct) / n, 6),
            "lost_records": round(self.lost_records, 3),
            "delayed_records": round(self.delayed_records, 3),
            "stale_route_deliveries": sum(self.stale_routes),
            "messages_to_terminated": self.messages_to_terminated,
            "protocol_errors": self.protocol_errors,
            "inconsistent_views_at_quiescence": self.inconsistent_views,
            "rounds_open_at_end": self.rounds_open_at_end,
            "drain_steps": self.drain_steps,
        }


class _Sim:
    def __init__(self, cfg: SimConfig, core_cls: Type[ScalingCore]) -> None:
        self.cfg = cfg
        self.params = cfg.params()
        self.core_cls = core_cls
        self.rng = random.Random(cfg.seed)
        self.cores: Dict[str, ScalingCore] = {}
        self.op_of: Dict[str, int] = {}
        self.phase: Dict[str, int] = {}
        n_ops = cfg.operators * cfg.pipelines
        self.active: List[Dict[str, None]] = [dict() for _ in range(n_ops)]  # ordered sets
        self.queue: Dict[int, List[Tuple[str, str, Message]]] = defaultdict(list)
        self.link_last: Dict[Tuple[str, str], int] = {}
        self.now = 0
        self.sent_this_step = 0
        self.in_flight = 0
        self.res = SimResult(cfg)
        base = cfg.instances * cfg.target_ratio * cfg.capacity
        self.base_load = base
        self.loads = [base] * n_ops
        self.sin_phase = [self.rng.random() * 2 * math.pi for _ in range(n_ops)]
        for p in range(cfg.pipelines):
            ids = [[f"p{p}s{s}i{k}" for k in range(cfg.instances)] for s in range(cfg.operators)]
            for s in range(cfg.operators):
                op = p * cfg.operators + s
                for k, iid in enumerate(ids[s]):
                    core = core_cls.initial(
                        iid, f"p{p}s{s}", s, self.params,
                        succs=ids[s + 1] if s + 1 < cfg.operators else (),
                        preds=ids[s - 1] if s > 0 else (),
                        keeper=(k == 0), emit_routes=False,
                    )
                    self._register(core, op)
                    self.active[op][iid] = None

    def _register(self, core: ScalingCore, op: int) -> None:
        self.cores[core.instance_id] = core
        self.op_of[core.instance_id] = op
        self.phase[core.instance_id] = self.rng.randrange(self.cfg.period)

    # ---- load ---------------------------------------------------------------------------------

    def _update_loads(self, t: int) -> None:
        cfg = self.cfg
        floor = 0.05 * cfg.capacity
        if cfg.load == "brownian":
            g = self.rng.gauss
            self.loads = [max(floor, L * math.exp(cfg.volatility * g(0.0, 1.0))) for L in self.loads]
        elif cfg.load == "sinusoidal":
            self.loads = [self.base_load * (1.0 + 0.6 * math.sin(2 * math.pi * t / 100.0 + ph))
                          for ph in self.sin_phase]
        else:  # monotonic (fig. 3.6): +1% per step, so each step needs new instances in
            # proportion to the current count n, each costing O(n) messages: traffic ~ n^2
            self.loads = [self.base_load * 1.01 ** t] * len(self.loads)

    # ---- messages -----------------------------------------------------------------------------

    def _perform(self, core: ScalingCore, outs: Sequence[Output]) -> None:
        for o in outs:
            if type(o) is Send:
                self._send(core.instance_id, o.dest, o.message)
            elif type(o) is CreateInstance:
                new = self.core_cls.from_create(o, self.params, emit_routes=False)
                self._register(new, self.op_of[core.instance_id])
            elif type(o) is Activate:
                self.active[self.op_of[core.instance_id]][core.instance_id] = None
                self._check_routes(core)
            elif type(o) is Terminate:
                iid = core.instance_id
                op = self.op_of[iid]
                self.active[op].pop(iid, None)
                self._check_terminated(iid, op)

    def _send(self, src: str, dest: str, msg: Message) -> None:
        cfg = self.cfg
        if cfg.delay_min == cfg.delay_max:
            at = self.now + cfg.delay_min  # fixed delay: FIFO per link holds by construction
        else:
            at = self.now + self.rng.randint(cfg.delay_min, cfg.delay_max)
            last = self.link_last.get((src, dest), 0)
            if at < last:
                at = last  # FIFO per link: never overtake an earlier message on the same channel
            self.link_last[(src, dest)] = at
        self.queue[at].append((src, dest, msg))
        self.sent_this_step += 1
        self.in_flight += 1

    def _deliver_due(self) -> None:
        batch = self.queue.pop(self.now, None)
        if not batch:
            return
        for _src, dest, msg in batch:
            self.in_flight -= 1
            core = self.cores.get(dest)
            if core is None or core.terminated:
                self.res.messages_to_terminated += 1
                continue
            try:
                outs = core.handle(msg)
            except ProtocolError:
                self.res.protocol_errors += 1
                continue
            self._perform(core, outs)

    # ---- stale routes (records that would go to a terminated instance) ------------------------

    def _check_routes(self, core: ScalingCore) -> None:
        for s in core.succs:
            t = self.cores.get(s)
            if t is None or t.terminated:
                self._stale += 1

    def _check_terminated(self, iid: str, op: int) -> None:
        if self.cfg.operators == 1 or op % self.cfg.operators == 0:
            return
        for pid in self.active[op - 1]:
            p = self.cores[pid]
            if p.forwards_data and iid in p.succs:
                self._stale += 1
                share = self.loads[op - 1] / max(1, len(self.active[op - 1]))
                self.res.lost_records += share / max(1, len(p.succs))

    # ---- decisions ----------------------------------------------------------------------------

    def _decide_decentralized(self, t: int) -> None:
        cfg = self.cfg
        cap = cfg.capacity
        slot = t % cfg.period
        rnd = self.rng.random
        for op, members in enumerate(self.active):
            n = len(members)
            if n == 0:
                continue
            load = self.loads[op] / n
            ratio = load / cap
            if cfg.down < ratio < cfg.up:
                continue
            for iid in list(members):
                if self.phase[iid] != slot:
                    continue
                core = self.cores[iid]
                if core.state is not InstanceState.ACTIVE:
                    continue
                decision = core.decide(load, rnd())
                if decision.action is not Action.NONE:
                    self.res.rounds_started += 1
                    self._perform(core, core.start_round(decision))

    def _decide_centralized(self, t: int) -> None:
        cfg = self.cfg
        if t % cfg.period:
            return
        for op, members in enumerate(self.active):
            n = len(members)
            if n == 0:
                continue
            L = self.loads[op]
            ratio = L / n / cfg.capacity
            if cfg.down < ratio < cfg.up:
                continue
            target = max(1, math.ceil(L / (cfg.target_ratio * cfg.capacity) - 1e-9))
            free = [self.cores[i] for i in members if self.cores[i].state is InstanceState.ACTIVE]
            k = target - n
            if k > 0 and free:
                doers = free[: min(k, len(free))]
                for j, core in enumerate(doers):
                    count = k // len(doers) + (1 if j < k % len(doers) else 0)
                    self.res.rounds_started += 1
                    self._perform(core, core.start_round(Decision(Action.DUPLICATE, count)))
            elif k < 0:
                for core in [c for c in free if not c.keeper][: -k]:
                    self.res.rounds_started += 1
                    self._perform(core, core.start_round(Decision(Action.TERMINATE, 1)))

    # ---- main loop ----------------------------------------------------------------------------

    def run(self) -> SimResult:
        cfg, res = self.cfg, self.res
        started = time.perf_counter()
        decide = self._decide_centralized if cfg.baseline == "centralized" else self._decide_decentralized
        rC = cfg.target_ratio * cfg.capacity
        for t in range(cfg.steps):
            self.now = t
            self.sent_this_step = 0
            self._stale = 0
            self._update_loads(t)
            self._deliver_due()
            decide(t)
            total_load = sum(self.loads)
            n_total = 0
            processed = 0.0
            for op, members in enumerate(self.active):
                n = len(members)
                n_total += n
                processed += min(self.loads[op], n * cfg.capacity)
            ideal = total_load / rC
            res.load.append(round(total_load, 6))
            res.instances.append(n_total)
            res.ideal.append(round(ideal, 6))
            res.accuracy.append(n_total / ideal if ideal else 1.0)
            res.throughput_pct.append(100.0 * processed / total_load if total_load else 100.0)
            res.delayed_records += total_load - processed
            res.messages.append(self.sent_this_step)
            res.stale_routes.append(self._stale)
            res.op0_load.append(round(self.loads[0], 6))
            res.op0_instances.append(len(self.active[0]))
        # quiescence: no more decisions, let every round finish
        t = cfg.steps
        while self.in_flight and t < cfg.steps + cfg.max_drain_steps:
            self.now = t
            self._stale = 0
            self._deliver_due()
            t += 1
        res.drain_steps = t - cfg.steps
        res.rounds_open_at_end = sum(1 for c in self.cores.values() if c.in_round or c.state is InstanceState.IDLE)
        res.inconsistent_views = self._inconsistent_views()
        res.wall_seconds = time.perf_counter() - started
        return res

    def _inconsistent_views(self) -> int:
        cfg = self.cfg
        live = [set(m) for m in self.active]
        bad = 0
        for op, members in enumerate(self.active):
            s = op % cfg.operators
            want_s = live[op + 1] if s + 1 < cfg.operators else set()
            want_p = live[op - 1] if s > 0 else set()
            for iid in members:
                c = self.cores[iid]
                if c.succs != want_s or c.preds != want_p:
                    bad += 1
        return bad


def simulate(cfg: SimConfig, core_cls: Type[ScalingCore] = ScalingCore) -> SimResult:
    """Run one seeded simulation. `core_cls` is the injection point for wrapper cores."""
    return _Sim(cfg, core_cls).run()
