"""The worker process: one operator instance, or a chain of them (`python -m agent.instance.worker`).

Reads one `InstanceSpec` JSON line on stdin, then speaks the control channel of
`agent.instance.spec` (JSON lines: stdout to the agent, stdin from it; logs on stderr). Given the
line {"chain": [spec, ...]} instead of one spec, the process hosts several consecutive instances,
one `Worker` each (agent.instance.shell), driven by `agent.instance.chain.Chain`. A second thread
only reads stdin lines into a queue; signals only enqueue.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Dict, List, Optional, TextIO

from agent.instance.chain import Chain
from agent.instance.core import EXIT_BAD_SPEC, EXIT_BROKER, EXIT_CRASH, EXIT_DRAIN_TIMEOUT, EXIT_OK
from agent.instance.shell import InstanceBusy, Worker
from agent.instance.spec import InstanceSpec, control_line, parse_control_line, specs_from_line
from agent.mqtt.transport import TransportError
from agent.operators.admission import OperatorRefused, node_allow_list

log = logging.getLogger("agent.instance.worker")

def _stdin_reader(stream: TextIO, sink: "deque[Dict[str, Any]]") -> None:
    """The only other thread: turns control lines into queued dicts (EOF = the agent is gone)."""
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            sink.append(parse_control_line(line))
        except ValueError as exc:
            log.warning("bad control line ignored: %s", exc)
    sink.append({"event": "eof"})


def _install_signals(worker: Worker) -> None:
    """SIGTERM/SIGINT: the first one drains like "stop"; a second one (the agent's escalation
    after its stop timeout, or a second Ctrl-C) exits at the next loop turn without draining.
    The handler only enqueues or sets a flag; the loop does the work (gunicorn's arbiter style)."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        if worker.core.stopping:
            worker.abort = f"signal {signum} while draining"
        else:
            worker.control.append({"event": "stop"})

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def preimport() -> None:
    """Import what building any instance needs (scaling core, policy, recovery, operators)
    before reading the spec. Why: the agent's fork server (agent.instance.forkserver) runs this
    once and forks every worker from the result, so whatever is imported here is off the path
    decision -> first record of a scale-out (~70 ms idle, 2-4x that on a loaded machine); a cold
    start pays the same total either way. A module that fails to import here is imported (and
    reported) later, where it is used."""
    import importlib

    for name in ("agent.protocol.scaling", "agent.protocol.guarded", "agent.policy.decentralized",
                 "agent.instance.recovery", "agent.instance.rounds", "agent.events", "agent.operators.taxi"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    node_allow_list()  # reads the installed packages' entry points (once per process)


def main(argv: Optional[List[str]] = None) -> int:
    from agent.log import setup_logging

    setup_logging(os.environ.get("FOG_AGENT_LOG_LEVEL"))
    preimport()  # cached in a worker forked by the fork server, which did it before the fork
    line = sys.stdin.readline()
    try:
        specs = specs_from_line(line)
    except (ValueError, TypeError, KeyError) as exc:
        log.error("bad instance spec on stdin: %s", exc)
        sys.stdout.write(control_line("exit", code=EXIT_BAD_SPEC, reason=f"bad spec: {exc}"))
        return EXIT_BAD_SPEC
    if len(specs) > 1:
        return _main_chain(specs)
    spec = specs[0]
    try:
        worker = Worker(spec)
    except InstanceBusy as exc:
        log.error("%s", exc)
        return EXIT_CRASH  # no exit line: the agent treats it as a crash and retries (bounded)
    except OperatorRefused as exc:  # not on this node's allow-list: one line, never imported
        log.error("instance %s: %s", spec.instance, exc)
        sys.stdout.write(control_line("exit", code=EXIT_BAD_SPEC, reason=str(exc)[:300]))
        return EXIT_BAD_SPEC
    except Exception as exc:  # noqa: BLE001 - config/operator errors: say so and do not restart
        log.exception("cannot build instance %s", spec.instance)
        sys.stdout.write(control_line("exit", code=EXIT_BAD_SPEC, reason=str(exc)[:300]))
        return EXIT_BAD_SPEC
    _install_signals(worker)  # before "ready": the agent may signal us as soon as it reads it
    try:
        worker.start()
    except (TransportError, OSError) as exc:
        log.error("cannot reach the broker: %s", exc, extra=worker.ctx)
        worker._emit("exit", code=EXIT_BROKER, reason=str(exc))
        return EXIT_BROKER
    threading.Thread(target=_stdin_reader, args=(sys.stdin, worker.control), daemon=True, name="stdin").start()
    try:
        return _run_profiled(worker.run, spec.instance)
    except Exception as exc:  # noqa: BLE001
        log.exception("worker crashed", extra=worker.ctx)
        worker._emit("exit", code=EXIT_CRASH, reason=repr(exc)[:300])
        return EXIT_CRASH


def _run_profiled(run: Callable[[], int], name: str) -> int:
    """`run()`; with FOG_WORKER_PROFILE=<dir> (benchmarks) under cProfile, dumped to <dir>/<name>.prof."""
    prof_dir = os.environ.get("FOG_WORKER_PROFILE")
    if not prof_dir:
        return run()
    import cProfile

    prof = cProfile.Profile(time.process_time)  # CPU, not wall: a loaded machine stretches syscalls
    try:
        return int(prof.runcall(run))
    finally:
        prof.dump_stats(os.path.join(prof_dir, f"{name}.prof"))


def _main_chain(specs: List[InstanceSpec]) -> int:
    """`main` for a chain process (agent.instance.chain): the same exits, one line per member."""
    def fail(code: int, reason: str) -> int:
        for s in specs:
            sys.stdout.write(control_line("exit", code=code, reason=reason[:300], member=s.instance))
        return code

    names = ", ".join(s.instance for s in specs)
    try:
        chain = Chain(specs, sys.stdout)
    except InstanceBusy as exc:
        log.error("%s", exc)
        return EXIT_CRASH
    except OperatorRefused as exc:
        log.error("chain %s: %s", names, exc)
        return fail(EXIT_BAD_SPEC, str(exc))
    except Exception as exc:  # noqa: BLE001 - config/operator errors: say so and do not restart
        log.exception("cannot build chain %s", names)
        return fail(EXIT_BAD_SPEC, str(exc))
    chain.install_signals()
    try:
        chain.start()
    except (TransportError, OSError) as exc:
        log.error("chain %s cannot reach the broker: %s", names, exc)
        chain.emit("exit", code=EXIT_BROKER, reason=str(exc))
        return EXIT_BROKER
    threading.Thread(target=_stdin_reader, args=(sys.stdin, chain.control), daemon=True, name="stdin").start()
    try:
        return _run_profiled(chain.run, "chain-" + "+".join(s.instance for s in specs))
    except Exception as exc:  # noqa: BLE001
        log.exception("chain %s crashed", names)
        chain.emit("exit", code=EXIT_CRASH, reason=repr(exc)[:300])
        return EXIT_CRASH


__all__ = ["main", "preimport", "EXIT_OK", "EXIT_CRASH", "EXIT_BAD_SPEC", "EXIT_BROKER", "EXIT_DRAIN_TIMEOUT"]

if __name__ == "__main__":
    sys.exit(main())
