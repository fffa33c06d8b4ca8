"""A sink with `[spill] ack = "landed"` on the real broker, with the real shipper and collector:
it acks nothing upstream while its spool files have not landed (the collector is down: its
predecessor runs out of credit and stops), and once the collector lands them it acks, the source
finishes, and every record lands exactly once."""

from __future__ import annotations

import collections
import gzip
from pathlib import Path
from typing import Counter

import pytest

from agent.collector.service import Collector
from agent.operators.builtin import _line_ids
from agent.spill.shipper import MqttShipper
from agent.spill.spool import SpoolDirs
from agent_process import ONLINE_BOUND
from foglab.tools.dataplane_bench import LocalRunner
from test_spill_sink import pipeline, start, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]


def landed_ids(landing: Path) -> Counter:
    c: Counter = collections.Counter()
    for p in landing.glob("kind=*/date=*/node=*/*.jsonl.gz"):
        for line in gzip.decompress(p.read_bytes()).splitlines():
            c.update(_line_ids(line))
    return c


@pytest.fixture
def runner(tmp_path: Path):
    r = LocalRunner(tmp_path, ready_timeout=ONLINE_BOUND)
    yield r
    r.stop_all(timeout=10)


def test_a_sink_acking_once_landed_holds_its_acks_until_the_collector_landed_its_files(
        runner, mosquitto, tmp_path: Path) -> None:
    n, cluster = 3000, "acklanded"
    spool, landing = tmp_path / "spool", tmp_path / "landing"
    shipper = MqttShipper(SpoolDirs(spool, "n1"), cluster, host=mosquitto.host, port=mosquitto.port,
                          ack_timeout=0.5, max_backoff=1.0).start()
    collector = None
    try:
        procs = start(runner, mosquitto, tmp_path, pipeline(1000.0, n), cluster,
                      {"dir": str(spool), "node": "n1", "ack": "landed"})
        sink, source = procs["sink"], procs["source"]
        # The collector is down: the files are closed and shipped, never landed, so never acked.
        wait_for(lambda: sink.stats.get("acks_held", 0) > 0 and shipper.core.stats["file_resends"] >= 2, 30,
                 "held acks and files resent to an absent collector")
        wait_for(lambda: sink.stats.get("recorded", 0) > 0 and sink.stats.get("spill_waiting") == 0, 10,
                 "the sink's heartbeat")
        held = dict(sink.stats)
        generated = source.stats.get("generated", 0)
        assert held["acks_sent"] == 0, held
        assert 0 < held["recorded"] < n and held["acks_held"] > 0, held
        assert generated < n, "the source was never held back: test too weak"
        assert not list(landing.glob("kind=*/*/*/*"))
        assert list(spool.glob("sink-0/closed/*")), "the held batches' file was not closed for shipping"
        # The collector comes: the files land, the shipper releases them, the sink acks.
        collector = Collector(cluster, str(landing), host=mosquitto.host, port=mosquitto.port,
                              client_id="collector-acklanded").start()
        wait_for(lambda: sink.stats.get("acks_sent", 0) > 0, 30, "the sink's first ack after the landing")
        wait_for(lambda: source.stats.get("generated") == n, 60, "the source to finish")
        wait_for(lambda: sink.stats.get("recorded") == n, 30, "the sink to record everything")
        wait_for(lambda: sink.stats.get("acks_held") == 0 and shipper.wait_idle(0.1), 30, "the last landing")
        codes = runner.stop_all()
        assert set(codes.values()) == {0}, codes
        assert shipper.wait_idle(30), shipper.core.stats
    finally:
        shipper.stop()
        if collector is not None:
            collector.stop()
    got = landed_ids(landing)
    assert max(got.values()) == 1, "a record landed twice"
    assert set(got) == {("source-0", i) for i in range(n)}, f"landed {len(got)} of {n} ids"
