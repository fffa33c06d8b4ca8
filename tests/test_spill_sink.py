"""The real data path spills: a counting sink worker on the real broker appends every record that
reaches it to its spool, with its id, exactly once (clean stop, kill -9 + restart), and a full
spool holds the producer back with an event instead of dropping anything."""

from __future__ import annotations

import collections
import gzip
import json
import signal
import threading
import time
from pathlib import Path
from typing import Counter, List

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent import topics
from foglab.tools.dataplane_bench import LocalRunner, initial_specs, pipeline_toml
from agent_process import ONLINE_BOUND
from agent.operators.builtin import _line_ids, read_sink_ids
from agent.spill.shipper import PathShipper
from agent.mqtt.settings import BrokerSpec
from agent.spill.spool import SpoolDirs

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


def pipeline(rate: float, n: int) -> str:
    return pipeline_toml(
        "spill",
        [
            {"name": "source", "kind": "source", "function": "agent.operators.taxi:source",
             "params": {"seed": 5, "profile": "constant", "rate": rate, "max_records": n}, "batch_size": 50},
            {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink", "batch_size": 50},
        ],
        scaling={"policy": "none"},
    )


def start(runner: LocalRunner, mosquitto, tmp_path: Path, toml: str, cluster: str, spill: dict):
    specs = initial_specs(toml, BrokerSpec(mosquitto.host, mosquitto.port), str(tmp_path / "state"),
                          cluster=cluster, extra={"sink_dir": str(tmp_path / "sink"), "spill": spill})
    procs = [runner.start(s) for s in reversed(specs)]
    return {p.spec.operator: p for p in procs}


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def spooled_ids(paths: List[Path]) -> Counter:
    """Every (src, seq) in the given spool files, with its number of copies."""
    c: Counter = collections.Counter()
    for p in paths:
        for line in gzip.decompress(p.read_bytes()).splitlines():
            c.update(_line_ids(line))
    return c


@pytest.fixture
def runner(tmp_path: Path):
    r = LocalRunner(tmp_path, ready_timeout=ONLINE_BOUND)
    yield r
    r.stop_all(timeout=10)


def test_sink_spills_each_record_once_across_kill9_and_restart(runner, mosquitto, tmp_path: Path) -> None:
    n = 5000
    spool = tmp_path / "spool"
    procs = start(runner, mosquitto, tmp_path, pipeline(1500.0, n), "spillonce",
                  {"dir": str(spool), "rotate_bytes": 16000})
    open_dir = spool / "sink-0" / "open"
    wait_for(lambda: procs["sink"].stats.get("spilled", 0) > 1200 and any(open_dir.iterdir()), 20,
             "records to be spilled into an open file")
    procs["sink"].proc.send_signal(signal.SIGKILL)  # mid-stream: batches in flight, an open file
    procs["sink"].proc.wait(timeout=10)
    time.sleep(0.3)
    sink = runner.restart("sink-0")
    wait_for(lambda: procs["source"].stats.get("generated") == n, 30, "the source to finish")
    wait_for(lambda: sink.stats.get("recorded") == n, 30, "the sink to record everything")
    codes = runner.stop_all()
    assert set(codes.values()) == {0}, codes
    assert not list((spool / "sink-0" / "open").iterdir()), "clean stop left an open spool file"
    files = sorted((spool / "sink-0" / "closed").iterdir())
    assert len(files) > 3, "no rotation: test too weak"
    got = spooled_ids(files)
    assert {k for k, v in got.items() if v > 1} == set(), "a record was spooled twice"
    assert set(got) == {("source-0", i) for i in range(n)}, f"spooled {len(got)} of {n} ids"
    ids, dup = read_sink_ids(tmp_path / "sink")
    assert dup == 0 and ids["source-0"] == set(range(n))
    assert sink.stats.get("records_in", 0) > 0, "the restarted sink received nothing: test too weak"


class Events:
    def __init__(self, host: str, port: int, cluster: str) -> None:
        self.got: List[dict] = []
        self.subscribed = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"ev-{time.monotonic_ns()}")
        self.c.on_message = lambda c, u, m: self.got.append(json.loads(m.payload))
        self.c.on_subscribe = lambda *a: self.subscribed.set()
        self.c.connect(host, port)
        self.c.subscribe(topics.events(cluster), qos=1)
        self.c.loop_start()
        assert self.subscribed.wait(10)

    def of(self, etype: str) -> List[dict]:
        return [e for e in self.got if e.get("type") == etype]

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def test_full_spool_holds_the_producer_back_with_an_event_and_loses_nothing(runner, mosquitto, tmp_path: Path) -> None:
    n = 4000
    spool = tmp_path / "spool"
    events = Events(mosquitto.host, mosquitto.port, "spillcap")
    try:
        procs = start(runner, mosquitto, tmp_path, pipeline(2000.0, n), "spillcap",
                      {"dir": str(spool), "max_bytes": 40_000, "rotate_bytes": 8_000, "rotate_seconds": 1.0})
        wait_for(lambda: events.of("spool_full"), 20, "a spool_full event")
        time.sleep(1.0)  # heartbeats catch up; what was in flight settles
        held = procs["source"].stats.get("generated", 0)
        time.sleep(1.5)
        src, sink = procs["source"].stats, procs["sink"].stats
        assert src["generated"] < n and src["generated"] - held < 400, (held, src)  # held back, not at 2000/s
        assert sink["spool_full"] is True and sink["spool_stalls"] > 0, sink
        ev = events.of("spool_full")[0]
        assert ev["instance"] == "sink-0" and ev["detail"]["max_bytes"] == 40_000
        # The "centre" takes the closed files: the sink resumes and everything arrives.
        landing = tmp_path / "landing"
        shipper = PathShipper(SpoolDirs(spool, "n1"), landing)
        stop = threading.Event()

        def ship() -> None:
            while not stop.is_set():
                shipper.ship_once()
                stop.wait(0.2)

        t = threading.Thread(target=ship, daemon=True)
        t.start()
        try:
            wait_for(lambda: procs["sink"].stats.get("recorded") == n, 60, "the sink to record everything")
            codes = runner.stop_all()
        finally:
            stop.set()
            t.join()
        assert set(codes.values()) == {0}, codes
        shipper.ship_once()
        wait_for(lambda: events.of("spool_resumed"), 5, "a spool_resumed event")
    finally:
        events.close()
    got = spooled_ids(list(landing.glob("kind=*/date=*/node=*/*.jsonl.gz")))
    assert max(got.values()) == 1, "a record landed twice"
    assert set(got) == {("source-0", i) for i in range(n)}, f"landed {len(got)} of {n} ids"
    assert not list(spool.glob("*/closed/*")) and not list(spool.glob("*/open/*"))
