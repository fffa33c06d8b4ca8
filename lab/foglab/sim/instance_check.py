"""Interleaving checker for whole instances: `Instance`s (agent.instance.core) over a broker model.

Where foglab.sim.checker drives the scaling cores alone, this drives the instances the worker
process runs: channels, flow control and acks, the replay buffer, write-ahead outputs, round
memory, resend on silence, drain, and the scaling core inside. Each instance gets in-memory
operators (a source of `records` records, an identity map, a sink with a durable id store, as
the real counting sink keeps its ids on disk).

Broker model (MQTT 3.1.1 / Mosquitto with persistent sessions, QoS 1):
- one FIFO queue per (publisher, destination inbox): QoS 1 keeps a publisher's order per topic;
- a publish the client accepted reaches the broker (PUBACK at once: the client's own in-flight
  loss is the crash fault below); the broker keeps an inbox's queue while its instance is down
  (persistent session) and delivers it after the restart;
- `dup`: the head of a queue is delivered twice (a QoS 1 re-send whose PUBACK was lost).
Faults, each a move with a budget: `crash` (the instance loses its memory, including what it
took from the broker but had not processed, and restarts from its last `Persist`), `rehome` (the
same, but its state is gone with its node: restart from nothing above a new epoch floor, active
(idle, a copy that was idle), with tables rebuilt from the hosted instances, as agent.node.rehome
plans it; op-0 or its copy),
`refuse` (the instance's next publish is refused by its client), `broker` (the broker restarts:
sessions and queues kept, the last delivery of each queue possibly repeated; or no session left,
every queue gone and every client told `SessionLost`; or sessions kept but every queued message
gone, a SIGKILL between autosaves), `cut` (a node cannot reach the broker for up to
`cut_seconds`: nothing is delivered to its instances, what they publish waits in their clients
and goes out, PUBACKed, at the heal; their timers run on), `refuse_spawn` (the agent answers a
createNode() with an error: the copy never exists).

A move is one event plus the Tick the worker loop performs after it; `time` advances the clock
by `STEP` and ticks every live instance. The pipeline is source -> op -> sink, and the op goes
1 -> 2 -> 1: a forced duplication of op-0, then a forced deletion of its copy once active
(`plans`; they may scale the sink instead: each sink instance keeps its own ids, as the real
ones keep their own id files).

Checked at every terminal state (after a deterministic settle: every queue delivered, time run
on until nothing moves): no record sent to a terminated instance that did not also get through
elsewhere (a replay that crosses the last ack of a departing copy is a harmless duplicate),
every record exactly once at the sink, every round ended (no instance in a round or idle, no
queued outputs), views agree (each live instance's succs/preds are the live instances of the
next/previous operator). No instance may raise at any step.

The keyed pipeline (`Config.keyed`): source -> op -> cnt -> sink, cnt a keyed operator whose key
groups move with their state when it scales, cnt and op scaling at once; its operator, plans and
terminal check are in foglab.sim.instance_check_keyed. `Config.coordination = "fgme"`: every round
inside 2-FGME's locks.

`explore` visits every schedule of up to `depth` moves (states deduplicated), each one settled
and checked; `random_runs` runs seeded random schedules to the end. Seeded faults of the instance
(`faults=`) bring back historic losses; the tests show that both searches find each of them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

from agent import topics
from agent.config import PipelineConfig, load_pipeline_text
from agent.dataplane.envelope import Item, Kind, MalformedEnvelope, decode
from agent.instance.commands import Command, Exit, Persist, PersistSource, Publish, RequestSpawn, SaveKeyed, SaveRoutes
from agent.instance.core import Instance
from agent.instance.events import (
    Control, EnvelopeReceived, Event, PubAcked, PublishAccepted, PublishRefused, Restarted, SessionLost, Spawned,
    Started, Tick,
)
from agent.instance.keyed_state import KeyedState
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node.rehome import plan_rehome
from agent.operators.builtin import OperatorContext
from agent.protocol.scaling import InstanceState
from foglab.sim.checker import Violation
from foglab.sim.instance_faults import (
    FAULT_NO_ADD_PRED, FAULT_NO_REDIRECT_RESEND, FAULT_NO_REMOVE_PRED, HANDOVER_FAULTS, instance_class,
)
from foglab.sim.instance_check_keyed import (
    KEEPER, KEY_GROUPS, KEYED_PLANS, MemoryTrail, check_floor, check_keyed, copy_disk, count_handover, disk_digest,
    keyed_path, new_disk,
)

__all__ = ["Config", "Report", "Violation", "World", "explore", "random_runs", "finish", "describe", "pipeline_text",
           "FAULTS"]

CLUSTER = "chk"
NODE = "n1"  # every instance's node (the writer in its inbox topics)
WALL0 = 1_700_000_000.0  # the wall clock at time 0 (epoch plausibility compares with it)
STEP = 1.0  # seconds per `time` move
SETTLE_LIMIT = 240.0  # simulated seconds a settle may take before the run counts as stuck
REHOME_EPOCH = int(WALL0) + 10  # the epoch floor a re-homed instance starts above (agent.node.rehome)
# Where the instances run, for link cuts (the inbox topics all name NODE: placement only decides
# which instances a cut isolates together). The agent places copies away from their creator.
PLACEMENT = {"source-0": "n1", "op-0": "n1", "sink-0": "n2"}
COPY_NODE = "n2"
BROKER_KINDS = ("restart", "lost", "rollback")
BROKER = BrokerSpec("127.0.0.1", 1)
# The keyed pipeline (`Config.keyed`, foglab.sim.instance_check_keyed): its keeper on n1 too.
PLACEMENT[KEEPER] = "n1"

# The seeded faults the instance's classes can take (foglab.sim.instance_faults, `instance_class`).
# The hand-over's (HANDOVER_FAULTS, no_add_pred, no_remove_pred, no_redirect_resend) need the
# keyed pipeline (`Config.keyed`).
FAULTS = ("retry_only_with_data", "drain_holds_protocol", "rehome_rounds_from_one", "route_afresh",
          "replay_to_departed", "rehome_stays", "resync_at_first_seen", "leave_before_adoption",
          "rehome_idle_active", "replay_clock_at_drop", "resend_pending_only", "wait_for_leaver",
          "route_past_departed", "start_without_leavers", "ack_behind_drain",
          "empty_ack_held", "marks_unacked", "marks_own_max") + HANDOVER_FAULTS + (
          FAULT_NO_ADD_PRED, FAULT_NO_REMOVE_PRED, FAULT_NO_REDIRECT_RESEND)
# The one seeded fault of the planner's inputs (agent.node.rehome), played by the checker's
# re-homing move: plan_rehome is not told which copies were idle, and starts them active.
FAULT_REHOME_IDLE_ACTIVE = "rehome_idle_active"


def pipeline_text(batch: int = 1, window: int = 4, keyed: bool = False, coordination: str = "ack",
                  event_time: bool = False) -> str:
    """source -> op -> sink, no automatic scaling (rounds are the checker's moves); `keyed`:
    source -> op -> cnt -> sink, op routing by key "k" to the keyed cnt; `coordination`: the
    [scaling] setting ("fgme": every round inside 2-FGME's locks); `event_time`: watermarks
    that flow, from the record number `n` as event time in ms (`Config.event_time`)."""
    wm = '[operator.watermark]\ntime_field = "n"\ntime_unit = "ms"' if event_time else ""
    ops = [("source", "source", "agent.operators.taxi:source", wm),
           ("op", "map", "agent.operators.builtin:validate", 'key = "k"' if keyed else ""),
           ("sink", "sink", "agent.operators.builtin:counting_sink", "")]
    if keyed:
        ops.insert(2, ("cnt", "map", "agent.operators.keyed:keyed_count", f"key_groups = {KEY_GROUPS}"))
    lines = ['[pipeline]', 'name = "chk"', f'coordination = "{coordination}"', '', '[scaling]', 'policy = "none"', '']
    for name, kind, fn, extra in ops:
        lines += ['[[operator]]', f'name = "{name}"', f'kind = "{kind}"', f'function = "{fn}"',
                  f'batch_size = {batch}', 'linger_ms = 0', f'max_inflight_batches = {window}']
        lines += [extra, ''] if extra else ['']
    return "\n".join(lines)


# ---- in-memory operators ----------------------------------------------------------------------------


class MemorySource:
    """Generates records ("src", 0..total-1), one per `interval` seconds (so that records are
    still flowing while the rounds run); resumes where it is told."""

    kind = "source"

    def __init__(self, total: int, interval: float = 1.0, keys: int = 0) -> None:
        self.total = total
        self.interval = interval
        self.keys = keys  # > 0: records {"k": "k<n % keys>", "n": n} for the keyed pipeline
        self.generated = 0
        self.paused = False
        self.due = 0.0

    def start(self, now: float) -> None:
        pass

    def resume(self, start: int, upto: int, elapsed: float) -> None:
        self.generated = start

    def poll(self, now: float, budget: int) -> List[Item]:
        if now < self.due or budget < 1 or self.generated >= self.total:
            return []
        self.due = now + self.interval
        self.generated += 1
        n = self.generated - 1
        return [("src", n, {"k": f"k{n % self.keys}", "n": n} if self.keys else {"v": n})]

    def next_due(self, now: float) -> float:
        return max(now, self.due) if self.generated < self.total else now + 3600.0

    def stats(self) -> Dict[str, Any]:
        return {"generated": self.generated}

    def close(self) -> None:
        pass


class MemoryMap:
    """The identity; `via` (the keyed pipeline): each record stamped with the instance that
    forwarded it, so that the order per key can be checked per path (`World.check_keyed`)."""

    kind = "map"

    def __init__(self, via: Optional[str] = None) -> None:
        self.via = via

    def process(self, items: List[Item]) -> List[Item]:
        if self.via is None:
            return list(items)
        return [(s, q, dict(r, via=self.via)) for s, q, r in items]

    def stats(self) -> Dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class MemorySink:
    """Records ids into a durable store (it survives the sink's crashes, as the real id file
    does); an id seen before BY THIS SINK INSTANCE is dropped, as the real sink drops it (each
    sink instance has its own id file: an id recorded by two instances is a duplicate).
    `values` (the keyed pipeline): each id's record, and `conflicts` the ids that came again
    with another record (an output id given twice)."""

    kind = "sink"
    deferred = False
    reads_records = False

    def __init__(self, store: List[Tuple[str, int]], seen: Set[Tuple[str, int]],
                 values: Optional[Dict[Tuple[str, int], Any]] = None) -> None:
        self.store = store
        self.seen = seen
        self.duplicates = 0
        self.values = values
        self.conflicts: List[Tuple[str, int]] = []
        if values is not None:
            self.reads_records = True

    def record(self, items: List[Item]) -> List[Any]:
        for it in items:
            rid = (it[0], it[1])
            if self.values is not None and self.values.setdefault(rid, it[2]) != it[2]:
                self.conflicts.append(rid)
            if rid in self.seen:
                self.duplicates += 1
            else:
                self.seen.add(rid)
                self.store.append(rid)
        return []

    def record_batch(self, items: List[Item], body: Optional[bytes]) -> List[Any]:
        return self.record(items)

    def settle(self) -> int:
        return 0

    def writable(self) -> bool:
        return True

    def take_events(self) -> List[Dict[str, Any]]:
        return []

    def stats(self) -> Dict[str, Any]:
        return {"recorded": len(self.store)}

    def close(self) -> None:
        pass


# ---- configuration, results -------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """What a run may do: records, crash/rehome/refuse/dup budgets, the seeded faults."""

    records: int = 2
    crashes: int = 0
    rehomes: int = 0
    refusals: int = 0
    dups: int = 0
    faults: FrozenSet[str] = frozenset()
    # Forced rounds, in order: (target, action); "copy" is the copy the last duplication created.
    plans: Tuple[Tuple[str, str], ...] = (("op-0", "duplicate"), ("copy", "terminate"))
    max_time: float = 30.0  # `time` moves stop here (the settle runs on past it)
    crash_targets: Tuple[str, ...] = ()  # empty: any live instance; "copy": as below
    rehome_targets: Tuple[str, ...] = ("op-0",)  # "copy": the copy the last duplication created
    refuse_targets: Tuple[str, ...] = ()
    # The broker restarts (budget `brokers`), as one of BROKER_KINDS: "restart" (SIGTERM with
    # persistence: queues and sessions kept, the last delivery to each inbox may come again),
    # "lost" (no persistence: every queue gone, every client told its session is gone),
    # "rollback" (SIGKILL between autosaves: sessions kept, what was queued since is gone).
    brokers: int = 0
    broker_kinds: Tuple[str, ...] = BROKER_KINDS
    # A node cut off the broker (budget `cuts`): its instances run on, nothing reaches them, what
    # they publish waits in their client (accepted, PUBACKed only after the heal). The settle
    # heals a cut `cut_seconds` after it began, so that timers fire during it.
    cuts: int = 0
    cut_seconds: float = 12.0
    # createNode() refused by the agent (budget `spawn_refusals`): no copy, the round is cancelled;
    # the forced duplication is asked for again (fogctl scale retried).
    spawn_refusals: int = 0
    # Random schedules: deliveries to these inboxes are rare (a slow or cut-off node), so that
    # timers (resend on silence, replay to a silent successor) fire while their messages wait.
    slow: Tuple[str, ...] = ()
    # The keyed pipeline (source -> op -> cnt -> sink; plans: KEYED_PLANS): `records` records over
    # `keys` keys; checked besides: every key's final state holds each of its records once, in
    # each path's order, at the one instance every predecessor's table names; no output id twice.
    keyed: bool = False
    keys: int = 3
    # The keyed pipeline with watermarks that flow: the source's [operator.watermark] reads the
    # record number `n` as its event time (ms, no disorder: every record is on time at the
    # source), and cnt fires and judges lateness by the least mark over its inputs (lateness 0).
    # A record judged late is counted and not applied: the terminal check then says
    # `judged_late` (foglab.sim.instance_check_keyed.check_keyed).
    event_time: bool = False
    coordination: str = "ack"  # "fgme": the rounds take 2-FGME's locks (lock messages on the same channels)


@dataclass
class Report:
    states: int = 0
    terminal_states: int = 0
    schedules: int = 0
    steps: int = 0
    seconds: float = 0.0
    violations: List[Violation] = field(default_factory=list)
    seed: Optional[int] = None  # the random schedule that found the first violation
    # the keyed pipeline's hand-over messages delivered, by type, over every schedule (coverage)
    handover: Dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


class _Stop(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


# ---- the world --------------------------------------------------------------------------------------


class World:
    """Instances, the broker's queues, persisted states, fault budgets and the planned rounds."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.toml = pipeline_text(keyed=cfg.keyed, coordination=cfg.coordination, event_time=cfg.event_time)
        self.pipeline: PipelineConfig = load_pipeline_text(self.toml, "checker pipeline")
        self.now = 0.0
        self.inst: Dict[str, Instance] = {}
        self.down: Dict[str, str] = {}  # crashed instance -> "crash" | "rehome"
        # down instance -> its scaling state when it went down (its node's last state report)
        self.down_state: Dict[str, InstanceState] = {}
        # down instance -> the round it was waiting to start under its locks when it went down
        self.down_intent: Dict[str, Optional[str]] = {}
        self.specs: Dict[str, InstanceSpec] = {}
        self.persisted: Dict[str, str] = {}  # instance -> JSON of its last Persist
        self.source_pos: Dict[str, str] = {}
        self.routes: Dict[str, Tuple[Optional[str], str]] = {}  # instance -> its routes file and log
        self.queues: Dict[Tuple[str, str], Tuple[bytes, ...]] = {}
        self.inboxes: Dict[str, str] = {}  # inbox topic -> instance
        self.spawns: List[Tuple[str, str, str]] = []  # (creator, request, copy) answers still to deliver
        self.exited: Dict[str, bool] = {}  # instance -> final
        self.store: List[Tuple[str, int]] = []
        self.late: List[int] = []  # records cnt judged late (`Config.event_time`), by number
        self.to_terminated: List[Tuple[str, int]] = []  # records in data batches to terminated instances
        self.seen: Dict[str, Set[Tuple[str, int]]] = {}  # sink instance -> the ids it recorded
        self.budget = {"crash": cfg.crashes, "rehome": cfg.rehomes, "refuse": cfg.refusals, "dup": cfg.dups,
                       "broker": cfg.brokers, "cut": cfg.cuts, "refuse_spawn": cfg.spawn_refusals}
        self.cut: Dict[str, float] = {}  # node cut off the broker -> when the settle heals it
        # instance -> (dest, payload, mid): what its client holds while its node is cut off
        self.held_out: Dict[str, Tuple[Tuple[str, bytes, int], ...]] = {}
        # queue -> its last delivery (a broker restart may deliver it again)
        self.last_delivered: Dict[Tuple[str, str], bytes] = {}
        self.refuse_next: Set[str] = set()
        self.plans: List[Tuple[str, str]] = list(KEYED_PLANS if cfg.keyed and cfg.plans == Config.plans else cfg.plans)
        self.copy_id: Optional[str] = None
        self.copies: Dict[str, str] = {}  # operator -> the copy its last duplication created ("copy:<op>")
        self.mid = 0
        # The keyed pipeline: the sink's record per output id, and the keyed files on a scratch
        # disk (KeyedState.save writes its snapshot and delta log; a crash restarts from them).
        self.values: Optional[Dict[Tuple[str, int], Any]] = {} if cfg.keyed else None
        self.handover: Dict[str, int] = {}  # hand-over messages delivered, by type
        self.disk: Optional[str] = None
        if cfg.keyed:
            self.disk = new_disk(self)
        names = [op.name for op in self.pipeline.operators]
        ids = [KEEPER if cfg.keyed and name == "cnt" else f"{name}-0" for name in names]
        for i, name in enumerate(names):
            spec = InstanceSpec(ids[i], name, NODE, CLUSTER, "chk", self.toml, BROKER,
                                succs=(ids[i + 1],) if i + 1 < len(names) else (),
                                preds=(ids[i - 1],) if i > 0 else (),
                                keeper=True, state_dir="/nonexistent", heartbeat_period=3600.0)
            self._boot(spec, None)

    # ---- instances ------------------------------------------------------------------------------

    def _operator(self, spec: InstanceSpec) -> Any:
        if spec.operator == "source":
            return MemorySource(self.cfg.records, keys=self.cfg.keys if self.cfg.keyed else 0)
        if spec.operator == "sink":
            return MemorySink(self.store, self.seen.setdefault(spec.instance, set()), self.values)
        if spec.operator == "cnt":
            params = {"time_field": "n", "time_unit": "ms"} if self.cfg.event_time else {}
            return MemoryTrail(OperatorContext(spec.instance, "cnt", NODE, "map", params), self.late)
        return MemoryMap(spec.instance if self.cfg.keyed else None)

    def _keyed_path(self, iid: str) -> Path:
        assert self.disk is not None
        return keyed_path(self.disk, iid)

    def _boot(self, spec: InstanceSpec, restart: Optional[str]) -> None:
        iid = spec.instance
        self.specs[iid] = spec
        self.inboxes[topics.inbox(CLUSTER, iid, spec.node)] = iid
        inst = instance_class(self.cfg.faults)(spec, self.pipeline, self._operator(spec), faults=self.cfg.faults,
                                               next_keyed=self.cfg.keyed and spec.operator == "op")
        self.inst[iid] = inst
        if restart is None:
            self._feed(iid, Started(WALL0 + self.now))
        else:
            state = json.loads(self.persisted.get(iid, "{}")) if restart == "crash" else {}
            pos = json.loads(self.source_pos[iid]) if restart == "crash" and iid in self.source_pos else None
            keyed = None
            if self.disk is not None and spec.operator == "cnt":
                if restart == "crash":
                    keyed = KeyedState.load(self._keyed_path(iid))
                else:
                    self._keyed_path(iid).unlink(missing_ok=True)
            if restart != "crash":
                self.routes.pop(iid, None)  # its files went with its node
            routes = self.routes.get(iid, (None, ""))
            self._feed(iid, Restarted(WALL0 + self.now, state, pos, keyed=keyed, routes=routes))

    def _feed(self, iid: str, event: Event) -> None:
        inst = self.inst[iid]
        feedback: List[Event] = []
        for cmd in inst.handle(event, self.now):
            feedback += self._perform(iid, cmd, feedback)
        for part in (inst.scaling, inst.group_side, inst.moves):
            if part is not None and part.unreturned:
                raise _Stop("commands_left_behind", f"{iid}: {type(part).__name__} holds {part.unreturned} "
                            f"commands of {type(event).__name__} it did not return")
        for ev in feedback:
            if iid in self.inst:
                self._feed(iid, ev)

    def _perform(self, iid: str, cmd: Command, earlier: List[Event]) -> List[Event]:
        if isinstance(cmd, Publish):
            if iid in self.refuse_next or any(isinstance(e, PublishRefused) for e in earlier):
                self.refuse_next.discard(iid)
                return [PublishRefused(cmd.token, "refused (checker fault)")]
            dest = self.inboxes.get(cmd.topic)
            if dest is None:
                raise _Stop("unknown_destination", f"{iid} published to {cmd.topic}")
            self.mid += 1
            if self.node_of(iid) in self.cut:  # in its client until the heal (PUBACK then)
                self.held_out[iid] = self.held_out.get(iid, ()) + ((dest, cmd.payload, self.mid),)
                return [PublishAccepted(cmd.token, self.mid)]
            key = (iid, dest)
            self.queues[key] = self.queues.get(key, ()) + (cmd.payload,)
            return [PublishAccepted(cmd.token, self.mid), PubAcked(self.mid)]
        if isinstance(cmd, Persist):
            self.persisted[iid] = json.dumps(cmd.state, sort_keys=True)
        elif isinstance(cmd, PersistSource):
            self.source_pos[iid] = json.dumps(cmd.data, sort_keys=True)
        elif isinstance(cmd, SaveKeyed):
            cmd.state.save(self._keyed_path(iid))  # as the worker: then the inputs it reflects are acked
        elif isinstance(cmd, SaveRoutes):
            snapshot, log = self.routes.get(iid, (None, ""))
            if cmd.snapshot is not None:
                snapshot, log = cmd.snapshot, ""
            self.routes[iid] = (snapshot, log + cmd.log)
        elif isinstance(cmd, RequestSpawn):
            data = dict(cmd.spec)
            data["broker"] = BROKER
            data["succs"], data["preds"] = tuple(data["succs"]), tuple(data["preds"])
            spec = InstanceSpec(**data)
            self.copy_id = self.copies[spec.operator] = spec.instance
            if spec.instance not in self.inst and spec.instance not in self.down:
                self._boot(spec, None)  # createNode() of an instance that exists answers with it
            self.spawns.append((iid, cmd.request, spec.instance))
        elif isinstance(cmd, Exit):
            del self.inst[iid]
            self.exited[iid] = cmd.final
            if self.node_of(iid) in self.cut:
                self.held_out.pop(iid, None)  # it exits without reaching the broker: paho's queue is gone
        return []

    # ---- moves ----------------------------------------------------------------------------------

    def moves(self) -> List[Tuple[Any, ...]]:
        out: List[Tuple[Any, ...]] = []
        for key in sorted(self.queues):
            if self.queues[key] and self._reachable(key[1]):
                out.append(("deliver", key))
                if self.budget["dup"]:
                    out.append(("dup", key))
        for i, (creator, _, copy_id) in enumerate(self.spawns):
            if self.node_of(creator) not in self.cut and self.node_of(copy_id) not in self.cut:
                out.append(("spawned", i))
                if self.budget["refuse_spawn"]:
                    out.append(("refuse_spawn", i))
        plan = self._plan_move()
        if plan is not None:
            out.append(plan)
        for iid in sorted(self.down):
            if self.node_of(iid) not in self.cut:  # a worker starts once subscribed
                out.append(("restart", iid))
        crash = self._targets(self.cfg.crash_targets) if self.cfg.crash_targets else tuple(sorted(self.inst))
        targets = {"crash": crash, "rehome": self._targets(self.cfg.rehome_targets)}
        for kind in ("crash", "rehome"):
            if self.budget[kind]:
                out += [(kind, i) for i in targets[kind] if i in self.inst]
        if self.budget["refuse"]:
            out += [("refuse", i) for i in (self.cfg.refuse_targets or tuple(sorted(self.inst))) if i in self.inst]
        if self.budget["broker"] and not self.cut:
            out += [("broker", k) for k in self.cfg.broker_kinds]
        if self.budget["cut"] and not self.cut:
            out += [("cut", n) for n in sorted(set(PLACEMENT.values()))]
        out += [("heal", n) for n in sorted(self.cut)]
        if self.now < self.cfg.max_time:
            out.append(("time",))
        return out

    def play(self, label: str) -> None:
        """Apply the move named `label` as a violation's trace names it, "copy" standing for the
        copy the last duplication created: fixed schedules in tests, traces replayed by hand."""
        if self.copy_id is not None:
            label = label.replace("copy", self.copy_id)
        for move in self.moves():
            if _label(move) == label:
                self.apply(move)
                return
        raise ValueError(f"no move {label!r} now; moves: {[_label(m) for m in self.moves()]}")

    def deliver_all(self, but: Tuple[str, ...] = ()) -> None:
        """Deliver every queue (and answer every spawn) until nothing is left, except the queues
        named in `but` ("source-0->copy"): a fast network with a few slow links."""
        skip = {f"deliver {b}".replace("copy", self.copy_id or "copy") for b in but}
        while True:
            ready = [m for m in self.moves() if m[0] in ("deliver", "spawned") and _label(m) not in skip]
            if not ready:
                return
            self.apply(ready[0])

    def _resolve(self, target: str) -> Optional[str]:
        """"copy": the copy the last duplication created; "copy:<operator>": that operator's."""
        if target == "copy":
            return self.copy_id
        if target.startswith("copy:"):
            return self.copies.get(target[5:])
        return target

    def _targets(self, names: Tuple[str, ...]) -> Tuple[str, ...]:
        """Instance ids for a fault's targets ("copy", "copy:<operator>": see `_resolve`)."""
        return tuple(i for i in (self._resolve(t) for t in names) if i is not None)

    def _plan_move(self) -> Optional[Tuple[Any, ...]]:
        if not self.plans:
            return None
        target, action = self.plans[0]
        iid = self._resolve(target)
        core = self._core(iid)
        if core is None or core.state is not InstanceState.ACTIVE or self.inst[iid].scaling.outputs:
            return None
        return ("plan", iid, action)

    def _core(self, iid: Optional[str]) -> Any:
        inst = self.inst.get(iid) if iid else None
        return inst.scaling.core if inst is not None and inst.scaling is not None else None

    def apply(self, move: Tuple[Any, ...]) -> None:
        self._apply(move)
        if self.late:  # `Config.event_time`: every record is on time at the source
            raise _Stop("judged_late", f"records {sorted(set(self.late))[:8]} judged late at cnt, "
                        "all on time at the source")
        if self.cfg.keyed and "source-0" in self.inst:
            assert self.values is not None
            bad = check_floor(self.inst["source-0"], self.values)
            if bad is not None:
                raise _Stop(*bad)

    def _apply(self, move: Tuple[Any, ...]) -> None:
        kind = move[0]
        if kind == "deliver" or kind == "dup":
            key = move[1]
            q = self.queues[key]
            payload = q[0]
            if kind == "deliver":
                self.queues[key] = q[1:]
                if self.budget["broker"] and "restart" in self.cfg.broker_kinds:
                    self.last_delivered[key] = payload
            else:
                self.budget["dup"] -= 1
            self._deliver(key[1], payload)
        elif kind == "spawned":
            creator, request, _ = self.spawns.pop(move[1])
            if creator in self.inst:
                self._feed(creator, Spawned(request, True))
                self._tick(creator)
        elif kind == "refuse_spawn":
            self.budget["refuse_spawn"] -= 1
            creator, request, copy_id = self.spawns.pop(move[1])
            self._remove_refused(copy_id)
            # fogctl scale asks again for the duplication the agent refused
            self.plans.insert(0, (creator, "duplicate"))
            if creator in self.inst:
                self._feed(creator, Spawned(request, False, "max_instances reached (checker fault)"))
                self._tick(creator)
        elif kind == "plan":
            self.plans.pop(0)
            self._feed(move[1], Control({"event": "scale", "action": move[2], "count": 1}))
            self._tick(move[1])
        elif kind in ("crash", "rehome"):
            self.budget[kind] -= 1
            iid = move[1]
            self.down_state[iid] = self._core(iid).state
            self.down_intent[iid] = _intent(self._core(iid))
            del self.inst[iid]
            self.down[iid] = kind
            self.refuse_next.discard(iid)
            self.held_out.pop(iid, None)  # what its client held went with the process
            self.spawns = [s for s in self.spawns if s[0] != iid]  # its agent answers a dead process
        elif kind == "restart":
            iid = move[1]
            how = self.down.pop(iid)
            spec = self.specs[iid]
            planned = self._rehome_plan(iid, REHOME_EPOCH + self.cfg.rehomes - self.budget["rehome"]) \
                if how == "rehome" else {}
            self.down_state.pop(iid, None)
            self.down_intent.pop(iid, None)
            extra = dict(spec.extra)
            fields: Dict[str, Any] = {"restart": True, "extra": extra}
            if how == "rehome":
                # agent.node.rehome.plan_rehome: active (idle, a copy its node last reported
                # idle), tables rebuilt from every node's hosted instances of the neighbouring
                # operators, epoch above the dead incarnation's: the wall clock at the
                # re-homing, above any epoch an earlier one gave (one a move); the idle copies
                # it created, to adopt
                fields.update(active=planned["active"], preds=tuple(planned["preds"]),
                              succs=tuple(planned["succs"]), extra=planned["extra"])
            self._boot(InstanceSpec(**{**spec.__dict__, **fields}), how)
            if iid in self.inst:
                self._tick(iid)
        elif kind == "refuse":
            self.budget["refuse"] -= 1
            self.refuse_next.add(move[1])
        elif kind == "broker":
            self.budget["broker"] -= 1
            self._broker_restart(move[1])
        elif kind == "cut":
            self.budget["cut"] -= 1
            self.cut[move[1]] = self.now + self.cfg.cut_seconds
        elif kind == "heal":
            self._heal(move[1])
        elif kind == "time":
            self.now += STEP
            for node in sorted(self.cut):
                if self.now >= self.cut[node]:  # a cut lasts cut_seconds at most
                    self._heal(node)
            for iid in sorted(self.inst):
                if iid in self.inst:
                    self._tick(iid)
        else:
            raise ValueError(f"unknown move {move!r}")

    def _deliver(self, dest: str, payload: bytes) -> None:
        if self.cfg.keyed:
            count_handover(self.handover, payload)
        if dest in self.exited and self.exited[dest]:
            try:
                env = decode(payload, False)
            except MalformedEnvelope:
                return
            if env.kind is Kind.DATA:
                # Harmless only if a copy of every record it carries got through elsewhere (a
                # replay crossing the terminated instance's last ack): checked at the end.
                self.to_terminated.extend((it[0], it[1]) for it in env.body)
            return
        if dest not in self.inst:
            return
        self._feed(dest, EnvelopeReceived(topics.inbox(CLUSTER, dest, NODE), payload))
        if dest in self.inst:
            self._tick(dest)

    def _tick(self, iid: str) -> None:
        self._feed(iid, Tick(WALL0 + self.now))

    # ---- placement, the broker's faults, link cuts, refused spawns ---------------------------------

    def node_of(self, iid: str) -> str:
        return PLACEMENT.get(iid, COPY_NODE)

    def _reachable(self, iid: str) -> bool:
        """Can the broker deliver to `iid` now (it runs, and its node is not cut off)?"""
        return iid not in self.down and self.node_of(iid) not in self.cut

    def _rehome_plan(self, iid: str, min_epoch: int) -> Dict[str, Any]:
        """What agent.node.rehome.plan_rehome gives `iid` when its node is lost: the hosted
        records are the instances running or down (not gone for good), the node states say
        which ones are departing or idle (their scaling core's state; a down instance's when it
        went down, as its node last reported it). Seeded fault `rehome_idle_active`: the planner
        is not told which copies are idle (as before the fix: every instance re-homed active)."""
        hosted: Dict[str, List[Dict[str, Any]]] = {}
        for other, spec in sorted(self.specs.items()):
            if other in self.inst or other in self.down or other == iid:
                hosted.setdefault(self.node_of(other) if other != iid else "lost", []).append(
                    {"instance": other, "operator": spec.operator, "pipeline": spec.pipeline,
                     "pipeline_toml": self.toml, "extra": dict(spec.extra), "keeper": spec.keeper})
        states = {other: self._core(other).state for other in self.inst if self._core(other) is not None}
        states.update(self.down_state)
        departing = {i for i, st in states.items() if st in (InstanceState.DEPARTING, InstanceState.TERMINATED)}
        idle = {i for i, st in states.items() if st is InstanceState.IDLE}
        if FAULT_REHOME_IDLE_ACTIVE in self.cfg.faults:
            idle = set()
        # the round each lock-guarded instance had decided and was waiting to start (its
        # heartbeat's lock intent, agent.node.rehoming.lost_intents; a down one's when it went down)
        intents = {other: _intent(self._core(other)) for other in self.inst}
        intents.update(self.down_intent)
        intents = {i: a for i, a in intents.items() if a is not None}
        plan = plan_rehome("lost", hosted, set(hosted) - {"lost"}, set(), min_epoch, departing=departing, idle=idle,
                           intents=intents)
        return plan[0]

    def _remove_refused(self, copy_id: str) -> None:
        """The agent refused createNode(): the copy never existed. (The model boots a copy at the
        request; nobody but its creator knows it yet, so nothing of it is left.)"""
        self.inst.pop(copy_id, None)
        self.down.pop(copy_id, None)
        self.specs.pop(copy_id, None)
        self.persisted.pop(copy_id, None)
        self.held_out.pop(copy_id, None)
        self.inboxes = {t: i for t, i in self.inboxes.items() if i != copy_id}
        for key in [k for k in self.queues if copy_id in k]:
            del self.queues[key]
        for key in [k for k in self.last_delivered if copy_id in k]:
            del self.last_delivered[key]
        if self.copy_id == copy_id:
            self.copy_id = None
        self.copies = {op: c for op, c in self.copies.items() if c != copy_id}

    def _broker_restart(self, how: str) -> None:
        if how == "restart":
            # Queues and sessions kept; a delivery whose PUBACK the broker had not seen comes
            # again after the reconnect (MQTT 4.4): the last one of each queue, at its head.
            for key, payload in sorted(self.last_delivered.items()):
                if self._reachable(key[1]):
                    self.queues[key] = (payload,) + self.queues.get(key, ())
            self.last_delivered.clear()
            return
        for key in self.queues:  # "lost" and "rollback": nothing still queued survives
            self.queues[key] = ()
        self.last_delivered.clear()
        if how == "lost":
            for iid in sorted(self.inst):  # each client reconnects and finds no session
                if iid in self.inst:
                    self._feed(iid, SessionLost())
                if iid in self.inst:
                    self._tick(iid)
        elif how != "rollback":
            raise ValueError(f"unknown broker fault {how!r}")

    def _heal(self, node: str) -> None:
        """The node reaches the broker again: what its clients held goes out, in order, then the
        broker's PUBACKs come back."""
        del self.cut[node]
        for iid in sorted(self.held_out):
            if self.node_of(iid) != node:
                continue
            held = self.held_out.pop(iid)
            for dest, payload, _ in held:
                self.queues[(iid, dest)] = self.queues.get((iid, dest), ()) + (payload,)
            if iid in self.inst:
                for _, _, mid in held:
                    if iid in self.inst:
                        self._feed(iid, PubAcked(mid))
                if iid in self.inst:
                    self._tick(iid)

    # ---- end of a run -----------------------------------------------------------------------------

    def settle(self) -> None:
        """Run to quiescence deterministically: restart what is down, answer spawns, deliver
        every queue round-robin, then let time pass (timers: resend, replay, pings)."""
        quiet_since = self.now
        while True:
            progressed = False
            for node in sorted(self.cut):
                if self.now >= self.cut[node]:
                    self.apply(("heal", node))
                    progressed = True
            for iid in sorted(self.down):
                if self.node_of(iid) not in self.cut:
                    self.apply(("restart", iid))
                    progressed = True
            i = 0
            while i < len(self.spawns):
                creator, _, copy_id = self.spawns[i]
                if self.node_of(creator) in self.cut or self.node_of(copy_id) in self.cut:
                    i += 1
                    continue
                self.apply(("spawned", i))
                progressed = True
            plan = self._plan_move()
            if plan is not None:
                self.apply(plan)
                progressed = True
            for key in sorted(self.queues):
                if self.queues.get(key) and self._reachable(key[1]):
                    self.apply(("deliver", key))
                    progressed = True
            if progressed:
                quiet_since = self.now
                continue
            if self.now - quiet_since > 30.0 and self._done():
                return
            if self.now > self.cfg.max_time + SETTLE_LIMIT:
                return  # stuck: the terminal checks say why
            self.apply(("time",))

    def _done(self) -> bool:
        return not self.plans and not self.cut and all(
            not i.scaling.outputs and i.scaling.core.state is InstanceState.ACTIVE for i in self.inst.values())

    def check_terminal(self) -> Optional[Tuple[str, str]]:
        want = {("src", i) for i in range(self.cfg.records)}
        if self.cfg.keyed:
            bad = self.check_keyed()
            if bad is not None:
                return bad
            got = want  # checked per key, in the states
        else:
            got = set(self.store)
        lost = sorted(set(self.to_terminated) - got)
        if lost:
            return ("record_to_terminated", f"records {lost[:8]} went to a terminated instance and nowhere else")
        if not self.cfg.keyed and (got != want or len(self.store) != len(got)):
            missing = sorted(want - got)
            return ("records_not_exactly_once", f"missing {missing[:8]}, recorded {len(self.store)} of {len(want)}")
        for iid, inst in sorted(self.inst.items()):
            sc = inst.scaling
            if sc.core.state is not InstanceState.ACTIVE or sc.outputs:
                return ("round_not_ended", f"{iid} still {sc.core.state.value} (pending {sorted(sc.core.pending)}, "
                        f"{len(sc.outputs)} queued outputs, draining {sc.draining})")
        for plan in self.plans:
            return ("round_not_ended", f"planned {plan} never started")
        live: Dict[int, Set[str]] = {}
        for iid, inst in self.inst.items():
            live.setdefault(inst.stage, set()).add(iid)
        for iid, inst in sorted(self.inst.items()):
            core = inst.scaling.core
            succs, preds = live.get(inst.stage + 1, set()), live.get(inst.stage - 1, set())
            if core.succs != succs or core.preds != preds:
                return ("views_disagree", f"{iid}: succs {sorted(core.succs)} preds {sorted(core.preds)}, "
                        f"live {sorted(succs)} / {sorted(preds)}")
        return None

    def check_keyed(self) -> Optional[Tuple[str, str]]:
        """The keyed pipeline's end (foglab.sim.instance_check_keyed.check_keyed); with
        `event_time`, first: no record judged late (each was on time at the source)."""
        if self.late:
            return ("judged_late", f"records {sorted(set(self.late))[:8]} judged late at cnt, all on time at the source")
        if self.cfg.event_time:
            # not vacuous: the last record's mark got through to the keeper (the settle's ticks)
            keeper = self.inst.get(KEEPER)
            wm = keeper.keyed.max_time if keeper is not None and keeper.keyed is not None else None
            if wm != float(self.cfg.records - 1):
                return ("marks_stuck", f"{KEEPER}'s watermark is {wm}, the last record's time {self.cfg.records - 1}")
        assert self.values is not None
        conflicts = [rid for sink in self.inst.values() if isinstance(sink.operator, MemorySink)
                     for rid in sink.operator.conflicts]
        return check_keyed(self.inst, self.cfg.records, self.cfg.keys, self.store, self.values, conflicts)

    # ---- exploration support ----------------------------------------------------------------------

    def fork(self) -> "World":
        memo: Dict[int, Any] = {id(self.pipeline): self.pipeline, id(self.cfg): self.cfg}
        for s in self.specs.values():
            memo[id(s)] = s
        for inst in self.inst.values():
            memo[id(inst.spec)] = inst.spec
            memo[id(inst.op)] = inst.op
        other = copy.deepcopy(self, memo)
        if self.disk is not None:  # its own copy of the keyed files
            other.disk = copy_disk(self.disk, other)
        return other

    def _disk_digest(self) -> Optional[bytes]:
        return None if self.disk is None else disk_digest(self.disk)

    def fingerprint(self) -> bytes:
        """A digest of the whole state but the shared, never-changing parts (pipeline, specs)."""
        saved = [(i, i.pipeline, i.op, i.spec) for i in self.inst.values()]
        pipeline, specs, disk = self.pipeline, self.specs, self.disk
        try:
            for i, *_ in saved:
                i.pipeline = i.op = i.spec = None  # type: ignore[assignment]
            self.pipeline = self.specs = None  # type: ignore[assignment]
            self.disk = self._disk_digest()  # type: ignore[assignment]  # the files, not their place
            return hashlib.blake2b(pickle.dumps(self.__dict__, protocol=5), digest_size=16).digest()
        finally:
            for i, p, o, s in saved:
                i.pipeline, i.op, i.spec = p, o, s
            self.pipeline, self.specs, self.disk = pipeline, specs, disk



def _intent(core: Any) -> Optional[str]:
    """What an instance's heartbeat reports as its lock intent (agent.instance.rounds `lock`):
    the round decided and waiting for its locks, not an adoption (redone from idle copies)."""
    intent = getattr(core, "intent", None)
    if intent is None or getattr(core, "adopting", None) is not None:
        return None
    return str(intent.action.value)


def _label(move: Tuple[Any, ...]) -> str:
    if move[0] in ("deliver", "dup"):
        return f"{move[0]} {move[1][0]}->{move[1][1]}"
    return " ".join(str(m) for m in move)


def _step(world: World, move: Tuple[Any, ...]) -> Optional[Tuple[str, str]]:
    try:
        world.apply(move)
    except _Stop as stop:
        return (stop.kind, stop.detail)
    return None


def finish(world: World) -> Optional[Tuple[str, str]]:
    """Settle `world` and check its terminal state: (violation kind, detail) or None."""
    try:
        world.settle()
    except _Stop as stop:
        return (stop.kind, stop.detail)
    return world.check_terminal()


def explore(cfg: Config, *, depth: int, max_states: int = 200_000, stop_at_first: bool = True) -> Report:
    """Every schedule of at most `depth` moves (states deduplicated), each settled and checked."""
    t0 = time.monotonic()
    report = Report()
    seen: Set[bytes] = set()
    stack: List[Tuple[World, Tuple[str, ...]]] = [(World(cfg), ())]
    while stack:
        world, trace = stack.pop()
        fp = world.fingerprint()
        if fp in seen:
            continue
        seen.add(fp)
        report.states += 1
        if report.states > max_states:
            raise RuntimeError(f"more than {max_states} states: lower the depth")
        moves = world.moves() if len(trace) < depth else []
        if not moves:
            report.terminal_states += 1
            bad = finish(world.fork())
            if bad:
                report.violations.append(Violation(bad[0], bad[1], trace))
                if stop_at_first:
                    break
            continue
        for move in reversed(moves):
            nxt = world.fork()
            bad = _step(nxt, move)
            report.steps += 1
            if bad:
                report.violations.append(Violation(bad[0], bad[1], trace + (_label(move),)))
                if stop_at_first:
                    stack = []
                    break
                continue
            stack.append((nxt, trace + (_label(move),)))
    report.seconds = time.monotonic() - t0
    return report


def random_runs(cfg: Config, *, schedules: int, seed: int = 0, max_steps: int = 400,
                stop_at_first: bool = True) -> Report:
    """`schedules` seeded random schedules, each run to its end and checked. Schedule k uses
    seed `seed + k` (a failing one is reported in `Report.seed`, and reruns alone)."""
    t0 = time.monotonic()
    report = Report()
    for k in range(schedules):
        rng = random.Random(seed + k)
        world = World(cfg)
        trace: List[str] = []
        bad: Optional[Tuple[str, str]] = None
        for _ in range(max_steps):
            moves = world.moves()
            if not moves:
                break
            # Time passes rarely, so that messages race each other as often as timers fire; a cut
            # mostly lasts until the clock heals it, so that timers fire while it lasts.
            weights = [0.15 if m[0] == "time" else 0.05 if m[0] == "heal"
                       else 0.03 if m[0] == "deliver" and m[1][1] in cfg.slow else 1.0 for m in moves]
            move = rng.choices(moves, weights)[0]
            trace.append(_label(move))
            report.steps += 1
            bad = _step(world, move)
            if bad:
                break
        if bad is None:
            bad = finish(world)
        for kind, n in world.handover.items():
            report.handover[kind] = report.handover.get(kind, 0) + n
        report.schedules += 1
        report.terminal_states += 1
        if bad:
            report.violations.append(Violation(bad[0], bad[1], tuple(trace)))
            if report.seed is None:
                report.seed = seed + k
            if stop_at_first:
                break
    report.seconds = time.monotonic() - t0
    return report


def describe(report: Report) -> str:
    head = (f"{report.states} states, {report.terminal_states} terminal, {report.schedules} schedules, "
            f"{report.steps} steps, {report.seconds:.1f}s")
    if report.ok:
        return head + ": OK"
    v = report.violations[0]
    tail = "\n  ".join(v.trace[-25:])
    seed = f" (seed {report.seed})" if report.seed is not None else ""
    return f"{head}: {v.kind}{seed}: {v.detail}\n  ... {tail}"
