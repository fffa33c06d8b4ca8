"""Session fixtures: a private Mosquitto on a free loopback port, one local Spark session
(it takes 6-20 s to start, so the whole test session shares it).

Real parts, not mocks: every test that speaks MQTT goes through this broker, configured like the
one the Ansible role renders (explicit queue limits), so that a dropped message shows up in
`$SYS/broker/publish/messages/dropped` instead of passing silently.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

# Keep spawned workers and CLI subprocesses on this checkout's code and venv: the agent (ROOT, on
# sys.path as `python -m pytest`'s working directory) and the lab (ROOT/lab, the fog-agent-lab
# distribution), whichever copies the venv has installed.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT / "lab"))
os.environ.setdefault("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "lab")]))

from foglab.tools.broker import (
    MOSQUITTO,
    BrokerError,
    PrivateBroker,
    free_port,
    start_private_broker,
    wait_port,
)


# One broker configuration for tests, the demo and the benchmarks (lab/foglab/tools/broker.py).
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


@pytest.fixture(scope="session")
def ops_wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheelhouse of this checkout (packaging/build-wheelhouse.sh), built once per test run
    for the Ansible and .deb tests, whichever processes run them: it lives in the run's directory,
    above each xdist worker's own, and the build is serialized by a file lock (the script skips a
    wheelhouse already built from the same sources). Each test process built its own before:
    12-25 s each."""
    import fcntl
    import subprocess

    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # pytest-N/, shared by popen-gw0, popen-gw1, ...
    out = run_dir / "ops-wheelhouse"
    with open(run_dir / "ops-wheelhouse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        res = subprocess.run(["bash", str(ROOT / "packaging/build-wheelhouse.sh"), str(out)],
                             capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return out


# ---- the order in which pytest-xdist deals out the test files ----------------------------------
#
# `make test` runs `--dist loadfile`: a file goes whole to one process, in the order of the
# collection (`--no-loadscope-reorder` in pyproject.toml; xdist's own default deals the files
# with the most tests first, which put the chaos and fleet files, two or three long tests each,
# last: a 28-minute run spent its last 5 minutes on one process). Longest file first keeps the
# processes' sums within a few seconds of each other. The seconds per file come from a
# recorded run (tests/file_seconds.json, rewritten by `--record-file-seconds`); a file missing
# from it is dealt first, as if it were the longest: a short one costs nothing there, a long one
# dealt last would extend the tail (README.md, "Tests").

FILE_SECONDS = Path(__file__).resolve().parent / "file_seconds.json"

# The files whose tests use the `spark` fixture go to one process as one unit: the session is a
# JVM that takes 6-20 s to start on a quiet machine (196 s at load 31), once per process that
# asks for it. tests/test_fixtures.py checks that this list names every such file.
SPARK_FILES = frozenset({"tests/test_analytics_spark.py", "tests/test_debs_edge.py", "tests/test_fixtures.py"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-file-seconds", metavar="PATH", default=None,
                     help="write the seconds spent per test file (setup + call + teardown) to PATH as JSON")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """What xdist deals out as one piece: a test file, or the Spark files together."""
    f = file_of(nodeid)
    return "spark" if f in SPARK_FILES else f


class Dealing:
    """`--dist loadfile` with the Spark files as one unit (pytest-xdist's own scheduler otherwise)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class ByUnit(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return unit_of(nodeid)

        return ByUnit(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """In an xdist worker, sort the files longest first (stable: a file's tests keep their order).
    Every worker sorts the same collection with the same table, so the collections still match."""
    if not hasattr(config, "workerinput"):
        return  # one process: the order does not change the wall time; keep the files' order
    try:
        seconds: Dict[str, float] = json.loads(FILE_SECONDS.read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        seconds = {}
    unknown = float("inf")
    units: Dict[str, float] = {}
    for f in {file_of(item.nodeid) for item in items}:
        units[unit_of(f)] = units.get(unit_of(f), 0.0) + seconds.get(f, unknown)
    items.sort(key=lambda item: (-units[unit_of(item.nodeid)], unit_of(item.nodeid)))


class FileSeconds:
    """Sums report durations per file in the process that sees every report (xdist's controller)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: Dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        f = file_of(report.nodeid)
        self.seconds[f] = self.seconds.get(f, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = dict(sorted(((f, round(s, 1)) for f, s in self.seconds.items()), key=lambda kv: -kv[1]))
        self.path.write_text(json.dumps({"seconds": ordered}, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(Dealing(), "dealing")
    path = config.getoption("--record-file-seconds")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FileSeconds(Path(path)), "file-seconds")
