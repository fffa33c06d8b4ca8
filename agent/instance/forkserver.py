"""The agent's fork server: one process that has done a worker's imports once and forks a worker
for each start (`python -m agent.instance.forkserver --fd N -- <command>`; the agent's side is
agent.node.forked).

Why (docs/runtime.md, "Pre-started workers"): the agent used to keep one pre-started worker, a
spare consumed by the next start. A round that asks for two or three copies, or two operators
scaling out in the same second, took the spare and then a process that had only just started:
an interpreter start and ~0.45 s of import CPU, which at load 15-20 on two cores was 8-16 s of
wall time (the demo's slow `spawn` parts, docs/measurement.md "decision -> first record in the
demo"). A fork of a process that has imported everything costs milliseconds whatever the burst,
and the server is never consumed.

`<command>` is the worker command without its interpreter: `-m agent.instance.worker` (the
module is imported here, and its `preimport()` run, before the server says it is ready; a child
calls its `main()`) or a script path (the tests' fake worker: nothing to import ahead; a child
runs it as `python <script>` would), with the two pipe ends it was given as its stdin and
stdout: a forked worker and a cold one run the same code.

The link is a SOCK_SEQPACKET socket (one JSON object a packet, fds alongside):
    agent -> server  {"op": "fork", "id": n} + [stdin read end, stdout write end]
                     {"op": "signal", "id": n, "sig": s}   signal the child of fork n, if alive
    server -> agent  {"ready": pid}                        imports done (forks asked before wait)
                     {"id": n, "pid": p}                   forked
                     {"id": n, "exit": code}               reaped; code as Popen's returncode
A signal goes through the server because the server reaps: it signals only a child it has not
reaped, so a pid reused after an exit is never hit. EOF on the link (the agent is gone, or gave
up on this server): no more forks; the server exits when its last child has. Its children are
not told anything by the server's end: a worker learns that its agent is gone from the EOF on
its stdin, whose other end only the agent holds, and drains; a worker whose agent lives on
keeps running when the server dies (the agent then only misses its exit status). The server
ignores SIGTERM and SIGINT: a signal to the agent's process group is meant for the workers and
the agent, and the server must outlive the workers' drain to report their exits.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

log = logging.getLogger("agent.instance.forkserver")

PACKET = 4096  # a request is a few dozen bytes; bounded anyway


def parse_command(argv: Sequence[str]) -> Tuple[Optional[str], Optional[str], List[str]]:
    """(module, script, argv) of a worker command without its interpreter."""
    if len(argv) >= 2 and argv[0] == "-m":
        return argv[1], None, list(argv[1:])
    if argv:
        return None, argv[0], list(argv)
    raise ValueError("no worker command")


def _preload(module: Optional[str]) -> None:
    """What a cold start of the command imports before it reads its spec, done once here."""
    if module is None:
        return
    mod = importlib.import_module(module)
    pre = getattr(mod, "preimport", None)
    if callable(pre):
        pre()


def _child(stdin_fd: int, stdout_fd: int, closing: Sequence[int], module: Optional[str], script: Optional[str],
           argv: List[str]) -> None:
    """In the forked child: become `python <command>` with the given pipes; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # SIGINT stays ignored until the worker installs its drain handler (supervisor._pdeathsig)
        for fd in closing:
            try:
                os.close(fd)
            except OSError:
                pass
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.close(stdin_fd)
        os.close(stdout_fd)
        sys.argv = list(argv)
        try:
            entry = getattr(sys.modules.get(module or ""), "main", None)
            if callable(entry):  # preloaded: its main, not a second copy of the module as __main__
                code = int(entry() or 0)
            elif module is not None:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                code = 0
            else:
                runpy.run_path(str(script), run_name="__main__")
                code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        logging.shutdown()
        os._exit(code & 0xFF if code >= 0 else 1)


class Server:
    """The server's loop: fork requests, signal requests, reaping (one thread)."""

    def __init__(self, link: socket.socket, module: Optional[str], script: Optional[str], argv: List[str]) -> None:
        self.link = link
        self.module, self.script, self.argv = module, script, argv
        self.children: Dict[int, int] = {}  # pid -> fork id, until reaped
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def send(self, msg: Dict[str, int]) -> None:
        try:
            self.link.send(json.dumps(msg).encode())
        except OSError:
            pass  # the agent is gone: the loop sees EOF

    def serve(self) -> int:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        self.send({"ready": os.getpid()})
        linked = True
        while linked or self.children:
            try:
                readable, _, _ = select.select([self.link, self.wake_r] if linked else [self.wake_r], [], [])
            except InterruptedError:
                continue
            if self.wake_r in readable:
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
            self.reap()
            if self.link in readable and not self.request():
                linked = False  # EOF: no more forks; wait for the children (module docstring)
        return 0

    def request(self) -> bool:
        """One packet from the agent; False at EOF."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.link, PACKET, 2)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        try:
            msg = json.loads(data)
            op, fid = msg["op"], int(msg["id"])
        except (ValueError, KeyError, TypeError):
            for fd in fds:
                os.close(fd)
            log.warning("fork server: bad request ignored: %r", data[:100])
            return True
        if op == "fork" and len(fds) == 2:
            self.fork(fid, fds[0], fds[1])
        elif op == "signal":
            for pid, f in self.children.items():
                if f == fid:
                    try:
                        os.kill(pid, int(msg.get("sig", signal.SIGTERM)))
                    except (ProcessLookupError, ValueError):
                        pass
            for fd in fds:
                os.close(fd)
        else:
            for fd in fds:
                os.close(fd)
        return True

    def fork(self, fid: int, stdin_fd: int, stdout_fd: int) -> None:
        for stream in (sys.stdout, sys.stderr):  # nothing of ours written twice, or into the pipe
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(stdin_fd)
            os.close(stdout_fd)
            self.send({"id": fid, "error": str(exc)[:200]})  # type: ignore[dict-item]
            return
        if pid == 0:
            self.link.close()
            _child(stdin_fd, stdout_fd, [self.wake_r, self.wake_w], self.module, self.script, self.argv)
        os.close(stdin_fd)
        os.close(stdout_fd)
        self.children[pid] = fid
        self.send({"id": fid, "pid": pid})

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fid = self.children.pop(pid, None)
            if fid is not None:
                self.send({"id": fid, "exit": os.waitstatus_to_exitcode(status)})


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] != "--fd" or args[2] != "--":
        print("usage: python -m agent.instance.forkserver --fd N -- <worker command>", file=sys.stderr)
        return 2
    from agent.log import setup_logging

    setup_logging(os.environ.get("FOG_AGENT_LOG_LEVEL"))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    link = socket.socket(fileno=int(args[1]))
    module, script, child_argv = parse_command(args[3:])
    try:
        _preload(module)
    except Exception:  # the children import it again and report the error in their own way
        log.exception("fork server: cannot preload %s", module)
    # What the children inherit stays shared: a child's collector would otherwise write into
    # the header of every object it inherited on its first full collection, copying each page
    # (copy-on-write) into the child. Frozen objects are never examined; they live as long as
    # the process anyway (modules, their functions and constants).
    gc.collect()
    gc.freeze()
    return Server(link, module, script, child_argv).serve()


if __name__ == "__main__":
    sys.exit(main())
