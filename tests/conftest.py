"""Session fixtures: a private Mosquitto on a free loopback port, one local Spark session
(it takes 6-20 s to start, so the whole test session shares it).

Real parts, not mocks: every test that speaks MQTT goes through this broker, configured like the
one the Ansible role renders (explicit queue limits), so that a dropped message shows up in
`$SYS/broker/publish/messages/dropped` instead of passing silently.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from agent.tools.broker import (
    MOSQUITTO,
    BrokerError,
    PrivateBroker,
    free_port,
    start_private_broker,
    wait_port,
)

# Keep spawned workers and CLI subprocesses on this checkout's code and venv.
ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PYTHONPATH", str(ROOT))

# One broker configuration for tests, the demo and the benchmarks (agent/tools/broker.py).
Broker = PrivateBroker
__all__ = ["MOSQUITTO", "Broker", "free_port", "wait_port", "start_broker", "stop_broker"]


def start_broker(workdir: Path, max_queued: int = 10000, port: int = 0) -> Broker:
    """Start a private Mosquitto; used by the fixture and by tests that restart brokers."""
    try:
        return start_private_broker(workdir, max_queued=max_queued, port=port)
    except BrokerError as exc:
        pytest.fail(str(exc))


def stop_broker(broker: Broker) -> None:
    broker.stop()


@pytest.fixture(autouse=True)
def _root_logging_as_it_was() -> Iterator[None]:
    """A CLI called in-process (`setup_logging`) leaves a handler and a level on the root logger;
    without this, what the next test of the same process captures on stderr depends on which test
    ran before it (with pytest-xdist, on the order the files were dealt out)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers and not type(h).__module__.startswith("_pytest"):
            root.removeHandler(h)
    root.setLevel(level)


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    broker = start_broker(tmp_path_factory.mktemp("mosquitto"))
    yield broker
    stop_broker(broker)


@pytest.fixture(scope="session")
def spark() -> Iterator["object"]:
    from pyspark.sql import SparkSession  # the analytics extra: installed by `make setup`

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # py4j logs from __del__ at interpreter exit, after pytest closed the captured streams.
    logging.getLogger("py4j").setLevel(logging.WARNING)
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
