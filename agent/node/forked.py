"""The agent's side of its fork server (agent.instance.forkserver): start it, ask it for a worker,
and a handle on each forked worker that the supervisor uses like a `subprocess.Popen`.

Why a fork server and not a pre-started spare: docs/runtime.md, "Pre-started workers". Every
call here is made by the daemon's loop thread (the supervisor's rule: the loop owns all state);
a fork asks one round trip of the server, a few milliseconds, and never waits for the server's
imports: until the server says it is ready, the supervisor starts workers cold.

A forked worker is the server's child, not ours: its exit status comes from the server, which
reaps it, and signals go through the server, which signals only a child it has not reaped (no
reused pid is hit). If the link is lost (the server was killed, or we gave up on it), its
children run on, supervised through their pipes as before; only their exit statuses are gone:
a handle whose process has gone then reports `LOST_STATUS`, and the supervisor takes the code
of the worker's own "exit" line instead when it wrote one.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Any, Callable, Dict, Optional, Sequence

from agent.instance.forkserver import PACKET  # one bound for both ends of the link

log = logging.getLogger(__name__)

SERVER_MODULE = "agent.instance.forkserver"
FORK_REPLY_TIMEOUT = 5.0  # a fork is milliseconds; past this the server counts as broken
LOST_STATUS = -1000  # no status: the server that reaped the process is gone (never a real one)


def supported(command: Sequence[str]) -> bool:
    """Fork, SOCK_SEQPACKET and fd passing (Linux: the fog nodes), and a worker command that a
    Python interpreter runs (the server is Python: `--worker-command` may name anything);
    otherwise every worker starts cold."""
    python = len(command) >= 2 and (command[0] == sys.executable or os.path.basename(command[0]).startswith("python"))
    return python and hasattr(os, "fork") and hasattr(socket, "SOCK_SEQPACKET") and hasattr(socket, "send_fds")


class ForkedProcess:
    """A worker forked by the server: the part of `subprocess.Popen` the supervisor uses."""

    def __init__(self, server: "ForkServer", fid: int, pid: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self._server = server
        self.fid = fid
        self.pid = pid
        self.stdin: Optional[IO[bytes]] = stdin
        self.stdout: Optional[IO[bytes]] = stdout
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._server.pump()
        if self.returncode is None and self._server.lost and not _exists(self.pid):
            self.returncode = LOST_STATUS
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
            self._server.wait_readable(left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._server.signal(self, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ForkServer:
    """One fork server process of this agent and the link to it."""

    def __init__(self, command: Sequence[str], env: Optional[Dict[str, str]],
                 preexec: Optional[Callable[[], None]], now: float) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [command[0], "-m", SERVER_MODULE, "--fd", str(theirs.fileno()), "--", *command[1:]],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None, env=env,
                preexec_fn=preexec, close_fds=True, pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        self.sock = mine
        self.started_at = now
        self.ready = False  # its imports are done: it says so first
        self.lost = False  # the link is closed (the server exited, or we closed it)
        self._next_id = 0
        self._children: Dict[int, ForkedProcess] = {}  # fork id -> handle, until its exit is reported
        self._pids: Dict[int, int] = {}  # fork id -> pid, from the fork replies

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def live_children(self) -> int:
        return sum(1 for c in self._children.values() if c.returncode is None)

    # -- the link ------------------------------------------------------------------------------

    def pump(self) -> None:
        """Read every report the server has sent (never blocks)."""
        while not self.lost:
            try:
                data = self.sock.recv(PACKET)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._lose()
                return
            self._on_packet(data)

    def _on_packet(self, data: bytes) -> None:
        try:
            msg = json.loads(data)
        except ValueError:
            log.warning("fork server sent a bad packet: %r", data[:100])
            return
        if "ready" in msg:
            self.ready = True
        elif "exit" in msg:
            child = self._children.pop(int(msg["id"]), None)
            if child is not None:
                child.returncode = int(msg["exit"])
        elif "pid" in msg or "error" in msg:
            self._pids[int(msg["id"])] = int(msg.get("pid", -1))

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            self.sock.close()

    def wait_readable(self, timeout: float) -> None:
        if self.lost:
            time.sleep(max(0.0, timeout))
            return
        try:
            select.select([self.sock], [], [], max(0.0, timeout))
        except (OSError, ValueError):
            pass

    def _send(self, msg: Dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = json.dumps(msg).encode()
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.send(data)

    # -- requests ------------------------------------------------------------------------------

    def fork(self) -> ForkedProcess:
        """A new worker process, forked by the server; OSError if it cannot (the caller starts one
        cold). Only once the server is ready: a fork never waits for the server's imports."""
        self.pump()
        if self.lost or not self.ready:
            raise OSError("the fork server is not ready")
        self._next_id += 1
        fid = self._next_id
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self._send({"op": "fork", "id": fid}, [in_r, out_w])
        except OSError:
            for fd in (in_r, in_w, out_r, out_w):
                os.close(fd)
            self._lose()
            raise
        finally:
            if not self.lost:
                os.close(in_r)
                os.close(out_w)
        deadline = time.monotonic() + FORK_REPLY_TIMEOUT
        while fid not in self._pids and not self.lost and time.monotonic() < deadline:
            self.wait_readable(deadline - time.monotonic())
            self.pump()
        pid = self._pids.pop(fid, None)
        if pid is None or pid < 0:
            os.close(in_w)
            os.close(out_r)
            if pid is None:
                self._lose()  # no answer in time: do not use it again (a late child sees EOF)
            raise OSError(f"the fork server did not fork ({'no reply' if pid is None else 'fork failed'})")
        child = ForkedProcess(self, fid, pid, open(in_w, "wb"), open(out_r, "rb"))
        self._children[fid] = child
        return child

    def signal(self, child: ForkedProcess, sig: int) -> None:
        if not self.lost:
            try:
                self._send({"op": "signal", "id": child.fid, "sig": int(sig)})
                return
            except OSError:
                self._lose()
        if _exists(child.pid):  # the server is gone; its children were reparented, not reaped by it
            try:
                os.kill(child.pid, sig)
            except ProcessLookupError:
                pass

    def close(self, wait: bool = True, timeout: float = 1.0) -> None:
        """EOF on the link: the server exits once its last child has (`wait`: then wait for it;
        only without live children, else the caller reaps it later with `proc.poll()`)."""
        self.pump()  # the exits it reported before
        self._lose()
        if not wait:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


__all__ = ["ForkServer", "ForkedProcess", "FORK_REPLY_TIMEOUT", "LOST_STATUS", "supported"]
