"""The scaling driver of an instance: rounds, recovery and steering around the protocol core.

Rules of this file: part of the sans-IO `agent.instance.core.Instance` (no sockets, no clock, no
global random: the instance's clock is handed to it, the decision draws come from a seeded
generator of its own). It feeds the scaling core (agent.protocol.scaling, or the lock-guarded core
of agent.protocol.guarded) messages and decision ticks, and performs the core's outputs strictly in
order (the core's ORDERING CONTRACT) through the instance's parts it is handed, not the instance
(agent.instance.driver_parts): sends on the numbered channels, route changes of the data path,
drain, createNode() requests, persistence. Each entry point returns its commands in order
(agent.instance.emitter), those of the parts it called among them where the call stands.

Recovery (agent.instance.recovery) lives here too: write-ahead outputs, round memory, resend on
silence, adoption of an orphaned copy, rounds above a dead incarnation's. Three parts with state
of their own do not: the idle copies (agent.instance.adoption: idle ping, Start again, probe and
echo), the createNode() requests of a round (agent.instance.creates), and the decision and lock
events (agent.instance.scaling_events).
"""

from __future__ import annotations

import logging
import random
import zlib
from collections import deque
from dataclasses import replace
from typing import Any, Deque, Dict, List, Optional, Tuple

from agent.config import RUNTIME_POLICIES
from agent.dataplane.envelope import Envelope, Kind
from agent.dataplane.inbound import LogLimiter
from agent.instance.adoption import (
    IDLE_PING, IDLE_PING_MAX, MAX_PROBES, PROBE, PROBE_ECHO, PROBE_TTL, IdleCopies, with_groups,
)
from agent.instance.commands import Emit
from agent.instance.creates import CreateRequests
from agent.instance.driver_parts import DriverParts
from agent.instance.emitter import Emitter, emits
from agent.instance.groups import START_FIELD
from agent.instance.recovery import (
    RESEND_AFTER, LinkError, RoundMemory, decode_outputs, encode_outputs, open_links, silent_pending,
)
from agent.instance.rounds import RoundLog
from agent.instance.scaling_events import ScalingEvents
from agent.policy.decentralized import Action, Decision, ScalingParams
from agent.policy.live import LIVE_POLICIES, LivePolicy, PeriodInputs
from agent.protocol.errors import LocalProtocolError, ProtocolError
from agent.protocol.guarded import LockMessage, core_class, message_from_dict
from agent.protocol.messages import Deletion, DeletionAck, Duplication, DuplicationAck, Start
from agent.protocol.scaling import Activate, CreateInstance, Drain, InstanceState, RoutesChanged, Send, Terminate

__all__ = ["ScalingDriver", "PROBE", "PROBE_ECHO", "IDLE_PING", "IDLE_PING_MAX", "MAX_PROBES", "PROBE_TTL"]

log = logging.getLogger("agent.instance.worker")

# The seeded faults of the driver (the instance checker's `ack_behind_drain`, `wait_for_leaver`, ...)
# are subclasses it installs (foglab.sim.instance_faults): no branch here.


