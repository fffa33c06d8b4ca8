"""The node's table of its workers as its decisions read it: a worker's record, its status, how
it exited, and the `WorkerTable` the supervisor is to them.

Why apart from agent.node.supervisor: the parts that decide (agent.node.core and the parts it
holds) read and command the workers, but must not import what starts processes and threads;
they are typed against `WorkerTable`, which the supervisor implements and a test replaces.

Rules of this file: types and values only; no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple

from agent.instance.spec import InstanceSpec

# Exit statuses of a worker as the supervisor classifies them.
WORKER_EXIT_OK = 0
WORKER_EXIT_BAD_SPEC = 2  # the worker cannot load its spec or pipeline: restarting will not help


class WorkerStatus(enum.Enum):
    STARTING = "starting"  # process started, inbox not yet subscribed (no "ready" yet)
    ACTIVE = "active"  # "ready" received; heartbeats expected
    TERMINATING = "terminating"  # asked to stop, or announced its exit; draining


@dataclass
class Worker:
    spec: InstanceSpec
    proc: Any  # the process: subprocess.Popen, or agent.node.forked.ForkedProcess (agent.node.supervisor)
    started_at: float
    status: WorkerStatus = WorkerStatus.STARTING
    last_heartbeat: float = 0.0
    stats: Dict[str, Any] = field(default_factory=dict)
    exit_event: Optional[Dict[str, Any]] = None  # the worker's own "exit" line, if it sent one
    stop_sent_at: Optional[float] = None
    term_sent_at: Optional[float] = None
    kill_sent_at: Optional[float] = None
    killed_for: Optional[str] = None  # why the supervisor killed it (hung, start timeout)
    bad_lines: int = 0
    stdin_broken: bool = False
    # The members of its chain process, upstream first (docs/runtime.md, "Chaining"), or () for a
    # process of its own. Members share `proc`; their control lines carry "member".
    chain: Tuple[str, ...] = ()
    asked_to_stop: bool = False  # `stop` named it (a chain's other members stop with it, unasked)
    eof: bool = False  # the loop handled the end of its stdout (`handle_eof`)
    exited_at: Optional[float] = None  # when `poll` first saw the process gone
    # Forked by the fork server (agent.node.forked): seconds since that server started; None for
    # a cold start (an interpreter start and the imports). The "spawned" event says it.
    warm_age: Optional[float] = None

    @property
    def instance(self) -> str:
        return self.spec.instance

    @property
    def pid(self) -> int:
        return int(self.proc.pid)


@dataclass(frozen=True)
class Reaped:
    """A worker process that has exited, and how."""

    worker: Worker
    returncode: int

    @property
    def clean(self) -> bool:
        """Exited on its own terms: announced its exit (terminated after draining) with status 0."""
        return self.returncode == WORKER_EXIT_OK and self.worker.exit_event is not None

    @property
    def crashed(self) -> bool:
        """Died without being asked to and without announcing it (restart candidate)."""
        w = self.worker
        return w.exit_event is None and w.stop_sent_at is None


class WorkerTable(Protocol):
    """What the node's decisions may read and ask of its workers (agent.node.supervisor.Supervisor)."""

    workers: Dict[str, Worker]

    def start(self, spec: InstanceSpec, now: float) -> Worker: ...

    def start_chain(self, specs: Sequence[InstanceSpec], now: float) -> Any: ...

    def send(self, target: str, event: str, /, **fields: Any) -> bool: ...

    def stop(self, instance: str, now: float) -> None: ...

    def kill(self, instance: str, now: float, reason: str) -> None: ...

    def get(self, instance: str) -> Optional[Worker]: ...

    def __len__(self) -> int: ...

    def __contains__(self, instance: object) -> bool: ...


__all__ = ["WORKER_EXIT_BAD_SPEC", "WORKER_EXIT_OK", "Reaped", "Worker", "WorkerStatus", "WorkerTable"]
