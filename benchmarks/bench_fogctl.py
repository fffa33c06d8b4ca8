"""fogctl and metrics benchmarks; prints numbers with their baselines measured in the same run.

1. Fleet snapshot (what `fogctl status` waits for) with N retained node states on a private
   Mosquitto: fogctl's sync-marker snapshot vs the "subscribe, then wait until 0.3 s of quiet"
   baseline (what a tool without the marker must do). Goal: well under 100 ms for 100 nodes.
2. Metrics cost in the data path, per call: a plain Python int increment (baseline), a
   prometheus_client counter child in one process, and the same in multiprocess mode (mmap file).
   Goal: a per-batch increment costs < 5 us, i.e. negligible next to a 100-record batch.

Run: .venv/bin/python benchmarks/bench_fogctl.py [--nodes 100] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(tmp: Path) -> "tuple[subprocess.Popen, int]":
    port = free_port()
    conf = tmp / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 10000\n")
    proc = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("mosquitto did not start")


def publish_fleet(port: int, cluster: str, nodes: int) -> None:
    import paho.mqtt.client as mqtt

    from agent import topics

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    infos = []
    for k in range(nodes):
        node = f"n{k}"
        state = {"node": node, "time": time.time(), "cpu": 10.0, "memory": 30.0, "temperature": 50.0,
                 "slots": 8, "free_slots": 0,
                 "instances": [{"id": f"op{j}-{node}", "operator": f"op{j}", "keeper": j == 0, "status": "active",
                                "load": 100.0, "capacity": 500.0} for j in range(8)]}
        infos.append(c.publish(topics.agent_state(cluster, node), json.dumps(state), qos=1, retain=True))
        infos.append(c.publish(topics.agent_status(cluster, node), b"online", qos=1, retain=True))
    for i in infos:
        i.wait_for_publish(10)
    c.disconnect()
    c.loop_stop()


def snapshot_marker(port: int, cluster: str) -> "tuple[float, int]":
    from agent.fogctl.client import Connection
    from agent.fogctl.commands import fleet_snapshot
    from agent.fogctl.config import FogctlConfig

    t0 = time.perf_counter()
    with Connection(FogctlConfig(broker=f"127.0.0.1:{port}", cluster=cluster)) as conn:
        fleet = fleet_snapshot(conn, cluster)
    return time.perf_counter() - t0, len(fleet.nodes)


def snapshot_quiet(port: int, cluster: str, quiet: float = 0.3) -> "tuple[float, int]":
    import paho.mqtt.client as mqtt

    from agent import topics

    got: "queue.Queue[str]" = queue.Queue()
    t0 = time.perf_counter()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.on_message = lambda cl, u, m: got.put(m.topic)
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.subscribe([(topics.all_agents_state(cluster), 1), (topics.all_agents_status(cluster), 1)])
    seen = set()
    while True:
        try:
            seen.add(got.get(timeout=quiet))
        except queue.Empty:
            break
    c.disconnect()
    c.loop_stop()
    return time.perf_counter() - t0, len({t.split("/")[3] for t in seen})


def bench_snapshot(nodes: int, repeat: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-fogctl-"))
    proc, port = start_broker(tmp)
    try:
        publish_fleet(port, "bench", nodes)
        marker, quiet = [], []
        for _ in range(repeat):
            t, n = snapshot_marker(port, "bench")
            assert n == nodes, (n, nodes)
            marker.append(t)
            t, n = snapshot_quiet(port, "bench")
            assert n == nodes, (n, nodes)
            quiet.append(t)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"nodes": nodes, "marker_ms": 1000 * statistics.median(marker),
            "quiet_0.3s_baseline_ms": 1000 * statistics.median(quiet)}


METRICS_CODE = textwrap.dedent("""
    import json, sys, time, tempfile
    from agent.measure import metrics
    mode = sys.argv[1]
    n = int(sys.argv[2])
    if mode == "multiprocess":
        metrics.enable_multiprocess(tempfile.mkdtemp(prefix="bench-prom-"))
        m = metrics.Metrics()
    else:
        from prometheus_client import CollectorRegistry
        m = metrics.Metrics(CollectorRegistry())
    child = m.instance("p", "o", "o-1").records_in
    x = 0
    t0 = time.perf_counter()
    if mode == "int":
        for _ in range(n):
            x += 100
    else:
        for _ in range(n):
            child.inc(100)
    print(json.dumps((time.perf_counter() - t0) / n * 1e9))
""")


def bench_metrics(n: int) -> dict:
    out = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    for mode in ("int", "single", "multiprocess"):
        r = subprocess.run([sys.executable, "-c", METRICS_CODE, mode, str(n)], capture_output=True, text=True,
                           env=env, check=True)
        out[f"{mode}_ns_per_inc"] = float(r.stdout)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--incs", type=int, default=200_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = {"snapshot": bench_snapshot(args.nodes, args.repeat), "metrics": bench_metrics(args.incs)}
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        s, m = res["snapshot"], res["metrics"]
        print(f"fleet snapshot, {s['nodes']} nodes x 8 instances (median of {args.repeat}):")
        print(f"  fogctl sync marker        {s['marker_ms']:8.1f} ms")
        print(f"  baseline: 0.3 s of quiet  {s['quiet_0.3s_baseline_ms']:8.1f} ms")
        print(f"metrics increment, per call ({args.incs} calls):")
        print(f"  baseline: python int +=   {m['int_ns_per_inc']:8.0f} ns")
        print(f"  prometheus, one process   {m['single_ns_per_inc']:8.0f} ns")
        print(f"  prometheus, multiprocess  {m['multiprocess_ns_per_inc']:8.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
