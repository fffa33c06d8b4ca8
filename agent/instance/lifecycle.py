"""An instance's lifecycle: its phase, which events each phase accepts, the stop and its drain
deadline, and the exit it has decided (docs/runtime.md, "Instance").

Rules of this file: `Lifecycle` owns these fields and holds no reference to the instance; it is
given the instance's name at construction and per call the time `now` and what it cannot know (the
drain timeout the spec sets, whether everything is drained). No I/O, no clock, no random.

`NEW -(Started | Restarted)-> RUNNING -(stop, eof, or Terminate from the protocol)-> STOPPING
-(drained, or drain timeout, or Abort)-> EXITED`. An event the table `ACCEPTS` does not list for
the current phase raises `LocalProtocolError` naming the phase: the shell broke the contract (a
Tick before Started, anything but publish feedback after Exit).
"""

from __future__ import annotations

from enum import Enum
from typing import Dict, FrozenSet, Optional, Tuple, Type

from agent.instance.events import (
    Abort, Control, EnvelopeHanded, EnvelopeReceived, Event, PubAcked, PublishAccepted, PublishRefused, Restarted,
    SessionLost, Spawned, Started, Tick,
)
from agent.protocol.errors import LocalProtocolError

__all__ = ["Lifecycle", "Phase", "ACCEPTS", "EXIT_OK", "EXIT_CRASH", "EXIT_BAD_SPEC", "EXIT_BROKER",
           "EXIT_DRAIN_TIMEOUT"]

# Exit codes (the agent's supervisor maps them to restart decisions).
EXIT_OK = 0  # drained and exited (stop, or terminated by the protocol)
EXIT_CRASH = 1  # unexpected exception
EXIT_BAD_SPEC = 2  # the spec or the pipeline cannot be loaded: restarting will not help
EXIT_BROKER = 3  # could not connect/subscribe at start
EXIT_DRAIN_TIMEOUT = 4  # stop requested, but successors did not ack everything in time


class Phase(Enum):
    NEW = "new"  # built, not subscribed yet
    RUNNING = "running"
    STOPPING = "stopping"  # draining before exit (stop, eof, or terminated by the protocol)
    EXITED = "exited"  # the Exit command went out


_FEEDBACK: FrozenSet[Type[Event]] = frozenset({PublishAccepted, PublishRefused, PubAcked})
_LIVE: FrozenSet[Type[Event]] = _FEEDBACK | {EnvelopeReceived, EnvelopeHanded, SessionLost, Spawned, Control, Tick, Abort}
# Which events make sense in which phase; anything else is a LocalProtocolError.
ACCEPTS: Dict[Phase, FrozenSet[Type[Event]]] = {
    Phase.NEW: frozenset({Started, Restarted}),
    Phase.RUNNING: _LIVE,
    Phase.STOPPING: _LIVE,
    Phase.EXITED: _FEEDBACK,
}

# (code, reason, final): `final` says gone for good (terminated by the protocol)
ExitDecision = Tuple[int, str, bool]


class Lifecycle:
    """The phase, whether we stop and by when, a termination's reason, the exit decided."""

    def __init__(self, instance: str) -> None:
        self._instance = instance
        self.phase = Phase.NEW
        self.stopping = False
        self._deadline = 0.0  # a stop's drain ends here
        self.final = False  # terminated by the protocol: gone for good when we exit
        self._reason = ""  # the termination's, said at the exit
        self.exit: Optional[ExitDecision] = None  # decided, not performed yet

    def check(self, event: Event) -> None:
        """Raise LocalProtocolError if the current phase does not accept `event`."""
        allowed = ACCEPTS[self.phase]
        if type(event) not in allowed:
            raise LocalProtocolError(
                f"{self._instance}: {type(event).__name__} in phase {self.phase.value}, expected one of "
                f"{sorted(t.__name__ for t in allowed)}")

    def run(self) -> None:
        """Subscribed and started (or restarted)."""
        self.phase = Phase.RUNNING

    def stop(self, now: float, drain_timeout: float) -> bool:
        """Agent shutdown: drain until `now + drain_timeout`, then exit. False if already stopping."""
        if self.stopping:
            return False
        self.stopping = True
        self.phase = Phase.STOPPING
        self._deadline = now + drain_timeout
        return True

    def terminate(self, now: float, drain_timeout: float, reason: str) -> None:
        """Terminated by the scaling protocol: drain, then exit for good, saying `reason`."""
        self.stopping = True
        self.phase = Phase.STOPPING
        self._deadline = now + drain_timeout
        self.final = True
        self._reason = reason

    def check_stopped(self, now: float, done: bool) -> None:
        """Stopping: exit once `done` (drained and, when terminated, the round may end), or at the
        drain deadline."""
        if done:
            self.exit = (EXIT_OK, "stopped", False)
        elif now > self._deadline:
            self.exit = (EXIT_DRAIN_TIMEOUT, "drain timeout: successors did not ack everything", False)

    def due(self) -> Optional[ExitDecision]:
        """The exit to perform now: decided and not performed yet, with a termination's reason
        and finality."""
        if self.exit is None or self.phase is Phase.EXITED:
            return None
        code, reason, final = self.exit
        if code == EXIT_OK and self._reason:
            reason = self._reason
        return code, reason, final or self.final

    def exited(self) -> None:
        self.phase = Phase.EXITED
