"""A chain: consecutive instances of a pipeline hosted by one worker process (operator chaining).

Why (docs/runtime.md, "Chaining", and issue 26): a worker spends most of its CPU per batch on
paho, the broker round trip, JSON and rebuilding records, and under 1% in the operator. When
consecutive operators of a pipeline run with equal parallelism on one node, one process can host
an instance of each and hand the batches between them in memory: no encode, publish, PUBACK,
broker or decode on that link. Flink chains operators of equal parallelism for the same reason.

What stays exactly as in a worker of one instance: every member is a whole `Worker` with its
own `Instance` (identity, epoch, FIFO channels, credit, replay buffer, acks, scaling core,
persisted state, identity lock) and its own MQTT client and persistent session (its inbox gets
what its other predecessors send, its protocol peers reach it there). Only the envelopes between
members take another road: the instance emits `Handoff` instead of `Publish`, the chain queues
it and delivers it to the member as `EnvelopeHanded`, in order, on the same thread.

The loop: one select over the members' sockets, then per member, upstream first: its transport
events and control lines and its Tick (`Worker.step`), and after each member the hand-offs it
produced (which may produce more: acks). So a batch that the head forwards is processed by the
next member in the same loop turn.

Control channel: the agent's lines to a member carry "member": its id; lines without it go to
every member ("hosts"), except "stop"/"eof", which stop the whole chain upstream first: a member
is told only once every member before it has exited, so no member exits while a predecessor may
still hand it a batch (the predecessor would wait for acks that never come). A chain stops as a
whole; a member is never stopped alone. Every line a member writes carries "member".
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Sequence, TextIO, Tuple

from agent.instance.events import EnvelopeHanded
from agent.mqtt.transport import poll_all
from agent.instance.spec import InstanceSpec
from agent.instance.shell import Worker

log = logging.getLogger("agent.instance.chain")

__all__ = ["Chain"]

STOP_EVENTS = ("stop", "eof")
DISCONNECTED_POLL = 0.05  # a member without a connection reconnects from the loop: wait no longer


class Chain:
    """The shell of several instances in one process; see the module docstring."""

    def __init__(self, specs: Sequence[InstanceSpec], out: TextIO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if len(specs) < 2:
            raise ValueError(f"a chain hosts at least 2 instances, found {len(specs)}")
        ids = [s.instance for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a chain hosts each instance once, found {ids}")
        self.clock = clock
        self.pending: Deque[Tuple[str, Any]] = deque()  # (dest, envelope) handed, not delivered yet
        self.control: Deque[Dict[str, Any]] = deque()  # lines from the agent (the stdin thread)
        self.members: List[Worker] = []
        for spec in specs:  # upstream first (the pipeline's order): the order of every loop turn
            self.members.append(Worker(spec, out, clock=clock, local=frozenset(ids), handoff=self._handoff,
                                       member=True))
        self.by_id: Dict[str, Worker] = {w.spec.instance: w for w in self.members}
        keeps = frozenset(w.spec.instance for w in self.members if getattr(w.core.operator, "keeps_records", False))
        ids_only = frozenset(w.spec.instance for w in self.members if not w.core.reads_records)
        for w in self.members:
            w.core.outputs.local_keeps = keeps - {w.spec.instance}
            w.core.outputs.local_ids_only = ids_only - {w.spec.instance}
        self.stop_event = ""  # "stop" or "eof" once the chain stops (upstream first)
        self.stats: Dict[str, int] = {"handed_after_exit": 0, "unknown_member_lines": 0}

    # ---- start ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Every member subscribes (INVARIANT 2: each says "ready" only after its own SUBACK), then
        each starts; the hand-offs of the starts (a restarted member acks its predecessor in its
        new epoch) are delivered once every member runs."""
        for w in self.members:
            w.subscribe()
        for w in self.members:
            w.begin()
        self._deliver(self.clock())

    # ---- the loop -----------------------------------------------------------------------------------

    @property
    def exited(self) -> bool:
        return all(w.exit_code is not None for w in self.members)

    def exit_code(self) -> int:
        """The process's status: 0 when every member exited 0, else the highest member status."""
        return max(int(w.exit_code or 0) for w in self.members)

    def run(self) -> int:
        while not self.exited:
            self.poll(self._timeout(self.clock()))
            self.step(self.clock())
        return self.exit_code()

    def poll(self, timeout: float) -> None:
        """Wait until a member's socket is readable (or writable with data to write), up to
        `timeout`, then run every member's network loop once without waiting."""
        live = [w for w in self.members if w.exit_code is None]
        poll_all([t for w in live for t in w.transports()], timeout, DISCONNECTED_POLL)

    def _timeout(self, now: float) -> float:
        if self.pending or self.control:
            return 0.0
        return min((w._timeout(now) for w in self.members if w.exit_code is None), default=0.0)

    def step(self, now: float) -> None:
        """One loop turn: route the control lines, then each member's turn (upstream first), each
        followed by the delivery of what it handed over."""
        self._route_control()
        self._stop_next()
        for w in self.members:
            if w.exit_code is None:
                w.step(now)
            self._deliver(now)
        self._stop_next()

    # ---- hand-offs ------------------------------------------------------------------------------------

    def _handoff(self, dest: str, envelope: Any) -> None:
        """A member's `Handoff` command: queued, so that the member finishes its command list first."""
        self.pending.append((dest, envelope))

    def _deliver(self, now: float) -> None:
        while self.pending:
            dest, env = self.pending.popleft()
            w = self.by_id.get(dest)
            if w is None or w.exit_code is not None:
                # Cannot happen with the upstream-first stop; counted if it does. Nothing is lost:
                # the sender keeps a data batch in its replay buffer until it is acked.
                self.stats["handed_after_exit"] += 1
                log.error("hand-off to %s, which is not running here: dropped", dest)
                continue
            w.feed(EnvelopeHanded(env), now)

    # ---- control ----------------------------------------------------------------------------------------

    def _route_control(self) -> None:
        while self.control:
            msg = self.control.popleft()
            event = msg.get("event")
            if event in STOP_EVENTS:
                self.stop_event = self.stop_event or str(event)
                continue
            target = msg.pop("member", None)
            if target is None:
                for w in self.members:
                    w.control.append(dict(msg))
            elif target in self.by_id:
                self.by_id[target].control.append(msg)
            else:
                self.stats["unknown_member_lines"] += 1
                log.warning("control line for %.80r, which this chain does not host, ignored", target)

    def _stop_next(self) -> None:
        """Upstream first: the first member still running is told to stop once (see the module
        docstring); the next one when it has exited."""
        if not self.stop_event:
            return
        for w in self.members:
            if w.exit_code is not None:
                continue
            if not w.core.stopping:
                w.control.append({"event": self.stop_event})
            return

    def abort(self, reason: str) -> None:
        """A second signal while stopping: every member exits at its next turn without draining."""
        for w in self.members:
            if w.exit_code is None:
                w.abort = reason

    def install_signals(self) -> None:
        """SIGTERM/SIGINT: the first stops the chain (upstream first), a second aborts it."""

        def handler(signum: int, frame: Any) -> None:
            if self.stop_event:
                self.abort(f"signal {signum} while draining")
            else:
                self.control.append({"event": "stop"})

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def emit(self, event: str, **fields: Any) -> None:
        """A line from the chain itself, for every member (a start that failed, say)."""
        for w in self.members:
            w._emit(event, **fields)
