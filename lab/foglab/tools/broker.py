"""A private Mosquitto on a free loopback port, for benchmarks and the demo.

Why a copy of the test fixture's logic instead of importing `tests/conftest.py`: the package must
not depend on its test tree (a Pi install has no tests), and the demo and the dataplane benchmark
need the same broker configuration the tests use: explicit `max_queued_messages` (the default 1000
silently drops QoS 1 messages past it, docs/design.md invariant 5) and `sys_interval 1` so that
`$SYS/broker/publish/messages/dropped` can be read during a run. `set_tcp_nodelay true`: with
Nagle's algorithm on, every small ack waits ~40 ms for a delayed TCP ACK (see transport.py).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"

BROKER_CONF = """\
listener {port} 127.0.0.1
user {user}
allow_anonymous true
persistence {persistence}
persistence_location {dir}/
autosave_interval 5
max_queued_messages {max_queued}
max_inflight_messages {max_inflight}
max_keepalive 60
set_tcp_nodelay true
sys_interval 1
log_dest file {log}
log_type error
log_type warning
log_type notice
connection_messages true
"""


class BrokerError(RuntimeError):
    """Mosquitto is missing or did not start."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


@dataclass
class PrivateBroker:
    """Handle of a running private broker; `stop()` is idempotent."""

    host: str
    port: int
    conf_path: Path
    log_path: Path
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "PrivateBroker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_private_broker(
    workdir: Union[str, Path],
    max_queued: int = 10000,
    port: int = 0,
    max_inflight: int = 100,
    persistence: bool = True,
    mosquitto: Optional[str] = None,
) -> PrivateBroker:
    """Start Mosquitto with a generated config under `workdir`; raise BrokerError if it fails."""
    binary = mosquitto or MOSQUITTO
    if not os.path.exists(binary):
        raise BrokerError("mosquitto is not installed: run `make setup` (apt-get install mosquitto)")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    conf = workdir / "mosquitto.conf"
    log = workdir / "mosquitto.log"
    conf.write_text(
        BROKER_CONF.format(
            port=port,
            dir=workdir,
            log=log,
            max_queued=max_queued,
            max_inflight=max_inflight,
            persistence="true" if persistence else "false",
            # Started as root, Mosquitto switches to the `mosquitto` user, which cannot write the
            # persistence file or the log in our work dir: persistence then silently does not
            # happen and a restart loses every session. Stay the user that owns the work dir.
            user=getpass.getuser(),
        )
    )
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_port("127.0.0.1", port)
    except TimeoutError:
        proc.kill()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise BrokerError(f"mosquitto did not start on port {port}: {err.strip()}") from None
    return PrivateBroker("127.0.0.1", port, conf, log, proc)


__all__ = ["BrokerError", "PrivateBroker", "free_port", "start_private_broker", "wait_port"]
