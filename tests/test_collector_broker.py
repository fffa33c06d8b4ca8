"""Shipper -> Mosquitto -> collector, for real: collector outages, resends, a damaged chunk."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Dict

import pytest

from agent.collector.service import Collector
from agent.spill.shipper import MqttShipper
from agent.spill.shipping import Outgoing
from agent.spill.spool import Spool, file_id, read_records

pytestmark = pytest.mark.broker


def fill_spool(path: Path, node: str, n: int, seed: int) -> Spool:
    rng = random.Random(seed)
    s = Spool(path, node, rotate_bytes=8000, sync_bytes=2000)
    for i in range(n):
        s.append("records", {"record_id": f"{node}-{i}", "fare": rng.uniform(3, 50), "r": rng.getrandbits(40)})
        if i % 100 == 0:
            s.append("metrics", {"t": i, "node": node})
    s.rotate_all()
    return s


def originals(s: Spool) -> Dict[str, bytes]:
    return {file_id(f.path.read_bytes()): f.path.read_bytes() for f in s.closed_files()}


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assert_landed_exactly(landing_root: Path, expected: Dict[str, bytes]) -> None:
    landed = list(landing_root.glob("kind=*/date=*/node=*/*.jsonl.gz"))
    ids = [p.name.split(".")[0] for p in landed]
    assert len(ids) == len(set(ids)), "a file landed twice"
    assert sorted(ids) == sorted(expected), "landing zone differs from what was spooled"
    for p in landed:
        assert p.read_bytes() == expected[p.name.split(".")[0]]
    ledger = [json.loads(x)["file_id"] for x in (landing_root / "_ledger.jsonl").read_text().splitlines()]
    assert sorted(ledger) == sorted(expected)


def test_collector_down_then_back_every_file_lands_exactly_once(mosquitto, tmp_path: Path) -> None:
    cluster = "spilldown"
    landing = tmp_path / "landing"
    client_id = "collector-spilldown"
    # The collector's persistent session exists (it ran before), then it goes down.
    c1 = Collector(cluster, str(landing), host=mosquitto.host, port=mosquitto.port, client_id=client_id).start()
    wait_for(c1.connected.is_set, 10, "collector connected")
    c1.stop()

    spools = {node: fill_spool(tmp_path / node, node, 1500, seed) for seed, node in enumerate(("n1", "n2"))}
    expected = {}
    for s in spools.values():
        expected.update(originals(s))
    assert len(expected) >= 10
    counts = {node: len(s.closed_files()) for node, s in spools.items()}
    shippers = [MqttShipper(s, cluster, host=mosquitto.host, port=mosquitto.port, chunk_bytes=3000,
                            ack_timeout=0.5, max_backoff=1.0, window=4).start() for s in spools.values()]
    try:
        # While the collector is down: nothing is acked, so nothing leaves any spool; files are
        # resent on timeout (duplicates pile up in the broker's queue for the collector).
        wait_for(lambda: all(sh.core.stats["file_resends"] >= 2 for sh in shippers), 20, "resends")
        assert {node: len(s.closed_files()) for node, s in spools.items()} == counts
        assert not landing.exists() or not list(landing.glob("kind=*/date=*/node=*/*"))
        c2 = Collector(cluster, str(landing), host=mosquitto.host, port=mosquitto.port, client_id=client_id).start()
        try:
            for sh in shippers:
                assert sh.wait_idle(60), f"spool of {sh.spool.node} not drained: {sh.core.stats}"
            assert c2.core.stats["duplicates"] > 0, "no resend reached the collector: test too weak"
        finally:
            c2.stop()
    finally:
        for sh in shippers:
            sh.stop()
    assert_landed_exactly(landing, expected)
    records = [r for p in landing.glob("kind=records/*/*/*.jsonl.gz") for r in read_records(p.read_bytes())]
    ids = [r["record_id"] for r in records]
    assert len(ids) == len(set(ids)) == 3000


def test_corrupted_chunk_is_detected_resent_and_never_landed(mosquitto, tmp_path: Path) -> None:
    cluster = "spillcorrupt"
    landing = tmp_path / "landing"
    s = fill_spool(tmp_path / "n1", "n1", 800, 42)
    expected = originals(s)
    damaged = []

    def tamper(out: Outgoing) -> Outgoing:
        # The first transmission of chunk 1 of every file is damaged on the wire.
        key = (out.file_id, out.index)
        if out.index == 1 and key not in damaged:
            damaged.append(key)
            head, _, body = out.payload.partition(b"\n")
            body = bytes([body[0] ^ 0xFF]) + body[1:]
            return Outgoing(out.topic, head + b"\n" + body, out.file_id, out.index)
        return out

    coll = Collector(cluster, str(landing), host=mosquitto.host, port=mosquitto.port,
                     client_id="collector-corrupt").start()
    wait_for(coll.connected.is_set, 10, "collector connected")
    sh = MqttShipper(s, cluster, host=mosquitto.host, port=mosquitto.port, chunk_bytes=2000,
                     ack_timeout=5.0, window=4, tamper=tamper).start()
    try:
        assert sh.wait_idle(60), f"not drained: {sh.core.stats} {coll.core.stats}"
    finally:
        sh.stop()
        coll.stop()
    assert damaged, "no multi-chunk file: the test proves nothing"
    assert coll.core.stats["corrupt_chunks"] == len(damaged)
    assert sh.core.stats["nacks"] == len(damaged) and sh.core.stats["chunk_resends"] >= len(damaged)
    assert coll.core.stats["corrupt_files"] == 0  # caught per chunk, before assembly
    assert_landed_exactly(landing, expected)


def test_agent_restart_resumes_shipping_where_it_stopped(mosquitto, tmp_path: Path) -> None:
    """The agent stops mid-shipping (some files acked, one in flight); a new process on the same
    spool directory ships the rest: every file lands once, none is left behind."""
    cluster = "spillrestart"
    landing = tmp_path / "landing"
    s1 = fill_spool(tmp_path / "n1", "n1", 2000, 9)
    expected = originals(s1)
    coll = Collector(cluster, str(landing), host=mosquitto.host, port=mosquitto.port,
                     client_id="collector-restart").start()
    wait_for(coll.connected.is_set, 10, "collector connected")
    try:
        sh1 = MqttShipper(s1, cluster, host=mosquitto.host, port=mosquitto.port, chunk_bytes=3000,
                          window=1, ack_timeout=2.0).start()
        wait_for(lambda: sh1.core.stats["files_acked"] >= 2, 30, "two files acked")
        sh1.stop()  # the agent goes down
        left = len(s1.closed_files())
        assert 0 < left < len(expected)
        s2 = Spool(tmp_path / "n1", "n1")  # the restarted agent
        assert len(s2.closed_files()) == left
        sh2 = MqttShipper(s2, cluster, host=mosquitto.host, port=mosquitto.port, chunk_bytes=3000,
                          ack_timeout=2.0).start()
        try:
            assert sh2.wait_idle(60), sh2.core.stats
        finally:
            sh2.stop()
    finally:
        coll.stop()
    assert_landed_exactly(landing, expected)
