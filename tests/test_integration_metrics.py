"""The agent's /metrics endpoint on real agents: counters equal the workers' own counts.

Why: the endpoint is what Prometheus scrapes; if it drifts from what the instances count (a
missed heartbeat, a double add on restart) dashboards lie. Two agents with `[metrics].port` set
run a small pipeline; after the source is paused and the pipeline is quiet, every instance's
fog_records_in/out_total on its node's endpoint equals the counts the worker reports itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict

import pytest

import prometheus_client  # noqa: E402,F401

from pipelines import taxi_in_zone  # noqa: E402

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parent.parent

PIPELINE = taxi_in_zone("met", seed=5, rate=50.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> Dict[Any, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, s.labels.get("instance")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_endpoint_counters_equal_the_agents_own_counts(mosquitto: Any, tmp_path: Path) -> None:
    from foglab.tools.demo import Monitor, wait_online
    from agent.node.deploy import deploy
    from agent.node.deploy import RpcClient

    cluster = "m" + uuid.uuid4().hex[:8]
    ports = {"m1": free_port(), "m2": free_port()}
    procs = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    for node, port in ports.items():
        conf = tmp_path / f"{node}.toml"
        conf.write_text(
            f'[agent]\nnode = "{node}"\ncluster = "{cluster}"\nslots = 2\nstate_dir = "{tmp_path}/state-{node}"\n'
            f'sink_dirs = ["{tmp_path}/sink"]\n'
            f"state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 5.0\n"
            f'[mqtt]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\n[metrics]\nport = {port}\n')
        log = open(tmp_path / f"{node}.log", "w")
        procs[node] = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(conf)],
                                       stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        log.close()
    mon = Monitor(mosquitto.host, mosquitto.port, cluster)
    try:
        wait_online(mon, procs)
        placed = deploy(PIPELINE, mosquitto.host, mosquitto.port, cluster,
                        extra={"sink_dir": str(tmp_path / "sink")}, timeout=30)
        where = {d.instance: d.node for d in placed}

        def flowing(m: Any) -> bool:
            return int((m.instance_stats.get("met.sink.0") or {}).get("records_in", 0)) > 50

        assert mon.wait(flowing, 30)
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            assert client.call(where["met.source.0"], {"op": "set", "instance": "met.source.0",
                                                        "fields": {"paused": True}})["ok"]

        def totals(m: Any) -> Any:
            return tuple((i, (m.instance_stats.get(i) or {}).get("records_in"),
                          (m.instance_stats.get(i) or {}).get("records_out")) for i in sorted(where))

        last, since, deadline = None, time.monotonic(), time.monotonic() + 30
        while time.monotonic() < deadline:
            t = totals(mon)
            if t != last:
                last, since = t, time.monotonic()
            elif time.monotonic() - since >= 2.0:
                break
            time.sleep(0.2)
        time.sleep(1.0)  # a few more heartbeats (same values) reach the bridge
        own = {i: mon.instance_stats[i] for i in where}
        checked = 0
        for inst, node in where.items():
            samples = scrape(ports[node])
            st = own[inst]
            assert samples.get(("fog_records_in_total", inst), 0.0) == st.get("records_in", 0), (inst, st)
            assert samples.get(("fog_records_out_total", inst), 0.0) == st.get("records_out", 0), (inst, st)
            checked += 1
        assert checked == 3 and own["met.sink.0"]["records_in"] > 50
        # and an instance of the other node is not on this node's endpoint
        other = {n: [i for i, nn in where.items() if nn != n] for n in ports}
        for node, insts in other.items():
            samples = scrape(ports[node])
            for inst in insts:
                assert ("fog_records_in_total", inst) not in samples
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        mon.close()
