"""Session fixtures: a private Mosquitto on a free loopback port, a module-scoped local Spark.

Real parts, not mocks: every test that speaks MQTT goes through this broker, configured like the
one the Ansible role renders (explicit queue limits), so that a dropped message shows up in
`$SYS/broker/publish/messages/dropped` instead of passing silently.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"

# Keep spawned workers and CLI subprocesses on this checkout's code and venv.
ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PYTHONPATH", str(ROOT))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
class Broker:
    host: str
    port: int
    conf_path: Path
    log_path: Path
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


BROKER_CONF = """\
listener {port} 127.0.0.1
allow_anonymous true
persistence true
persistence_location {dir}/
autosave_interval 5
max_queued_messages {max_queued}
max_inflight_messages 100
max_keepalive 60
set_tcp_nodelay true
sys_interval 1
log_dest file {log}
log_type error
log_type warning
log_type notice
connection_messages true
"""


def start_broker(workdir: Path, max_queued: int = 10000, port: int = 0) -> Broker:
    """Start a private Mosquitto; used by the fixture and by tests that restart brokers."""
    if not os.path.exists(MOSQUITTO):
        pytest.fail("mosquitto is not installed: run `make setup` (apt-get install mosquitto)")
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    conf = workdir / "mosquitto.conf"
    log = workdir / "mosquitto.log"
    conf.write_text(BROKER_CONF.format(port=port, dir=workdir, log=log, max_queued=max_queued))
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_port("127.0.0.1", port)
    except TimeoutError:
        proc.kill()
        err = proc.stderr.read().decode() if proc.stderr else ""
        pytest.fail(f"mosquitto did not start on port {port}: {err}")
    return Broker("127.0.0.1", port, conf, log, proc)


def stop_broker(broker: Broker) -> None:
    broker.proc.terminate()
    try:
        broker.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        broker.proc.kill()
        broker.proc.wait()


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    broker = start_broker(tmp_path_factory.mktemp("mosquitto"))
    yield broker
    stop_broker(broker)


@pytest.fixture(scope="module")
def spark() -> Iterator["object"]:
    from pyspark.sql import SparkSession  # the analytics extra: installed by `make setup`

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[2]")
        .appName("fog-agent-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    yield session
    session.stop()
