"""sd_notify for the agent daemon: tell systemd when we are ready, alive, and what we are doing.

Public API (all functions are no-ops returning False outside systemd, i.e. when NOTIFY_SOCKET is
unset; they never raise on a send error, because a notification that cannot be delivered must not
take the daemon down -- systemd notices the silence by itself):

    ready(status=None)   READY=1 (+ STATUS=). Send once, after the MQTT client is connected and the
                         workers are up: `Type=notify` units count as started only then, so
                         `systemctl start` and `After=` ordering wait for a working agent.
    watchdog()           WATCHDOG=1. Send every `watchdog_period()` seconds, and ONLY while every
                         worker is healthy: a hung worker must stop the pings so that systemd's
                         `WatchdogSec=` restarts the service (this is what makes the watchdog mean
                         "the pipeline runs", not "the main thread runs").
    status(line)         STATUS=<one line>, shown by `systemctl status` (newlines are replaced).
    stopping(status=None) STOPPING=1 at the start of a clean shutdown (drain before exit).
    reloading()          RELOADING=1 (with MONOTONIC_USEC, systemd >= 253 wants it).
    watchdog_interval()  WatchdogSec as seconds (from WATCHDOG_USEC, honouring WATCHDOG_PID), or None.
    watchdog_period()    half of it: how often to call watchdog() (sd_watchdog_enabled(3) advice).
    enabled()            True when NOTIFY_SOCKET is set.

Why a pure-socket implementation instead of systemd-python: the protocol is one datagram of
`KEY=VALUE` lines to an AF_UNIX socket (sd_notify(3)); a C-extension dependency for that would have
to be built on every Pi. Abstract-namespace sockets (`@name`) are supported as systemd sends them.

Every function takes an optional `env` mapping (default `os.environ`) so tests and the daemon can
pass the environment explicitly instead of mutating the process-wide one. `NotifyAccess=main` in
the unit means only the main process may notify: worker processes must not call these.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Mapping, Optional

__all__ = [
    "enabled",
    "notify",
    "ready",
    "reloading",
    "status",
    "stopping",
    "watchdog",
    "watchdog_interval",
    "watchdog_period",
]

log = logging.getLogger(__name__)

MAX_STATUS_CHARS = 400  # systemctl shows one line; keep the datagram far below any size limit.


def _env(env: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if env is None else env


def _address(path: str) -> str:
    # "@foo" is an abstract-namespace socket: the kernel name starts with a NUL byte.
    return "\0" + path[1:] if path.startswith("@") else path


def enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when systemd (or a test) gave us a notification socket."""
    return bool(_env(env).get("NOTIFY_SOCKET"))


def notify(state: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Send one raw notification (newline-separated KEY=VALUE lines); True if it was sent."""
    path = _env(env).get("NOTIFY_SOCKET")
    if not path:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(_address(path))
            sock.sendall(state.encode("utf-8"))
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", path, exc)
        return False
    return True


def _one_line(text: str) -> str:
    line = " ".join(str(text).split())
    return line[:MAX_STATUS_CHARS]


def ready(status: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> bool:
    """READY=1: connected and workers up. Optionally with a first STATUS= line."""
    msg = "READY=1"
    if status is not None:
        msg += "\nSTATUS=" + _one_line(status)
    return notify(msg, env)


def watchdog(env: Optional[Mapping[str, str]] = None) -> bool:
    """WATCHDOG=1: call only after checking that every worker is healthy."""
    return notify("WATCHDOG=1", env)


def status(line: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """STATUS=<line>: a one-line summary for `systemctl status` (e.g. "3 instances, 1.2k rec/s")."""
    return notify("STATUS=" + _one_line(line), env)


def stopping(status: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> bool:
    """STOPPING=1: a clean shutdown has begun (instances drain before the process exits)."""
    msg = "STOPPING=1"
    if status is not None:
        msg += "\nSTATUS=" + _one_line(status)
    return notify(msg, env)


def reloading(env: Optional[Mapping[str, str]] = None, now_usec: Optional[int] = None) -> bool:
    """RELOADING=1 with the CLOCK_MONOTONIC timestamp systemd >= 253 expects; send ready() after."""
    usec = now_usec if now_usec is not None else time.monotonic_ns() // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}", env)


def watchdog_interval(env: Optional[Mapping[str, str]] = None, pid: Optional[int] = None) -> Optional[float]:
    """WatchdogSec in seconds, or None when the watchdog is off or meant for another process.

    Mirrors sd_watchdog_enabled(3): WATCHDOG_USEC must be a positive integer, and when WATCHDOG_PID
    is set it must be our pid (a child that inherited the environment must not ping).
    """
    e = _env(env)
    raw = e.get("WATCHDOG_USEC")
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
        return None
    if usec <= 0:
        return None
    wpid = e.get("WATCHDOG_PID")
    if wpid:
        try:
            if int(wpid) != (pid if pid is not None else os.getpid()):
                return None
        except ValueError:
            return None
    return usec / 1_000_000


def watchdog_period(env: Optional[Mapping[str, str]] = None, pid: Optional[int] = None) -> Optional[float]:
    """How often to send WATCHDOG=1: half the interval, so one late ping does not kill us."""
    interval = watchdog_interval(env, pid)
    return None if interval is None else interval / 2.0
