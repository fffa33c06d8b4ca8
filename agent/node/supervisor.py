"""The agent's worker processes: start, watch heartbeats, stop with escalation, reap.

Rules of this file: the supervisor never blocks and never decides policy. The daemon's single
event loop calls `start`, `send`, `stop`, `handle_line` and `poll(now)`; the only threads here are
one stdout reader per worker, and they only put lines into the daemon's event queue (gunicorn's
arbiter habit: the loop owns all state). Time is passed in (`now`, monotonic seconds).

Orphans: workers are started in the agent's own process group (so `kill -TERM -<pgid>` and
systemd's control group reach them) and, on Linux, with PR_SET_PDEATHSIG=SIGTERM so that a worker
whose agent died by SIGKILL is told to drain and exit instead of running on unsupervised. Their
stdin is a pipe from the agent: EOF on it is the portable "your agent is gone" signal.

Stop escalation (bound documented in docs/runtime.md): "stop" line at t0 (the worker drains and
exits), SIGTERM at t0 + term_after, SIGKILL at t0 + kill_after.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from agent.instance.spec import InstanceSpec, chain_json, control_line, parse_control_line
from agent.node import forked
from agent.node.forked import ForkedProcess, ForkServer
from agent.node.loopevents import LoopEvent, WorkerEof, WorkerLine
from agent.node.workers import Reaped, Worker, WorkerStatus

log = logging.getLogger(__name__)

WORKER_COMMAND: Tuple[str, ...] = (sys.executable, "-m", "agent.instance.worker")

PR_SET_PDEATHSIG = 1
# A worker that has exited is reaped once the loop has handled the end of its stdout (its last
# lines, the "exit" line among them, come before it), or this long after its exit was seen
# (a pipe kept open by something else). Without it, a worker reaped before its "exit" line was
# read counted as a crash; a forked worker (os._exit, no interpreter teardown) made it common.
EOF_GRACE = 1.0
# A gap this long between two polls (the agent loop runs every 0.2 s) means the agent itself was
# not running: SIGSTOP of the node's processes, a suspended VM, a starved CPU.
STALL_GAP = 2.0


Process = Union[subprocess.Popen, ForkedProcess]


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    # Ctrl-C in the agent's terminal reaches the whole process group: the agent stops its workers
    # itself ("stop", then signals), so a worker ignores SIGINT until it installs its own drain
    # handler (worker._install_signals); without this, a worker still reading its spec (then the
    # pre-started one) died of KeyboardInterrupt with a traceback on every Ctrl-C of `fog-agent
    # run`. The fork server inherits it too, and its forked workers from it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


EventSink = Callable[[LoopEvent], None]


class Supervisor:
    """Owns the worker processes of one agent; see the module docstring for the rules."""

    def __init__(
        self,
        emit: EventSink,
        heartbeat_timeout: float = 5.0,
        start_timeout: float = 20.0,
        term_after: float = 5.0,
        kill_after: float = 10.0,
        command: Sequence[str] = WORKER_COMMAND,
        env: Optional[Dict[str, str]] = None,
        unhealthy_after: Optional[float] = None,
        warm: bool = False,
    ) -> None:
        self._emit = emit
        self.heartbeat_timeout = heartbeat_timeout
        # A heartbeat overdue by this much already counts as unhealthy (the systemd watchdog
        # pauses), well before the worker is declared hung and killed at heartbeat_timeout.
        self.unhealthy_after = min(unhealthy_after, heartbeat_timeout) if unhealthy_after else heartbeat_timeout
        self.start_timeout = start_timeout
        self.term_after = term_after
        self.kill_after = max(kill_after, term_after)
        self.command = tuple(command)
        self.env = env
        self.workers: Dict[str, Worker] = {}
        self._last_poll: Optional[float] = None
        # A fork server that has done a worker's imports (agent.node.forked): every start forks
        # it, so no start pays the interpreter start and the imports (the longest part of
        # "decision -> first record" on a loaded machine), however many come at once
        # (docs/runtime.md, "Pre-started workers"). It is not an instance and holds no slot.
        self.warm = warm and forked.supported(self.command)
        self._server: Optional[ForkServer] = None
        self._warm_retry_at = 0.0
        self._server_closing = False  # close_warm: closed once no worker it forked is left
        self._retired: List[ForkServer] = []  # dropped servers still waiting for their children
        self.warm_used = 0

    # -- starting ------------------------------------------------------------------------------

    def start(self, spec: InstanceSpec, now: float) -> Worker:
        if spec.instance in self.workers:
            raise ValueError(f"instance {spec.instance!r} already runs here (pid {self.workers[spec.instance].pid})")
        proc, age = self._process(now)
        worker = Worker(spec=spec, proc=proc, started_at=now, last_heartbeat=now, warm_age=age)
        self.workers[spec.instance] = worker
        self._write(worker, spec.to_json() + "\n")
        t = threading.Thread(
            target=self._reader, args=(spec.instance, proc.stdout), name=f"stdout-{spec.instance}", daemon=True
        )
        t.start()
        log.info("started worker pid %d", proc.pid, extra={"instance": spec.instance, "operator": spec.operator})
        self.prewarm(now)
        return worker

    def start_chain(self, specs: Sequence[InstanceSpec], now: float) -> List[Worker]:
        """Start consecutive instances in one chain process (agent.instance.chain), upstream
        first: one record per member, sharing the process, its pipe and its fate."""
        ids = tuple(s.instance for s in specs)
        if len(ids) < 2 or len(set(ids)) != len(ids):
            raise ValueError(f"a chain needs 2 or more distinct instances, found {list(ids)}")
        busy = [i for i in ids if i in self.workers]
        if busy:
            raise ValueError(f"instance {busy[0]!r} already runs here (pid {self.workers[busy[0]].pid})")
        proc, _ = self._process(now)
        members = [Worker(spec=s, proc=proc, started_at=now, last_heartbeat=now, chain=ids) for s in specs]
        for w in members:
            self.workers[w.instance] = w
        self._write(members[0], chain_json(list(specs)) + "\n")
        t = threading.Thread(target=self._chain_reader, args=(ids, proc.stdout), name=f"stdout-{ids[0]}+", daemon=True)
        t.start()
        log.info("started chain pid %d: %s", proc.pid, ", ".join(ids), extra={"instance": ids[0]})
        self.prewarm(now)
        return members

    def _chain_reader(self, ids: Tuple[str, ...], stream: Optional[IO[bytes]]) -> None:
        """Reader thread of a chain: forwards each line to the loop as its member's line (a line
        naming no member of this chain is forwarded as the head's, which counts it as junk)."""
        if stream is None:
            return
        try:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", errors="replace")
                member = ids[0]
                try:
                    named = json.loads(text).get("member")
                    if named in ids:
                        member = named
                except (ValueError, AttributeError):
                    pass
                self._emit(WorkerLine(member, text))
        except (OSError, ValueError):
            pass
        for i in ids:
            self._emit(WorkerEof(i))

    def _process(self, now: float) -> Tuple[Process, Optional[float]]:
        """A process forked by the fork server (and how long the server has run), or a cold start
        while there is no server ready (the agent's first seconds, or after a lost server)."""
        server = self._server
        if server is not None and not self._server_closing:
            server.pump()
            if server.ready and not server.lost:
                try:
                    proc = server.fork()
                except OSError as exc:
                    log.warning("fork server (pid %d) failed, starting cold: %s", server.pid, exc)
                    self._drop_server(now)
                else:
                    self.warm_used += 1
                    return proc, max(0.0, now - server.started_at)
        return self._popen(), None

    def _popen(self) -> subprocess.Popen:
        preexec = _pdeathsig if sys.platform.startswith("linux") else None
        return subprocess.Popen(
            list(self.command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # worker logs go to the agent's stderr (journal)
            env=self.env,
            preexec_fn=preexec,
            close_fds=True,
        )

    def prewarm(self, now: float) -> None:
        """Keep the fork server running (if enabled); restarted at most every 5 s."""
        if not self.warm or self._server is not None or now < self._warm_retry_at:
            return
        try:
            preexec = _pdeathsig if sys.platform.startswith("linux") else None
            self._server = ForkServer(self.command, self.env, preexec, now)
        except OSError as exc:
            log.warning("cannot start the fork server: %s", exc)
            self._warm_retry_at = now + 5.0

    def _drop_server(self, now: float) -> None:
        """Close a failed or exited server; a new one is started 5 s later. The workers it forked
        run on; their exit codes then come from their "exit" lines (forked.LOST_STATUS)."""
        server, self._server = self._server, None
        self._warm_retry_at = max(self._warm_retry_at, now + 5.0)
        if server is not None:
            server.pump()
            busy = server.live_children() > 0
            server.close(wait=not busy)
            if busy:
                self._retired.append(server)  # reaped in poll once its children are gone

    def close_warm(self) -> None:
        """No more forks (agent shutdown); the server is closed now if no worker it forked is
        alive, else once the last one has exited (it reports their exits and relays signals)."""
        self._warm_retry_at = float("inf")
        self._server_closing = True
        server = self._server
        if server is not None:
            server.pump()
            if server.live_children() == 0:
                self._server = None
                server.close()

    @property
    def warm_ready(self) -> bool:
        """The fork server has done its imports: the next start is a fork."""
        if self._server is not None:
            self._server.pump()
        return self._server is not None and self._server.ready and not self._server.lost

    @property
    def warm_pid(self) -> Optional[int]:
        """The fork server's pid (None: none running)."""
        return self._server.pid if self._server is not None else None

    def _reader(self, instance: str, stream: Optional[IO[bytes]]) -> None:
        """Reader thread: only forwards lines to the loop (never touches supervisor state)."""
        if stream is None:
            return
        try:
            for raw in iter(stream.readline, b""):
                self._emit(WorkerLine(instance, raw.decode("utf-8", errors="replace")))
        except (OSError, ValueError):
            pass
        self._emit(WorkerEof(instance))

    # -- control channel -----------------------------------------------------------------------

    def handle_line(self, instance: str, line: str, now: float) -> Optional[Dict[str, Any]]:
        """Update the worker's status from one control line; return the parsed message.

        Returns None for a line that is not a control message (counted and logged; a worker that
        prints junk to stdout must not take its agent down).
        """
        worker = self.workers.get(instance)
        if worker is None:
            return None
        line = line.strip()
        if not line:
            return None
        try:
            msg = parse_control_line(line)
        except (ValueError, json.JSONDecodeError):
            worker.bad_lines += 1
            if worker.bad_lines == 1:
                log.warning("worker wrote a non-control line to stdout: %r", line[:120], extra={"instance": instance})
            return None
        event = msg["event"]
        if event == "ready":
            if worker.status is WorkerStatus.STARTING:
                worker.status = WorkerStatus.ACTIVE
            worker.last_heartbeat = now
        elif event == "heartbeat":
            worker.last_heartbeat = now
            stats = msg.get("stats")
            if isinstance(stats, dict):
                worker.stats = stats
        elif event == "exit":
            worker.exit_event = msg
            worker.status = WorkerStatus.TERMINATING
        return msg

    def handle_eof(self, instance: str) -> None:
        """The loop reached a worker's WorkerEof event: every line it wrote has been handled."""
        worker = self.workers.get(instance)
        if worker is not None:
            worker.eof = True

    def send(self, target: str, event: str, /, **fields: Any) -> bool:
        """One control line to a worker (positional-only: `fields` may carry "instance")."""
        worker = self.workers.get(target)
        if worker is None:
            return False
        if worker.chain:
            fields["member"] = target
        return self._write(worker, control_line(event, **fields))

    def _write(self, worker: Worker, text: str) -> bool:
        if worker.stdin_broken or worker.proc.stdin is None:
            return False
        try:
            worker.proc.stdin.write(text.encode())
            worker.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            worker.stdin_broken = True
            return False

    # -- stopping ------------------------------------------------------------------------------

    def stop(self, instance: str, now: float) -> None:
        """Ask one worker to drain and exit; `poll` escalates to SIGTERM and SIGKILL."""
        worker = self.workers.get(instance)
        if worker is None:
            return
        worker.asked_to_stop = True
        if worker.stop_sent_at is not None:
            return
        # A chain stops as a whole, upstream first (agent.instance.chain): every member drains.
        for w in [self.workers[i] for i in worker.chain if i in self.workers] or [worker]:
            w.stop_sent_at = now
            w.status = WorkerStatus.TERMINATING
        if not self.send(instance, "stop"):
            self._signal(worker, signal.SIGTERM, now)

    def stop_all(self, now: float) -> None:
        for instance in list(self.workers):
            self.stop(instance, now)

    def _signal(self, worker: Worker, sig: int, now: float) -> None:
        if worker.proc.poll() is not None:
            return
        try:
            worker.proc.send_signal(sig)
        except ProcessLookupError:
            return
        # One signal per process: a chain's members share it (a second SIGTERM would abort a
        # chain that is still draining, agent.instance.chain).
        for w in [self.workers[i] for i in worker.chain if i in self.workers] or [worker]:
            if sig == signal.SIGTERM:
                w.term_sent_at = now
            elif sig == signal.SIGKILL:
                w.kill_sent_at = now

    def kill(self, instance: str, now: float, reason: str) -> None:
        worker = self.workers.get(instance)
        if worker is not None and worker.kill_sent_at is None:
            worker.killed_for = reason
            log.warning("killing worker pid %d: %s", worker.pid, reason, extra={"instance": instance})
            self._signal(worker, signal.SIGKILL, now)

    # -- the periodic check --------------------------------------------------------------------

    def poll(self, now: float) -> List[Reaped]:
        """Reap exited workers, escalate stops, kill hung or never-ready workers."""
        reaped: List[Reaped] = []
        gap = now - self._last_poll if self._last_poll is not None else 0.0
        self._last_poll = now
        if gap > STALL_GAP:
            # The agent did not run for `gap` seconds; its workers were most likely stopped with
            # it (a node stall). Their heartbeats could not be read meanwhile: judge them from now
            # on instead of killing every one as hung (a kill would cost each a restart).
            log.warning("agent loop stalled for %.1fs: worker deadlines moved on", gap)
            for w in self.workers.values():
                w.last_heartbeat += gap
                w.started_at += gap
                for name in ("stop_sent_at", "term_sent_at"):
                    if getattr(w, name) is not None:
                        setattr(w, name, getattr(w, name) + gap)
        server = self._server
        if server is not None:
            server.pump()
            if server.proc.poll() is not None:
                log.warning("fork server exited with %s", server.proc.returncode)
                self._drop_server(now)
            elif self._server_closing and server.live_children() == 0:
                self.close_warm()
        self._retired = [s for s in self._retired if s.proc.poll() is None]
        self.prewarm(now)
        for instance, w in list(self.workers.items()):
            rc = w.proc.poll()
            if rc == forked.LOST_STATUS and w.exit_event is not None and isinstance(w.exit_event.get("code"), int):
                rc = int(w.exit_event["code"])  # its server is gone with the status: its own word
            if rc is not None and not w.eof and now - (w.exited_at or now) < EOF_GRACE:
                w.exited_at = w.exited_at or now  # its last lines may still be on their way (EOF_GRACE)
                continue
            if rc is not None:
                del self.workers[instance]
                self._close(w)
                reaped.append(Reaped(w, rc))
                continue
            if w.exit_event is not None and w.stop_sent_at is None:
                w.stop_sent_at = now  # it announced its exit: the escalation clock starts now
            if w.stop_sent_at is not None:
                elapsed = now - w.stop_sent_at
                if w.term_sent_at is None and elapsed >= self.term_after:
                    log.warning("worker did not exit %.1fs after stop: SIGTERM", elapsed, extra={"instance": instance})
                    self._signal(w, signal.SIGTERM, now)
                elif w.kill_sent_at is None and elapsed >= self.kill_after:
                    self.kill(instance, now, f"still running {self.kill_after:.1f}s after stop")
                continue
            if w.status is WorkerStatus.STARTING and now - w.started_at > self.start_timeout:
                self.kill(instance, now, f"not ready {self.start_timeout:.1f}s after start")
            elif w.status is WorkerStatus.ACTIVE and now - w.last_heartbeat > self.heartbeat_timeout:
                self.kill(instance, now, f"no heartbeat for {now - w.last_heartbeat:.1f}s")
        return reaped

    def _close(self, w: Worker) -> None:
        self._close_proc(w.proc)

    @staticmethod
    def _close_proc(proc: Process) -> None:
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def healthy(self, now: float) -> bool:
        """All workers that should heartbeat did so recently (gates the systemd watchdog)."""
        for w in self.workers.values():
            if w.status is WorkerStatus.ACTIVE and now - w.last_heartbeat > self.unhealthy_after:
                return False
        return True

    def pids(self) -> List[int]:
        """The worker processes, each once (a chain's members share one)."""
        return sorted({w.pid for w in self.workers.values()})

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, instance: object) -> bool:
        return instance in self.workers

    def get(self, instance: str) -> Optional[Worker]:
        return self.workers.get(instance)


__all__ = ["Process", "Supervisor", "WORKER_COMMAND"]
