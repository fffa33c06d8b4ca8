"""What the scaling driver (agent.instance.driver) records and publishes of its decisions: the
recent decision records with the wall times of their round's steps (bench, demo), a decision
event with the numbers it was drawn from, the retained per-instance decision history `fogctl why`
reads, and the 2-FGME lock events (lock_request / lock_enter / lock_exit).

Rules of this file: sans-IO, part of the `Instance` (agent.instance.core) through its driver. The
part owns its state (the records, the history, the rate limits' clocks) and holds no instance: it is
handed per call the times and what it publishes, and returns its publishes as `Notify` commands
(QoS 0, never on an inbox, so the paper's message cost is untouched); it counts in the driver's
counters. A publish failure is the shell's to count, never fatal.

Why apart from the driver: publishing decides nothing; the driver's rounds never read it back.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from typing import Any, Deque, Dict, List, Optional

from agent import events, topics
from agent.instance.commands import Command, Notify
from agent.policy.decentralized import Action
from agent.protocol.scaling import CreateInstance

__all__ = ["ScalingEvents", "DECISION_EVENT_PERIOD", "LOCK_EVENT_BURST"]

log = logging.getLogger("agent.instance.worker")

DECISION_EVENT_PERIOD = 5.0  # at most one "nothing to do" decision event per instance per 5 s
LOCK_EVENT_BURST = 20  # at most this many lock events per instance per second (6 per round)


class ScalingEvents:
    """Decision records, decision and lock events of one instance (the events rate-limited)."""

    def __init__(self, spec: Any, ctx: Dict[str, Any], counts: Dict[str, int]) -> None:
        self.spec = spec  # the instance's (agent.instance.spec.InstanceSpec): who the events name
        self.ctx = ctx  # the instance's log context
        self.counts = counts  # the driver's counters
        self.history: List[Any] = []  # last decision events (retained for `fogctl why`)
        self._last_none_event = -1e9
        self._last_history_pub = -1e9
        self._lock_events: Deque[float] = deque()  # publish times of the last lock events (rate limit)
        self.decisions: Deque[Dict[str, Any]] = deque(maxlen=32)  # recent decisions (bench, demo)

    def stamp_moved(self, wall: float) -> None:
        """The key groups of our last decision are at their new owners (agent.instance.moves)."""
        d = self.decisions[-1] if self.decisions else None
        if d is not None and "moved_at" not in d:
            d["moved_at"] = wall
            log.info("key groups of the %s decided %.0f ms ago: installed at their new owners", d.get("kind"),
                     (d["moved_at"] - d["at"]) * 1000, extra=self.ctx)

    def stamp(self, key: str, wall: float) -> None:
        """Wall time of a step of the current scale-out round on its decision record (latest
        spawn reply, round end, a keyed creator's first chunks sent): `bench dataplane`/`bench
        rescale` and `demo` split decision -> first record into its parts with it."""
        d = self.decisions[-1] if self.decisions else None
        if d is not None and d.get("kind") == "scale_out" and (key == "spawned_at" or key not in d):
            d[key] = wall  # spawned_at: with several copies, the last reply counts

    def lock_event(self, t: Any, now: float, wall: float) -> List[Command]:
        """A lock_request / lock_enter / lock_exit event (detail.boundary) through the worker's
        single client, QoS 0 like the decision events; never on an inbox, so no protocol cost.
        Rate-limited to LOCK_EVENT_BURST events per second per instance (an instance makes at
        most 6 per round; a flood would mean a bug, counted in `lock_events_dropped`)."""

        etype = t.event_type
        if etype is None:
            return []
        q = self._lock_events
        while q and now - q[0] > 1.0:
            q.popleft()
        if len(q) >= LOCK_EVENT_BURST:
            self.counts["lock_events_dropped"] += 1
            return []
        q.append(now)
        spec = self.spec
        try:
            ev = events.make(etype, ts=wall, node=spec.node, instance=spec.instance,
                             operator=spec.operator, pipeline=spec.pipeline,
                             detail={"boundary": t.boundary, "index": t.index, "source": "worker"})
        except ValueError as exc:
            self.counts["lock_events_failed"] += 1
            log.warning("lock event not published: %s", exc, extra=self.ctx)
            return []
        self.counts["lock_events"] += 1
        return [Notify(topics.events(spec.cluster), ev.to_json().encode())]

    def decision(self, now: float, wall: float, load: float, draw: float, decision: Any, outs: List[Any],
                 capacity: float, live: Optional[Any]) -> List[Command]:
        """A decision event with the numbers it was drawn from (load, `capacity` the policy compared
        with, ratio, probability, draw) on the events topic, plus the retained per-instance
        history `fogctl why` reads. `live`: the Gesscale policy (agent.policy.live), if any.

        A `Notify`, through the worker's single client (one owner, docs/design.md section 6);
        never on the inbox path, so the paper's message cost is untouched. Rate-limited: a
        decision that acts is always published, a "nothing to do" one at most every
        DECISION_EVENT_PERIOD s (an instance decides every period; thousands of them would
        flood the topic).
        """

        acted = bool(outs)
        if not acted and now - self._last_none_event < DECISION_EVENT_PERIOD:
            return []
        if not acted:
            self._last_none_event = now
        spec = self.spec
        kind = {Action.DUPLICATE: "scale_out", Action.TERMINATE: "scale_in"}.get(decision.action, "decision")
        if not acted:
            kind = "decision"
        new = [o.instance_id for o in outs if isinstance(o, CreateInstance)]
        try:
            ev = events.decision(
                ts=wall, node=spec.node, instance=spec.instance, operator=spec.operator,
                pipeline=spec.pipeline, load=float(load), capacity=float(capacity),
                probability=(float(decision.factor) if decision.action is not Action.NONE and live is None
                             else None),
                draw=float(draw), action=decision.action.value, count=int(decision.count),
                type=kind, detail=_detail(new, live),
            )
        except ValueError as exc:
            self.counts["decision_events_failed"] += 1
            log.warning("decision event not published: %s", exc, extra=self.ctx)
            return []
        out: List[Command] = [Notify(topics.events(spec.cluster), ev.to_json().encode())]
        self.history = events.remember(self.history, ev)
        if acted or now - self._last_history_pub >= DECISION_EVENT_PERIOD:
            self._last_history_pub = now
            payload = json.dumps([e.to_dict() for e in self.history], sort_keys=True).encode()
            out.append(Notify(topics.decisions(spec.cluster, spec.instance), payload, retain=True))
        self.counts["decision_events"] += 1
        return out


def _detail(new: List[str], live: Optional[Any]) -> Dict[str, Any]:
    detail: Dict[str, Any] = {"source": "worker"}
    if new:
        detail["new"] = new
    if live is not None and live.last is not None:
        detail.update({k: v for k, v in live.last.items() if k != "context"})
    return detail
