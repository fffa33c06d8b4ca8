"""A worker's exit here and what follows: what the cores that know the instance forget, whether it
is gone for good, moves (a drain's hand-over) or starts again (a crash), and the restarts carried
out (the daemon's worker exits).

Rules of this file: no I/O, no clock, no reference to the daemon. The daemon reaps a worker and
hands over what its exit says (`Exited`) with the time; `Exits` tells the cores that remember
something of the instance (createNode()'s walk, the drain, the fencing, the pins, the restarts,
the host tables), decides with agent.node.restarts.exit_of, and has the node act through
`ExitCalls` (forget its files, publish the event, start processes). It also keeps which instances
an undeploy stopped (`undeploying`): those are forgotten at their exit and never start again.

Why one part for exits and restarts: the same exit decides whether the instance's stored spec
goes, whether its keeper moves or starts again here, and whether the keepers of a drain waiting
for keyed copies may stop now (agent.node.drain); split over the loop, one of these would be
missed by the next kind of exit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Container, Dict, List, Mapping, Optional, Set

from agent.instance.spec import InstanceSpec
from agent.node import spawns
from agent.node.drain import COPIES_FIRST_WAIT, Drain
from agent.node.fencing import Fencing
from agent.node.hostsync import HostSync
from agent.node.pins import Pins
from agent.node.restarts import RESTART_WINDOW, Restarts, exit_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exited:
    """What a reaped worker's exit says (agent.node.workers.Reaped): its spec and last stats,
    the exit status and why (the worker's exit line, the supervisor's kill, or the status),
    `clean` (announced and status 0), `crashed` (died unasked and unannounced), `said_final` (its
    exit line says it left for good), `bad_spec` (the bad-spec status), and, for a chain's
    member, whether it was in a chain and was asked to stop itself."""

    spec: InstanceSpec
    stats: Mapping[str, Any]
    returncode: int
    reason: str
    clean: bool
    crashed: bool
    said_final: bool = False
    bad_spec: bool = False
    chained: bool = False
    asked_to_stop: bool = False

    @property
    def instance(self) -> str:
        return self.spec.instance


@dataclass(frozen=True)
class ExitCalls:
    """What an exit may have the rest of the node do."""

    unhost: Callable[[str], None]  # its stored spec and standby copy go (a hosted record change)
    forget: Callable[[str], None]  # gone from this node for good: also its files and restarts
    spawn: Callable[[spawns.SpawnEvent, float], None]  # to createNode()'s core
    event: Callable[..., None]  # an event of one instance (etype, instance, operator, pipeline, **detail)
    hand_over: Callable[[InstanceSpec, Mapping[str, Any], float], None]  # a drained keeper moves
    start: Callable[[List[InstanceSpec], float], None]  # one process (a chain's: upstream first)
    stop: Callable[[str, float], None]  # ask a running worker to stop
    stopping: Callable[[], bool]  # the agent shuts down


class Exits:
    """The exits of our workers and the restarts they lead to."""

    def __init__(self, node: str, spawning: spawns.Spawns, drain: Drain, fencing: Fencing, pins: Pins,
                 restarts: Restarts, hosts: HostSync, running: Container[str], counters: Dict[str, int],
                 calls: ExitCalls) -> None:
        self.node, self.spawning, self.drain, self.fencing, self.pins = node, spawning, drain, fencing, pins
        self.restarts, self.hosts, self.running, self.counters = restarts, hosts, running, counters
        self.calls = calls
        self.undeploying: Set[str] = set()  # stopped for an undeploy: forgotten, never restarted

    def reaped(self, x: Exited, now: float) -> None:
        """The worker of `x` exited at `now` (its process is reaped): tell the cores, decide, act."""
        inst = x.instance
        placing = self.spawning.cause_of(inst) is not None
        if placing:
            # The spawn that started it is answered elsewhere (the next candidate, or a failure the
            # requester places again): this incarnation must not come back here as a crash, or one
            # identity would run on two nodes (their clients take the session from each other and
            # both consume its inbox: docs/design.md invariant 7).
            self.calls.unhost(inst)
            self.hosts.not_started(inst)  # bound here while it started: not where it runs
            self.calls.spawn(spawns.Exited(inst, x.reason), now)
        handing_over = self.drain.exited(inst)
        if self.drain.copies_first:
            self.release_keepers(now, left=inst)
        fenced = self.fencing.gone(inst)
        undeployed = inst in self.undeploying
        self.undeploying.discard(inst)
        self.pins.forget(inst)
        end = exit_of(clean=x.clean, crashed=x.crashed, said_final=x.said_final, bad_spec=x.bad_spec,
                      stopping=self.calls.stopping(), handing_over=handing_over, fenced=fenced,
                      undeployed=undeployed, chained=x.chained, asked_to_stop=x.asked_to_stop, placing=placing)
        if end.final:
            self.calls.unhost(inst)  # gone for good: never re-adopt, and its standby copy goes with our next record
        if undeployed:
            self.calls.forget(inst)  # again: the state file it wrote while draining
        self.calls.event("terminated", inst, x.spec.operator, x.spec.pipeline, cause=end.cause,
                         code=x.returncode, reason=x.reason, clean=x.clean, stats=x.stats)
        if end.handover:
            self.calls.hand_over(x.spec, x.stats, now)
        elif end.restart:
            self.crashed(x.spec, now)

    def undeployed(self, instance: str) -> None:
        """`instance` stops for an undeploy: at its exit it is forgotten, never restarted."""
        self.undeploying.add(instance)

    def release_keepers(self, now: float, left: Optional[str] = None) -> None:
        """Stop each keeper of a drain that waits for keyed copies (agent.node.drain) once they have
        all left (`left` just exited) or its wait is over."""
        for keeper, copies in self.drain.release(now, left):
            if copies:
                log.warning("copies %s still leaving after %.0f s: %s moves now", sorted(copies), COPIES_FIRST_WAIT,
                            keeper, extra={"node": self.node})
            if keeper in self.running and self.drain.stops(keeper):
                self.calls.stop(keeper, now)

    def crashed(self, spec: InstanceSpec, now: float) -> None:
        """Start a crashed worker again with the same identity, at once or after its backoff
        (agent.node.restarts)."""
        again, crashes, delay = self.restarts.on_crash(spec, now)
        if delay:
            log.error("worker crashed %d times in %.0fs: restarting in %.0fs", crashes, RESTART_WINDOW, delay,
                      extra={"instance": spec.instance})
            return
        self.restart(again, now)

    def restart(self, spec: InstanceSpec, now: float) -> None:
        """A chain's member waits for the end of this loop turn (`tick`): the members of a chain die
        together, are reaped in one poll, and start again together as one process."""
        if self.restarts.hold(spec):
            return
        try:
            self.calls.start([spec], now)
            self.counters["restarts"] += 1
            log.warning("restarted crashed worker (same identity)", extra={"instance": spec.instance})
        except (OSError, ValueError) as exc:
            log.error("cannot restart worker: %s", exc, extra={"instance": spec.instance})

    def tick(self, now: float) -> None:
        """Once per loop turn: the delayed restarts now due (none while the agent stops), then the
        chain members held this turn, one process per chain."""
        if not self.calls.stopping():
            for spec in self.restarts.due(now):
                self.restart(spec, now)
        for group in self.restarts.take():
            try:
                self.calls.start(group, now)
                self.counters["restarts"] += len(group)
                log.warning("restarted crashed worker (same identity)%s",
                            f" as a chain of {len(group)}" if len(group) > 1 else "",
                            extra={"instance": group[0].instance})
            except (OSError, ValueError) as exc:
                log.error("cannot restart chain: %s", exc, extra={"instance": group[0].instance})


__all__ = ["ExitCalls", "Exited", "Exits"]