class ScalingDriver(Emitter):
    """Drives the sans-IO scaling core (agent.protocol.scaling) through its instance's parts. A
    decision, top-down: `maybe_tick` decides (the policy, or `_run_forced` for fogctl), the core's
    `start_round` returns the round's outputs, `_observe` records the round's start, `_queue`
    writes them ahead and `run_outputs` performs them strictly in order (the core's ORDERING
    CONTRACT): the copies' createNode() wait for `on_spawned`, the Sends go out; the neighbours'
    acks come in through `handle`, which queues the round's last outputs the same way."""

    # A draining instance's ack of a Duplication whose copies its tables already name goes ahead
    # of its waiting Drain (`_ahead_of_drain`; False only in the checker's seeded fault
    # `ack_behind_drain`, foglab.sim.instance_faults).
    acks_ahead_of_drain = True

    def __init__(self, parts: DriverParts, saved: Dict[str, Any], restart: bool) -> None:
        super().__init__()
        self.parts = parts
        self.clock = parts.clock  # the instance's: the time of the event being handled
        spec = parts.spec
        sc = parts.pipeline.scaling_for(spec.operator)
        capacity = sc.capacity if isinstance(sc.capacity, (int, float)) else float(spec.extra.get("capacity", 500.0))
        self.params = ScalingParams(
            capacity=float(spec.extra.get("capacity", capacity)),
            target_ratio=sc.target_ratio,
            up=sc.up,
            down=sc.down,
            use_r_secure=sc.r_secure,
        )
        self.period = sc.period
        self.cooldown = sc.cooldown
        self.policy = sc.policy
        if self.policy not in RUNTIME_POLICIES:  # deploy refuses these; a hand-made spec ends here
            raise ValueError("; ".join(parts.pipeline.runtime_policy_errors()))
        # threshold / model / sized: the simulator's policy objects, fed the live signals and the
        # daemon's sibling context (agent.policy.live); "decentralized" stays in the core.
        self.live: Optional[LivePolicy] = LivePolicy(self.policy, sc) if self.policy in LIVE_POLICIES else None
        # coordination = "ack" (paper) or "fgme" (rounds inside 2-FGME CSs, docs/gme.md). Lock
        # messages share the inbox and its numbered FIFO channel with the scaling messages.
        self.coordination = parts.pipeline.pipeline.coordination
        core_cls = core_class(self.coordination, parts.pipeline.pipeline.fgme_damping)
        self._from_dict = message_from_dict
        if restart and saved.get("scaling"):
            self.core = core_cls.restore(saved["scaling"], self.params, incarnation=parts.epoch)
        elif spec.active:
            self.core = core_cls.initial(
                spec.instance, spec.operator, parts.stage, self.params,
                succs=spec.succs, preds=spec.preds, keeper=spec.keeper, incarnation=parts.epoch,
            )
        else:
            creator = str(spec.extra.get("creator", ""))
            self.core = core_cls.from_create(
                CreateInstance(spec.instance, spec.operator, parts.stage, creator), self.params,
                incarnation=parts.epoch,
            )
        # Re-homed (agent.node.rehome): started active with rebuilt tables and none of the dead
        # incarnation's protocol state (see `_left_behind`).
        self.rehomed = bool(not (restart and saved.get("scaling")) and spec.extra.get("min_epoch"))
        if self.rehomed:
            self._rounds_above_dead_incarnation(int(spec.extra["min_epoch"]))
        self.log = RoundLog([op.name for op in parts.pipeline.operators], spec.operator)
        self.log.observe(self.core, self.clock.now, self.clock.wall())
        self.lock_counts: Dict[str, Dict[str, int]] = {"in": {}, "out": {}}
        self.outputs: Deque[Any] = deque()
        self.round_created: List[str] = []  # copies of the current round whose create succeeded
        self.memory = RoundMemory(saved.get("rounds_applied") if restart else None)
        self._round_clock: Dict[str, float] = {}  # neighbour -> last sent to / heard from
        # coordination = "fgme": every protocol message of the core on an exactly-once FIFO
        # channel (agent.instance.recovery.ReliableLinks); "ack" keeps the paper's path
        floor = int(spec.extra.get("min_epoch", 0) or 0)
        self.links = (open_links(spec.instance, floor, saved, restart, self.clock.now, self.clock.wall(), parts.ctx)
                      if self.coordination == "fgme" else None)
        if restart and saved.get("scaling"):
            # Finish what the crashed incarnation had queued (write-ahead, agent.instance.recovery).
            self.outputs.extend(decode_outputs(saved.get("outputs") or [], self._from_dict))
            self.round_created = [str(i) for i in saved.get("round_created") or []]
            if not self.outputs:  # its round messages went out: resend if the answers never come
                self._round_clock.update((n, self.clock.now) for n in self.core.pending)
        self.skip_decisions = 0  # decisions to skip (the first one after activation)
        # Did the last period bring input? False at a start or restart: the load of the period
        # in which input begins (again) was measured over only part of it (see maybe_tick).
        self.had_input = False
        self.forced: Deque[Tuple[str, int]] = deque()  # steering requests (fogctl), in order
        # Re-homed: the round our dead incarnation had decided and was waiting to start under
        # its locks (plan_rehome, `lock_intent`): that decision went with its files, and a
        # fogctl scale it had accepted would otherwise never run.
        intent = spec.extra.get("lock_intent") if self.rehomed and spec.active else None
        if intent in ("duplicate", "terminate"):
            self.forced.append((str(intent), 1))
        self.pinned = False  # fogctl scale pinned this operator's count: forced rounds only
        self.draining = False
        seed = int(spec.extra.get("seed", 0)) ^ zlib.crc32(spec.instance.encode())
        self.rng = random.Random(seed)
        self.next_tick = self.clock.now + self.period
        self.last_round_end = -1e9
        self.counts = {
            "scale_outs": 0, "scale_ins": 0, "spawns": 0, "spawn_failures": 0,
            "forced": 0,  # of the scale-outs and scale-ins, rounds fogctl scale ordered
            "partial_periods_skipped": 0,  # periods whose input began midway (measured in part): no decision
            "rounds_cancelled": 0,  # rounds whose spawn failed (the round goes on with what started)
            "decision_events": 0, "decision_events_failed": 0,  # published / refused by the event schema
            "lock_events": 0, "lock_events_failed": 0,  # 2-FGME lock events published / refused (schema)
            "lock_events_dropped": 0,  # not published: past LOCK_EVENT_BURST (agent.instance.scaling_events)
            "start_requests": 0,  # idle pings: a copy asking its creator for its Start
            "probes": 0, "adopted": 0,  # orphan copies probed, and adopted (agent.instance.recovery)
            "protocol_resent": 0,  # protocol messages sent again after silence
        }
        self._errors_log = LogLimiter()  # once per sender per minute, bounded (probed names are invented)
        # the copies we started, probe or adopt, and the idle ping of ours (agent.instance.adoption)
        self.idle = IdleCopies(spec, parts.ctx, parts.stats, parts.outputs, parts.router,
                               parts.group_side.start_field, self.core, self.counts, self._errors_log,
                               self.rehomed, self.clock.now)
        self.events = ScalingEvents(spec, parts.ctx, self.counts)  # decision records and events, lock events
        self.activated_at: Optional[float] = None  # wall time of our Start (rescale breakdown)
        self.creates = CreateRequests(spec, self.counts)  # the round's createNode() requests
        self._reminded: Dict[str, float] = {}  # departed neighbour -> when we last re-sent its deletion ack

    def _rounds_above_dead_incarnation(self, min_epoch: int) -> None:
        """Re-homed (agent.node.rehome): the dead incarnation's round numbers went with its
        state, and each neighbour remembers the last round of ours it applied (RoundMemory): a
        round numbered from 1 again looks like a repeat, is acked and NOT applied (a re-homed
        copy's Deletion acked by a predecessor that then keeps routing records to it after it
        left, docs/reliability.md). We start above any round it used: `min_epoch` is wall-clock
        seconds, and no incarnation runs a thousand rounds a second."""
        self.core.round = max(self.core.round, min_epoch * 1000)

    @property
    def data_enabled(self) -> bool:
        """An idle (not yet started) instance buffers its input: its succs are unknown."""
        return self.core.state is not InstanceState.IDLE

    @property
    def terminated(self) -> bool:
        return self.core.state is InstanceState.TERMINATED

    @property
    def blocked(self) -> bool:
        """Protocol messages wait while earlier outputs run (the order of effects). Except while
        our deletion round's Drain waits for our input to empty: every predecessor has removed
        us, so only repeats come now (the second ack of a re-sent Deletion, a counted no-op) and
        successors' rounds (their duplication acks go ahead of the Drain: `_ahead_of_drain`);
        held, one held the data behind it, which the Drain waits for: a departing copy for ever
        (docs/reliability.md)."""
        return bool(self.outputs) and not self.draining

    @property
    def duplicating(self) -> bool:
        """Our own duplication round waits for its acks."""
        return self.core.state is InstanceState.DUPLICATING

    @property
    def lock_pending(self) -> bool:
        """A decision waits for its 2-FGME locks (coordination = "fgme"): decide nothing new."""
        return getattr(self.core, "intent", None) is not None

    def knows(self, sender: str) -> bool:
        """Is `sender` an instance our tables, our rounds or our round memory name? (Who may send
        us protocol and lock messages, besides the channels we already have: Instance._admit.)"""
        core = self.core
        return (sender in core.preds or sender in core.succs or sender == core.creator
                or sender in core.pending or sender in core.new_siblings
                or sender in core.preds_to_add or sender in core.succs_to_add
                or sender in core.preds_to_delete or sender in core.succs_to_delete
                or self.idle.knows(sender)
                or sender in self.memory.applied or sender in self.creates.waiting.values()
                or sender in self.round_created)

    # ---- a decision: the tick, the policy or a steering request, a keyed leaver, an adoption -----

    @emits
    def maybe_tick(self, now: float) -> None:
        self._cmds += self.idle.probe_expected(now)
        moving = self._moving()  # a keyed move under way, or leaving: no round of ours starts
        if not moving:
            self._run_forced(now)
        self._maybe_adopt()
        self.resend_silent(now)
        if self.links is not None:
            self._send_link(self.links.due(now))
        if moving or now < self.next_tick:
            return
        load = self.parts.load.measure(now)
        sig = self.parts.load.take_signals(now)
        self.next_tick = now + self.period
        # DEVIATION (docs/scaling.md): input that began during this period (the first records
        # after a start, a restart or a period without any) was counted over only part of it:
        # 60/s arriving from mid-period measure 30/s, and the decision asks for too few copies.
        began = load > 0 and not self.had_input
        self.had_input = load > 0
        if self.policy == "none" or self.parts.is_source or self.parts.life.stopping or self.pinned:
            return
        if self.outputs or self.core.in_round or self.lock_pending or now - self.last_round_end < self.cooldown:
            return

        if self.core.state is not InstanceState.ACTIVE:
            return
        if self.skip_decisions > 0:
            self.skip_decisions -= 1  # this period's load was measured only partly (activation)
            return
        if began:
            self.counts["partial_periods_skipped"] += 1
            log.info("input began during this period (%.1f/s measured over part of it): deciding next period",
                     load, extra=self.parts.ctx)
            return
        self.round_created = []
        draw = self.rng.random()
        if self.live is not None:
            decision = self.live.decide(PeriodInputs(now, load, sig.processed_rate, self.parts.load.capacity.value,
                                                     sig.backpressure, self.core.keeper, draw, self.clock.wall()))
        else:
            decision = self.core.decide(load, draw)
        if decision.action is Action.TERMINATE and (self.adoption_pending or now < self.idle.late_until):
            decision = Decision(Action.NONE, 0)  # after the adoption (adoption_pending) or a late copy's ping
        if decision.scales:
            self.log.decided(self.clock.now)
        if self._leave_first(decision):
            self.counts["scale_ins"] += 1
            self.decisions.append({"at": self.clock.wall(), "kind": "scale_in", "load": round(load, 1), "new": []})
            return
        outs = self.core.start_round(decision)
        self._observe(outs)
        self._cmds += self.events.decision(now, self.clock.wall(), load, draw, decision, outs, self._capacity(),
                                           self.live)
        if outs:
            new = [o.instance_id for o in outs if isinstance(o, CreateInstance)]
            kind = "scale_out" if new else "scale_in"
            self.counts["scale_outs" if kind == "scale_out" else "scale_ins"] += 1
            self.decisions.append({"at": self.clock.wall(), "kind": kind, "load": round(load, 1), "new": new})
            log.info("decision %s at load %.1f/s (capacity %.0f)%s", kind, load, self._capacity(),
                     f" {self.live.last}" if self.live is not None else "", extra=self.parts.ctx)
            self.last_round_end = now
        self._queue(outs)

    def _capacity(self) -> float:
        """The capacity this instance's policy compares with: live for the Gesscale policies."""
        return self.parts.load.capacity.value if self.live is not None else self.params.capacity

    def force(self, action: str, count: int) -> None:
        """A steering request (fogctl scale/drain via the agent): queued, run by `_run_forced`
        through the same protocol as an automatic decision. One duplication round per copy."""
        if action == "duplicate":
            self.forced.extend(("duplicate", 1) for _ in range(max(1, int(count))))
        elif action == "terminate":
            self.forced.append(("terminate", 1))
        else:
            log.warning("unknown scale action %r ignored", action, extra=self.parts.ctx)

    def _run_forced(self, now: float) -> None:
        """The steering request at the head of `forced` as a round, when we are free to start one."""
        if not self.forced or self.outputs or self.parts.life.stopping or self.lock_pending or self._moving():
            return
        if self.core.state is not InstanceState.ACTIVE:
            if self.core.state is not InstanceState.IDLE and not self.core.in_round:
                self.forced.clear()  # leaving or gone: nothing more to do
            return
        if self.forced[0][0] == "terminate" and self.adoption_pending:
            return  # after the adoption (see adoption_pending)
        action, count = self.forced.popleft()
        decision = Decision(Action.DUPLICATE if action == "duplicate" else Action.TERMINATE, count)
        at = self.clock.wall()
        if self._leave_first(decision):
            # recorded as the policy's path records it: `stamp_moved` times the leaver's groups
            # against it (without it a forced scale-in of a keyed instance had no decision)
            self.counts["scale_ins"] += 1
            self.counts["forced"] += 1
            self.decisions.append({"at": at, "kind": "scale_in", "forced": True, "new": []})
            return
        self.round_created = []
        self.log.decided(self.clock.now)
        try:
            outs = self.core.start_round(decision)
        except LocalProtocolError as exc:
            log.warning("forced %s refused: %s", action, exc, extra=self.parts.ctx)
            self._observe([])
            return
        self._observe(outs)
        kind = "scale_out" if action == "duplicate" else "scale_in"
        self.counts["scale_outs" if kind == "scale_out" else "scale_ins"] += 1
        self.counts["forced"] += 1
        new = [o.instance_id for o in outs if isinstance(o, CreateInstance)]
        self.decisions.append({"at": self.clock.wall(), "kind": kind, "forced": True, "new": new})
        self.last_round_end = now
        self._queue(outs)

    def _moving(self) -> bool:
        """A keyed instance with a move under way, or leaving (agent.instance.moves): no other
        round starts; a leaver's deletion starts once it holds no group (`_leave_when_empty`)."""
        mv = self.parts.moves
        if mv is None:
            return False
        if mv.leaving:
            self._leave_when_empty()
            return True
        return mv.member.busy()

    def _leave_first(self, decision: Decision) -> bool:
        """A keyed instance decided to terminate: its groups go first (to the keeper, which
        never leaves); the Deletion round waits until it holds none. True: the round waits."""
        mv = self.parts.moves
        if mv is None or decision.action is not Action.TERMINATE or self.core.keeper:
            return False
        mv.leaving = True
        keeper = f"{self.parts.spec.pipeline}.{self.parts.spec.operator}.0"
        log.info("leaving: handing %d key groups to %s first", len(mv.member.owned), keeper, extra=self.parts.ctx)
        self._cmds += mv.hand_rest(keeper, self.core.preds)
        self.parts.cadence.changed()
        self._leave_when_empty()
        return True

    def _leave_when_empty(self) -> None:
        mv = self.parts.moves
        assert mv is not None
        if self.outputs or self.core.state is not InstanceState.ACTIVE or self.lock_pending:
            return
        if mv.member.owned and not mv.member.busy():
            # a group that reached us after we decided (a share in flight): handed on as well
            self._cmds += mv.hand_rest(f"{self.parts.spec.pipeline}.{self.parts.spec.operator}.0", self.core.preds)
        if not mv.ready_to_leave():
            return
        mv.leaving = False
        self._cmds += mv.installed_again()
        self.round_created = []
        # start_round, not start_deletion: with coordination = "fgme" the deletion waits for its
        # 2-FGME locks like any other round (start_deletion would run it outside them)
        outs = self.core.start_round(Decision(Action.TERMINATE, 1))
        self._observe(outs)
        self.last_round_end = self.clock.now
        log.info("every key group handed over: leaving", extra=self.parts.ctx)
        self._queue(outs)

    def _maybe_adopt(self) -> None:
        """Start an orphaned copy (agent.instance.adoption: echoed our probe) when we are free to
        start a round."""
        if (not self.idle.orphans or self.outputs or self.parts.life.stopping or self.lock_pending
                or self.core.state is not InstanceState.ACTIVE):
            return
        copy_id = self.idle.next_orphan()
        self.round_created = []
        outs = self.core.adopt(copy_id)
        self._observe(outs)
        self.counts["adopted"] += 1
        log.warning("adopting %s, an idle copy of an earlier incarnation: announcing it again", copy_id,
                    extra=self.parts.ctx)
        self._queue(outs)

    # ---- a round: its outputs, strictly in order -------------------------------------------------

    def _observe(self, outs: List[Any]) -> None:
        """After every core call: record round start/end and lock transitions, publish the lock
        events. Runs before `outs` are performed (see agent.instance.rounds on why that makes the
        recorded round intervals of neighbours disjoint whenever the protocol is right)."""
        trans, edge = self.log.observe(self.core, self.clock.now, self.clock.wall())
        if edge == "start":
            self.round_created = []
        elif edge == "end":
            self.last_round_end = self.clock.now
            self.stamp_decision("round_end_at")
        for t in trans:
            self._cmds += self.events.lock_event(t, self.clock.now, self.clock.wall())
        if trans or edge:
            self.parts.cadence.changed()

    def _queue(self, outs: List[Any], ahead: bool = False) -> None:
        if outs:
            if ahead and all(isinstance(o, Send) and isinstance(o.message, DuplicationAck) for o in outs):
                self.outputs.extendleft(reversed(outs))
            else:
                self.outputs.extend(outs)
            self.parts.cadence.changed()
            # Write-ahead (agent.instance.recovery): the core's new state and the outputs still to
            # perform reach the disk before any of them is performed.
            self._persist()
            self.run_outputs(self.clock.now)

    @emits
    def run_outputs(self, now: float) -> None:
        """Perform the queued outputs in order, until one must wait (createNode(), a Drain)."""
        parts = self.parts
        while self.outputs:
            out = self.outputs[0]
            if isinstance(out, Send):
                # INVARIANT 6 (the paper's message cost): exactly the core's Sends go out, one
                # envelope each; data acks and heartbeats are separate (data plane, control pipe).
                # 2-FGME lock messages travel the same way but are counted apart, by kind.
                body = out.message.to_dict()
                if out.message.type == "start":
                    body = with_groups(parts.group_side.start_field, body, out.dest)
                if self.links is not None:
                    body = self.links.stamp(out.dest, body, now)
                self._send(out.dest, Kind.PROTO, body)
                self._round_clock[out.dest] = now
                if out.message.type == "start":
                    self.idle.started.append(out.dest)
                    if parts.moves is not None:  # a keyed creator's share starts moving
                        self._cmds += parts.moves.start_share(out.dest, self.core.preds)
                inner = getattr(out.message, "inner", None)
                if inner is None:
                    parts.stats["protocol_out"] += 1
                else:
                    parts.stats["lock_out"] = parts.stats.get("lock_out", 0) + 1
                    self.lock_counts["out"][inner.kind] = self.lock_counts["out"].get(inner.kind, 0) + 1
            elif isinstance(out, RoutesChanged) or isinstance(out, Activate):
                # INVARIANT 3: the data path switches tables here, before any later Send (ack).
                parts.outputs.set_routes(out.succs, now)
                if isinstance(out, Activate):
                    if self.activated_at is None:
                        self.activated_at = self.clock.wall()
                    # DEVIATION (docs/scaling.md): the load of the period we were activated in is
                    # partial, so the first decision would scale a fresh copy straight back in.
                    self.skip_decisions = 1
            elif isinstance(out, CreateInstance):
                # INVARIANT 2: the Sends announcing this instance wait until the agent says it is
                # subscribed ("spawned" arrives only after the new worker's "ready").
                # Every copy at the head of the queue is requested at once, so the agent starts
                # them in parallel: one after another, each waited for its own "spawned" and
                # all but the first missed the pre-started worker (~0.34 s per copy measured);
                # the Sends still wait for every answer (on_spawned).
                if not self.creates.waiting:
                    for o in list(self.outputs):
                        if not isinstance(o, CreateInstance):
                            break
                        self._cmds += self.creates.request(o)
                return  # waiting for "spawned"
            elif isinstance(out, Drain):
                # Two-phase deletion: every predecessor removed us; forward everything first.
                self._cmds += parts.flush(now, True)
                if not parts.drained():
                    self.draining = True
                    return
                self.draining = False
            elif isinstance(out, Terminate):
                # INVARIANT 4 (drain before exit): the instance's loop still finishes draining first
                parts.life.terminate(now, float(parts.spec.extra.get("drain_timeout", 30.0)),
                                     "terminated by the scaling protocol")
                self.counts["terminated"] = 1
            self.outputs.popleft()

    @emits
    def on_spawned(self, msg: Dict[str, Any]) -> None:
        """The agent's answer to a createNode(): every answer in, the round goes on or shrinks."""
        instance = self.creates.answered(msg)
        if instance is None:
            log.warning("unexpected spawned reply %s ignored", msg, extra=self.parts.ctx)
            return
        if msg.get("ok"):
            self.stamp_decision("spawned_at")
            if instance not in self.round_created:
                self.round_created.append(instance)
        self.parts.cadence.changed()
        if self.creates.waiting:
            return  # the other copies' answers first: every copy is either created or refused
        errors = self.creates.take_errors()
        if errors:
            # The announcement must not go out for an instance that does not exist. Retrying
            # while holding the round's messages stalled the neighbours, so withdraw the round
            # (or shrink it to the copies that exist): nothing was announced yet.
            self._cancel_round("; ".join(errors))
            return
        while self.outputs and isinstance(self.outputs[0], CreateInstance):
            self.outputs.popleft()  # every copy requested at once is done
        self.run_outputs(self.clock.now)

    def _cancel_round(self, why: str) -> None:
        """A create was refused: the round shrinks to the copies that exist, or is withdrawn."""
        core = self.core
        mine = core.instance_id
        # The round's outputs sit at the head of the queue: its creates, then its announcements.
        while self.outputs:
            out = self.outputs[0]
            if isinstance(out, CreateInstance) and out.creator == mine:
                self.outputs.popleft()
            elif (isinstance(out, Send) and isinstance(out.message, Duplication)
                  and out.message.sender == mine and out.message.round == core.round):
                self.outputs.popleft()
            else:
                break
        created = tuple(self.round_created)
        self.round_created = []
        replacement = core.cancel_duplication(created=created)
        self._observe(replacement)
        self.outputs.extendleft(reversed(replacement))
        self.counts["rounds_cancelled"] += 1
        # At max_instances (agent.node.bounds) a loaded instance asks again every period and
        # is refused: the bound working, not a failure, so not a warning each period.
        level = logging.INFO if all(e.startswith("max_instances reached") for e in why.split("; ")) else logging.WARNING
        log.log(level, "spawn failed (%s): duplication round %d %s", why, core.round,
                f"continues with {list(created)}" if created else "cancelled", extra=self.parts.ctx)
        self._cmds.append(Emit("round_cancelled", {"round": core.round, "created": list(created), "error": why}))
        self.run_outputs(self.clock.now)

    # ---- input: the neighbours' round and lock messages ------------------------------------------

    @emits
    def handle(self, env: Envelope) -> None:
        """A neighbour's protocol or lock message (a probe or its echo: the idle copies')."""
        stats = self.parts.stats
        if isinstance(env.body, dict) and env.body.get("type") in (PROBE, PROBE_ECHO):
            self._cmds += self.idle.on_probe(env, self.clock.now)
            return
        if self.links is not None:
            try:
                body, replies = self.links.receive(env.sender, env.body, self.clock.now)
            except LinkError as exc:
                stats["protocol_errors"] += 1
                if self._errors_log.allow(env.sender, self.clock.now):
                    log.warning("protocol message from %s rejected: %s", env.sender, exc, extra=self.parts.ctx)
                return
            self.parts.cadence.changed()
            self._send_link(replies)
            if body is None:
                return  # a link ack, a copy, or a message past a gap (it comes again in order)
            env = replace(env, body=body)
        is_lock = isinstance(env.body, dict) and env.body.get("type") == LockMessage.type
        if is_lock:
            stats["lock_in"] = stats.get("lock_in", 0) + 1
            kind = str((env.body.get("inner") or {}).get("kind") if isinstance(env.body.get("inner"), dict) else "?")
            self.lock_counts["in"][kind] = self.lock_counts["in"].get(kind, 0) + 1
        else:
            stats["protocol_in"] += 1
        groups = None
        if isinstance(env.body, dict) and env.body.get("type") == Start.type and START_FIELD in env.body:
            body = dict(env.body)  # the key-group table next to the paper's fields: not the core's
            groups = body.pop(START_FIELD)
            env = replace(env, body=body)
        try:
            msg = self._from_dict(env.body)
            if msg.sender != env.sender:
                raise ValueError(f"message sender {msg.sender} differs from envelope sender {env.sender}")
            self._round_clock[env.sender] = self.clock.now
            ahead = self._ahead_of_drain(msg)
            again = self.memory.replay_ack(msg, self.core.instance_id, self.core.stage)
            if again is not None:  # a round we applied, sent again by a restarted sender
                self._queue([Send(env.sender, again)], ahead)
                return
            outs = self._core_handles(msg)
            self.memory.applied_now(msg)
            if isinstance(msg, Start):
                self._cmds += self.parts.group_side.on_start_field(groups, self.core.routes()[0], self)
            elif isinstance(msg, Duplication) and msg.stage == self.core.stage - 1:
                self._preds_changed(msg.new_instances, ())
            elif isinstance(msg, Deletion) and msg.stage == self.core.stage - 1:
                self._preds_changed((), (msg.sender,))
        except (ProtocolError, ValueError) as exc:
            # Unexpected or invalid: counted, logged once per sender, state unchanged.
            stats["protocol_errors"] += 1
            if self._errors_log.allow(env.sender, self.clock.now):
                log.warning("protocol message from %s rejected: %s", env.sender, exc, extra=self.parts.ctx)
            self._left_behind(env.body)
            return
        if is_lock:
            self.parts.cadence.changed()  # the lock state changed even when nothing is sent
        self._observe(outs)
        self._queue(outs, ahead)
        if self.links is not None and getattr(self.core, "departed", None) and self.core.departed(env.sender):
            self._send_link(self.links.forget(env.sender))

    def _core_handles(self, msg: Any) -> List[Any]:
        """The core applies a neighbour's message. What a duplication round learns here stays
        with the core until the round ends: among it the neighbours that leave after they acked
        our round (`ScalingCore.leavers`), which our copies' Start names, since those neighbours
        send our copies their Deletion and wait for their acks."""
        return self.core.handle(msg)

    def _ahead_of_drain(self, msg: Any) -> bool:
        """Does our ack of `msg` go before our deletion round's Drain, which waits at the head of
        the queue? Only the ack of a Duplication whose copies our tables already name: a
        departing instance adds no neighbour (docs/scaling.md deviation 7), so its ack waits
        for no route change (invariant 3), and our second-phase Deletion goes to those copies
        too. Behind the Drain it could wait for ever: our records to such a copy, idle, are
        acked only once it starts, which waits for our ack. A copy we do not know gets no
        record of ours, so nothing waits; acked first, though, its creator would start it
        naming us, and we would leave without telling it: its own Deletion would wait for us
        for ever (CHANGELOG.md, "Records lost at an idle sink copy"). A
        deletion ack keeps its place: it promises the leaver that nothing of ours follows it."""
        core = self.core
        return (self.draining and bool(self.outputs) and isinstance(self.outputs[0], Drain)
                and self.acks_ahead_of_drain and isinstance(msg, Duplication)
                and set(msg.new_instances) <= (core.succs if msg.stage == core.stage + 1 else core.preds))

    def _left_behind(self, body: Any) -> None:
        """A deletion ack our core has no round for, and we were re-homed: the dead incarnation
        was leaving (its Deletion went out before its node died) and that neighbour has removed
        us. Our rebuilt tables cannot know it (agent.node.rehome), so without this we stay an
        active instance some neighbours no longer route to (CHANGELOG.md, "A copy re-homed
        while leaving"). We leave again: a deletion round of our own, which
        the neighbours that removed us already just ack (a Deletion of an instance not in a
        table is acked, agent.protocol.scaling), and which removes us from the others. A
        keeper never sends a Deletion, so an ack naming one is not believed."""
        if (not self.rehomed or self.core.keeper or not isinstance(body, dict)
                or body.get("type") != DeletionAck.type or ("terminate", 1) in self.forced
                or self.core.state not in (InstanceState.ACTIVE, InstanceState.DUPLICATING)):
            return
        self.forced.appendleft(("terminate", 1))
        self.counts["left_behind"] = self.counts.get("left_behind", 0) + 1
        log.warning("a neighbour acked a deletion of our dead incarnation: leaving again", extra=self.parts.ctx)

    @emits
    def remind_departed(self, sender: str) -> None:
        """`sender` announces a new incarnation (an empty ack in a new epoch) though it left our
        tables by its own Deletion (no other round removes an instance, and our round memory
        holds the last round of it we applied): it may be a copy re-homed in the middle of its
        deletion that does not know it left. The ack of that round again tells it
        (`_left_behind`); an instance that knows its rounds rejects it, harmless. At most once
        per RESEND_AFTER per sender, and only for names our round memory holds (bounded)."""
        core = self.core
        rnd = self.memory.applied.get(sender)
        if (rnd is None or sender in core.succs or sender in core.preds or core.state is InstanceState.IDLE
                or self.clock.now - self._reminded.get(sender, -1e9) < RESEND_AFTER):
            return
        self._reminded = {s: t for s, t in self._reminded.items() if self.clock.now - t < RESEND_AFTER}
        self._reminded[sender] = self.clock.now
        self.counts["departed_reminded"] = self.counts.get("departed_reminded", 0) + 1
        self._queue([Send(sender, DeletionAck.trusted(sender=core.instance_id, stage=core.stage, round=rnd))])

    # ---- what an output does, through the instance's parts ----------------------------------------

    def _send(self, dest: str, kind: Kind, body: Any) -> None:
        """On the channel to `dest`, numbered with the data (invariant 1)."""
        self._cmds += self.parts.outputs.send_envelope(dest, kind, body)

    def _persist(self) -> None:
        """Write-ahead (agent.instance.recovery): our state and the instance's channels, now."""
        save = self.parts.incarnation.write(self.clock.now, True, self)
        if save is not None:
            self._cmds.append(save)

    def _preds_changed(self, added: Tuple[str, ...], removed: Tuple[str, ...]) -> None:
        """A predecessor's round, applied: a departed one's watermark no longer holds ours back
        (its deletion is behind its data), and our key groups' moves learn of it (group_side)."""
        if self.parts.marks is not None:
            self.parts.marks.preds_removed(removed, self.clock.now)
        self._cmds += self.parts.group_side.preds_changed(added, removed)

    # ---- recovery: silence, reliable links, what a restart needs ---------------------------------

    @emits
    def resend_silent(self, now: float) -> None:
        """Send the round message again to pending neighbours silent for RESEND_AFTER s (they
        may have crashed between applying it and acking, or the broker lost it); never while
        outputs are queued. Also, once, to the copies such a neighbour announced before it
        acked our round (`ScalingCore.widen_round`: it may have started them without it). A
        neighbour that left meanwhile is not waited for any more (`ScalingCore.release`)."""
        if self.outputs or not self.core.in_round or self.links is not None:
            return  # with links, every message is resent until acked (ReliableLinks)
        for dest, msg in silent_pending(self.core, self._round_clock, now):
            if self.outputs or not self.core.in_round or dest not in self.core.pending:
                return  # a release below ended the round, or its outputs wait
            left = self._release_leaver(dest)
            if left is not None:
                self.counts["leavers_released"] = self.counts.get("leavers_released", 0) + 1
                log.warning("%s left (its Deletion applied) without answering round %d: not waiting for it",
                            dest, self.core.round, extra=self.parts.ctx)
                self._observe(left)
                self._queue(left)
                self.parts.cadence.changed()
                continue
            extra = self._widen_round(dest)
            if extra:
                self._persist()  # they are pending now: their acks must find them after a crash
                log.warning("%s announced %s before it acked our round: sending them our %s too", dest,
                            ", ".join(extra), msg.type, extra=self.parts.ctx)
            for to in (dest,) + extra:
                self._send(to, Kind.PROTO, msg.to_dict())
                self._round_clock[to] = now
                self.counts["protocol_resent"] += 1
            log.warning("no answer from %s for %.0fs in round %d: sent %s again", dest,
                        RESEND_AFTER, self.core.round, msg.type, extra=self.parts.ctx)

    def _release_leaver(self, dest: str) -> Optional[List[Any]]:
        """The round's outputs if the silent pending neighbour `dest` has left (its Deletion
        applied, `ScalingCore.release`): it will never ack our round, and waiting for it would
        hold the round, and the records behind its outputs, for ever. None while it is still
        one of ours."""
        return self.core.release(dest)

    def _widen_round(self, dest: str) -> Tuple[str, ...]:
        """The copies silent `dest` announced before it acked our round (`ScalingCore.widen_round`),
        now pending too: it may have started them without our round message, and only ours
        tells them of our change."""
        return self.core.widen_round(dest)

    def _send_link(self, pairs: List[Tuple[str, Dict[str, Any]]]) -> None:
        """Link acks and resends (agent.instance.recovery.ReliableLinks). The state is written
        first: an ack must never leave before the deliveries it acknowledges are on disk."""
        if not pairs:
            return
        self._persist()
        for dest, body in pairs:
            self._send(dest, Kind.PROTO, body)

    @emits
    def resync(self, now: float) -> None:
        """We are a new incarnation: ask every peer for what we may have lost, resend ours."""
        if self.links is not None:
            core = self.core
            self._send_link(self.links.resync(set(core.preds) | set(core.succs), now))

    @emits
    def ack_links(self) -> None:
        """Terminated: ack what we delivered (the exit waits until our own messages are acked too)."""
        if self.links is not None:
            self._send_link(self.links.flush_acks())

    def persisted(self) -> Dict[str, Any]:
        """What a restarted worker needs to finish a round: the core, the outputs not yet
        performed, the rounds applied per sender, the copies created in the current round."""
        return {"scaling": self.core.snapshot(), "outputs": encode_outputs(self.outputs),
                "rounds_applied": dict(self.memory.applied), "round_created": list(self.round_created),
                **({"links": self.links.dump()} if self.links is not None else {})}

    # ---- idle copies (agent.instance.adoption), as the instance and its admission ask ------------

    @property
    def adoption_pending(self) -> bool:
        """A copy that may be ours waits for its Start: no scale-in meanwhile (`IdleCopies.pending`)."""
        return self.idle.pending

    def expire_probes(self, now: float) -> None:
        for copy in self.idle.expire_probes(now, self.knows):
            if self.parts.delivery.forget(copy):  # its entries, unless something of it still waits
                self.parts.cadence.changed()

    # ---- records (agent.instance.scaling_events) and counters ------------------------------------

    @property
    def decisions(self) -> Deque[Dict[str, Any]]:
        """Our recent decisions (bench, demo; `ScalingEvents.decisions`)."""
        return self.events.decisions

    def stamp_decision(self, key: str) -> None:
        self.events.stamp(key, self.clock.wall())

    def stats(self) -> Dict[str, Any]:
        s: Dict[str, Any] = dict(self.counts, state=self.core.state.value, keeper=self.core.keeper,
                                 preds=sorted(self.core.preds), decisions=list(self.decisions),
                                 capacity=self.params.capacity, coordination=self.coordination, policy=self.policy)
        if self.live is not None:
            s["live_decision"] = self.live.last
        s.update(self.log.stats(self.core))
        if self.coordination == "fgme":
            s["lock_messages"] = {d: dict(c) for d, c in self.lock_counts.items()}
        if self.links is not None:
            s["links"] = dict(self.links.counts, unacked=self.links.unacked())
        return s
