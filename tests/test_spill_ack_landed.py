"""A sink with `[spill] ack = "landed"` on the real broker, with the real shipper and collector:
it acks nothing upstream while its spool files have not landed (the collector is down: its
predecessor runs out of credit and stops), and once the collector lands them it acks, the source
finishes, and every record lands exactly once. Its node's disk lost (spool and ids gone) before
anything landed: nothing is lost, its predecessor replays it all; with "written" the records it
had acked are gone."""

from __future__ import annotations

import collections
import gzip
import shutil
import signal
from pathlib import Path
from typing import Counter

import pytest

from agent.collector.service import Collector
from agent.operators.builtin import _line_ids, _read_ids
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


def read_ids(path: Path) -> list:
    return [tuple(x) for x in _read_ids(path)] if path.exists() else []


def node_shipper(spool: Path, cluster: str, mosquitto) -> MqttShipper:
    """Node n1's shipper of `spool`, quick to resend to an absent collector."""
    return MqttShipper(SpoolDirs(spool, "n1"), cluster, host=mosquitto.host, port=mosquitto.port,
                       ack_timeout=0.5, max_backoff=1.0).start()


@pytest.fixture
def runner(tmp_path: Path):
    r = LocalRunner(tmp_path, ready_timeout=ONLINE_BOUND)
    yield r
    r.stop_all(timeout=10)


def test_a_sink_acking_once_landed_holds_its_acks_until_the_collector_landed_its_files(
        runner, mosquitto, tmp_path: Path) -> None:
    n, cluster = 3000, "acklanded"
    spool, landing = tmp_path / "spool", tmp_path / "landing"
    shipper = node_shipper(spool, cluster, mosquitto)
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


@pytest.mark.parametrize("ack", ["landed", "written"])
def test_the_disk_of_a_sink_lost_before_its_files_landed(runner, mosquitto, tmp_path: Path, ack: str) -> None:
    """kill -9 of the sink and its spool and ids deleted (the node's disk lost) while the collector
    is down; the sink starts again (re-homed under the same identity) and the collector comes.
    "landed": every record lands (its predecessor still held all it had sent); "written": the
    records the sink had acked are lost (the documented limit of the default)."""
    n, cluster = 2000, f"acklost{ack}"
    spool, landing = tmp_path / "spool", tmp_path / "landing"
    shipper = node_shipper(spool, cluster, mosquitto)
    collector = None
    try:
        procs = start(runner, mosquitto, tmp_path, pipeline(1000.0, n), cluster,
                      {"dir": str(spool), "node": "n1", "ack": ack, "rotate_seconds": 0.5})
        sink, source = procs["sink"], procs["source"]
        enough = (lambda st: st.get("acks_held", 0) > 0) if ack == "landed" else (lambda st: st.get("recorded", 0) >= 200)
        wait_for(lambda: enough(sink.stats) and shipper.core.stats["files_sent"] > 0, 30,
                 "records spooled and files shipped to an absent collector")
        sink.proc.send_signal(signal.SIGKILL)
        sink.proc.wait(timeout=10)
        shipper.stop()  # the node's daemon goes with it, and the files it was sending
        ids_file = tmp_path / "sink" / "sink-0.ids"
        before = set(read_ids(ids_file))
        assert before, "nothing recorded before the loss: test too weak"
        shutil.rmtree(spool / "sink-0")
        ids_file.unlink()
        sink = runner.restart("sink-0")
        shipper = node_shipper(spool, cluster, mosquitto)  # the node it runs on now
        collector = Collector(cluster, str(landing), host=mosquitto.host, port=mosquitto.port,
                              client_id=f"collector-{cluster}").start()
        wait_for(lambda: source.stats.get("generated") == n, 60, "the source to finish")
        # Every record reaches one incarnation or the other: what the lost one had not acked is
        # replayed to the new one.
        everything = {("source-0", i) for i in range(n)}
        wait_for(lambda: before | set(read_ids(ids_file)) == everything, 60, "every record recorded somewhere")
        wait_for(lambda: sink.stats.get("acks_held") == 0, 30, "the new incarnation's acks")
        codes = runner.stop_all()
        assert set(codes.values()) == {0}, codes
        assert shipper.wait_idle(30), shipper.core.stats
    finally:
        shipper.stop()
        if collector is not None:
            collector.stop()
    got = landed_ids(landing)
    assert got and max(got.values()) == 1, "a record landed twice"
    assert set(got) == set(read_ids(ids_file)), "the new incarnation's records did not all land"
    missing = everything - set(got)
    if ack == "landed":
        assert missing == set(), f"{len(missing)} records lost with the sink's disk"
    else:  # acked by the lost incarnation once written, so never replayed: gone with its disk
        assert missing and missing <= before, (len(missing), len(before))
