"""When a crashed worker starts again here, with the same identity (the daemon's restarts).

Rules of this file: no I/O, no clock, no reference to the daemon. The daemon (agent.node.exits)
reports each crash (`on_crash`), asks before each start whether it waits for the end of the turn
(`hold`), and once per loop turn which delayed restarts are due (`due`) and which held ones to start
(`take`); it starts the processes. Why never give up: a crashed instance is in its neighbours'
routing tables until the protocol removes it, so without it their records towards it wait (nothing
is lost, but it stalls). Why a backoff: a worker that crashes at once again must not take the node's
CPU in a loop: the first MAX_RESTARTS crashes within RESTART_WINDOW restart at once, each further
one waits twice as long as the one before, at most RESTART_BACKOFF_MAX. Why a batch: the members of
a chain (one process, agent.node.chains) die together and are reaped in one poll; queued until the
end of that turn, they start again together as one process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Tuple

from agent.instance.spec import InstanceSpec
from agent.node import chains

MAX_RESTARTS = 3  # immediate restarts of a crashed worker within RESTART_WINDOW; then with backoff
RESTART_WINDOW = 60.0
RESTART_BACKOFF_MAX = 30.0  # seconds: the longest wait before restarting a crash-looping worker


@dataclass(frozen=True)
class Exit:
    """What a worker's exit means here: the cause its "terminated" event names, whether the
    instance is gone for good (`final`: never re-adopted), whether it moves to another node
    (`handover`), whether it starts again here (`restart`: through `Restarts.on_crash`)."""

    cause: str  # "shutdown", "scale_in", "crash", "handover" or "undeploy"
    final: bool
    handover: bool
    restart: bool


def exit_of(*, clean: bool, crashed: bool, said_final: bool, bad_spec: bool, stopping: bool,
            handing_over: bool, fenced: bool, undeployed: bool, chained: bool, asked_to_stop: bool,
            placing: bool) -> Exit:
    """Decide on one worker's exit. `said_final`: it announced its final exit (drained, its
    departure acked), a scale-in even if its process then needed SIGTERM (a disconnect stuck
    while the broker was away); `bad_spec`: it exited with the bad-spec status; `stopping`: the
    agent shuts down; `handing_over`: a keeper stopped by a drain to move; `fenced`: killed because
    another node runs it; `undeployed`: stopped for an undeploy; `chained`, `asked_to_stop`: a
    chain member that stopped only because another member was asked to (a chain stops as a whole)
    is still in its neighbours' tables and starts again; `placing`: a spawn still waited for it to
    be ready, and is answered elsewhere (the next candidate, or a failure the requester places
    again), so it never comes back here as a crash, or one identity would run on two nodes."""
    final = said_final or bad_spec
    handover = handing_over and not final and not stopping
    cause = "shutdown" if stopping else ("scale_in" if clean or said_final else "crash")
    if handover:
        cause = "handover"
    if undeployed:
        cause = "undeploy"
    collateral = chained and not asked_to_stop and not final
    restart = (not handover and (crashed or collateral) and not stopping and not fenced and not undeployed
               and not placing)
    return Exit(cause, final, handover, restart)


class Restarts:
    def __init__(self) -> None:
        self._history: Dict[str, List[float]] = {}  # instance -> its crashes within RESTART_WINDOW
        self.delayed: Dict[str, Tuple[float, InstanceSpec]] = {}  # instance -> (when, spec)
        self._batch: List[InstanceSpec] = []  # chain members to start at the end of this loop turn

    def on_crash(self, spec: InstanceSpec, now: float) -> Tuple[InstanceSpec, int, float]:
        """A worker of `spec` crashed at `now`: (the spec to start again, `restart = true`; its
        crashes within RESTART_WINDOW; the delay). A delay of 0: restart it now (`hold`); else it
        is held here until `due`."""
        history = [t for t in self._history.get(spec.instance, []) if now - t < RESTART_WINDOW]
        history.append(now)
        self._history[spec.instance] = history
        again = dataclasses.replace(spec, restart=True)
        excess = len(history) - MAX_RESTARTS
        if excess > 0:
            delay = min(RESTART_BACKOFF_MAX, 2.0 ** excess)
            self.delayed[spec.instance] = (now + delay, again)
            return again, len(history), delay
        return again, len(history), 0.0

    def hold(self, spec: InstanceSpec) -> bool:
        """True if `spec` waits for the end of this loop turn (`take`): a chain's member; False:
        start it now."""
        if chains.chain_of(spec):
            self._batch.append(spec)
            return True
        return False

    def due(self, now: float) -> List[InstanceSpec]:
        """The delayed restarts whose time has come (no longer held)."""
        out = []
        for inst, (when, spec) in list(self.delayed.items()):
            if now >= when:
                del self.delayed[inst]
                out.append(spec)
        return out

    def take(self) -> List[List[InstanceSpec]]:
        """The chain members held this turn, as processes to start: the members of one chain
        together, upstream first (a member left alone runs alone)."""
        batch, self._batch = self._batch, []
        return chains.group_chains(batch)

    def forget(self, instance: str) -> None:
        """The instance is gone from this node for good (undeployed, moved): no restart pending."""
        self.delayed.pop(instance, None)


__all__ = ["Exit", "MAX_RESTARTS", "RESTART_BACKOFF_MAX", "RESTART_WINDOW", "Restarts", "exit_of"]
