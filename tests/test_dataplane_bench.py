"""`bench dataplane`'s raw limit is honest (issue 26): windowed on messages the subscriber received,
timed up to the last one received, and a run in which the broker dropped a message fails.

Real parts: a private Mosquitto per test (tiny queues where a drop must happen), the real
publisher/subscriber code of the bench, and the CLI as a subprocess for the exit code and the
`--json` stdout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from foglab.tools.broker import start_private_broker
from foglab.tools.dataplane_bench import DropWatch, measure_raw, measure_raw_2proc

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "bench", "dataplane", "--record", "tiny", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_raw_is_windowed_on_delivered_messages_and_timed_to_the_last_one(tmp_path: Path) -> None:
    """A broker that queues at most 8 messages per client and sends 1 at a time: a publisher
    windowed on the broker's PUBACKs overflows it at once; windowed on receipts (8 batches) it
    never does, every message sent is received, and the time ends at the last receipt (no
    drain timeout added). Two seconds, not less: CPU times are sampled per clock tick (10 ms), and
    in half a second on a loaded machine the broker was charged no tick at all."""
    broker = start_private_broker(tmp_path / "b", max_queued=8, max_inflight=1)
    drops = DropWatch(broker.host, broker.port)
    try:
        with drops.phase("raw_1proc"):
            r1 = measure_raw(broker.host, broker.port, 10, "tiny", 2.0, broker_pid=broker.pid, window=8)
        with drops.phase("raw_2proc"):
            r2 = measure_raw_2proc(broker.host, broker.port, 10, "tiny", 2.0, broker_pid=broker.pid, window=8)
    finally:
        drops.close()
        broker.stop()
    assert drops.per_phase == {"raw_1proc": 0.0, "raw_2proc": 0.0}
    for r, procs in ((r1, {"process", "broker"}), (r2, {"publisher", "subscriber", "broker"})):
        assert r["delivered"] == r["sent"] > 50
        assert 2.0 <= r["elapsed_s"] < 2.3  # up to the last receipt: the publishing time plus one window
        assert r["records_per_s"] == pytest.approx(r["delivered"] * 10 / r["elapsed_s"], rel=1e-3)
        assert set(r["cpu_ms_per_batch"]) == procs and all(v > 0 for v in r["cpu_ms_per_batch"].values())


def test_a_message_the_broker_drops_fails_the_bench(tmp_path: Path) -> None:
    """Window 64 against a broker queue of 4: the broker drops, the dropped messages never
    arrive, and the bench exits 1 naming the drop instead of printing a rate; stdout is still
    pure JSON (the partial result with the error and the drop count)."""
    p = _bench("--seconds", "0.5", "--rescale-cycles", "0", "--raw-window", "64",
               "--broker-max-queued", "4", "--broker-max-inflight", "1", "--json")
    assert p.returncode == 1, p.stderr
    assert "error: bench dataplane failed: raw_1proc: the broker dropped" in p.stderr
    res = json.loads(p.stdout)
    assert res["dropped"]["raw_1proc"] > 0 and "dropped" in res["error"]
    assert "raw_1proc" not in res and "pipeline" not in res  # no number from an invalid phase


def test_json_stdout_parses_and_reports_both_raws(tmp_path: Path) -> None:
    p = _bench("--seconds", "0.5", "--rescale-cycles", "0", "--chain", "--rounds", "2", "--slice", "1", "--json",
               timeout=120.0)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)  # pure JSON: progress went to stderr
    assert "bench dataplane: raw, one process" in p.stderr
    assert set(res["dropped"]) == {"raw_1proc", "raw_2proc", "raw_1proc_encoding", "pipeline", "chained", "chained_tail",
                                   "alternating"}
    assert not any(res["dropped"].values())
    pipe = res["pipeline"]["records_per_s"]
    assert pipe > 0
    assert res["ratio"] == pytest.approx(pipe / res["raw_1proc"]["records_per_s"])
    assert res["ratio_vs_raw_2proc"] == pytest.approx(pipe / res["raw_2proc"]["records_per_s"])
    for part in ("raw_1proc", "raw_2proc", "raw_1proc_encoding"):
        assert res[part]["delivered"] == res[part]["sent"] > 0
    assert set(res["raw_2proc"]["cpu_ms_per_batch"]) == {"publisher", "subscriber", "broker"}
    assert {"source", "map", "sink", "broker"} <= set(res["pipeline"]["cpu_ms_per_batch"])
    # --chain: the same pipeline in one chain process, batches handed over in memory
    ch = res["chained"]
    assert ch["records_per_s"] > 0 and {"chain", "broker", "bench"} <= set(ch["cpu_ms_per_batch"])
    assert ch["vs_unchained"] == pytest.approx(ch["records_per_s"] / pipe)
    assert ch["members"]["map-0"]["handed_in"] > 0 and ch["members"]["map-0"].get("mqtt_in", 0) == 0
    assert 0 < ch["rss_mb"]["chain"]
    tail = res["chained_tail"]  # the source alone, one MQTT hop into the chain
    assert tail["records_per_s"] > 0 and {"chain", "source", "broker"} <= set(tail["cpu_ms_per_batch"])
    assert tail["members"]["map-0"]["handed_in"] == 0 and tail["members"]["sink-0"]["handed_in"] > 0
    # Every record the source generated reached the sink once (a count balance after the source
    # paused: the throughput phases use the null sink, which keeps no ids).
    for part in (res["pipeline"], ch, tail):
        c = part["count_check"]
        assert c["generated"] == c["recorded"] > 0 and c["missing"] == 0

    # The alternating phase: per round, each pipeline's slice divided by that round's raws (never
    # another round's), every slice measured between two heartbeats ~1 s apart while its source
    # ran, and everything it generated recorded before the next slice.
    alt = res["alternating"]
    assert len(alt["rounds"]) == 2 and alt["slice_s"] == 1.0
    for rnd in alt["rounds"]:
        r1, r2 = rnd["raw_1proc"]["records_per_s"], rnd["raw_2proc"]["records_per_s"]
        assert rnd["raw_1proc"]["delivered"] == rnd["raw_1proc"]["sent"] > 0 and r2 > 0
        for name in ("chained", "chained_tail", "pipeline"):
            sl = rnd[name]
            assert sl["records_per_s"] > 0 and 0.9 <= sl["elapsed_s"] < 2.5
            assert sl["ratio"] == pytest.approx(sl["records_per_s"] / r1)
            assert sl["ratio_vs_raw_2proc"] == pytest.approx(sl["records_per_s"] / r2)
            assert sl["count_check"]["missing"] == 0 and sl["count_check"]["recorded"] > 0
    for name in ("chained", "chained_tail", "pipeline"):
        ratios = sorted(r[name]["ratio"] for r in alt["rounds"])
        assert alt["median"][name]["ratio"] == pytest.approx(sum(ratios) / 2)
