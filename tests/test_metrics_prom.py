"""The metrics endpoint parses with Prometheus' own text parser and its counters equal the counts
the processes kept themselves: one process, and an agent serving two worker processes in
prometheus_client multiprocess mode (a crashed/exited worker's counters stay, its gauges leave).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Dict, Tuple

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from agent.measure import metrics

ROOT = Path(__file__).resolve().parent.parent

Key = Tuple[str, Tuple[Tuple[str, str], ...]]


def scrape(url: str) -> Dict[Key, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: Dict[Key, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(samples: Dict[Key, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_every_documented_metric_is_exposed_and_documented() -> None:
    reg = CollectorRegistry()
    m = metrics.Metrics(reg)
    m.instance("p", "o", "o-1").records_in.inc(0)
    text = metrics.render(reg)
    names = {f.name for f in text_string_to_metric_families(text)}
    for name, (kind, _, _, _) in metrics.METRICS.items():
        assert (name[: -len("_total")] if kind == "counter" else name) in names
    doc = (ROOT / "docs" / "fogctl.md").read_text()
    for name in metrics.METRICS:
        assert name in doc, f"{name} is not documented in docs/fogctl.md"


def test_single_process_endpoint_counts(tmp_path) -> None:
    reg = CollectorRegistry()
    m = metrics.Metrics(reg)
    own = {"in": 0, "out": 0, "bad": 0}
    im = m.instance("taxi", "validate", "validate-1")
    for k in range(1, 101):
        im.records_in.inc(k)
        own["in"] += k
        bad = k % 7 == 0
        im.records_invalid.inc(k if bad else 0)
        own["bad"] += k if bad else 0
        im.records_out.inc(0 if bad else k)
        own["out"] += 0 if bad else k
    im.queue.set(42)
    im.load_ratio.set(0.85)
    for t in ("duplication", "duplication_ack", "duplication_ack", "start"):
        m.protocol_message(t, "out")
    m.lock_message("req", "in", 3)
    m.decision("taxi", "validate", "duplicate")
    m.reconnect("agent")
    m.reconnect("agent")
    m.set_instances({("taxi", "validate", "active"): 2, ("taxi", "in_zone", "starting"): 1})
    m.set_instances({("taxi", "validate", "active"): 3})  # in_zone/starting disappears -> 0
    m.set_spool(4096, 2)
    assert metrics.serve(0, registry=reg) is None  # [metrics].port = 0 disables the endpoint
    server = metrics.serve(0, registry=reg, ephemeral=True)
    try:
        s = scrape(server.url)
    finally:
        server.close()
    lab = dict(pipeline="taxi", operator="validate", instance="validate-1")
    assert val(s, "fog_records_in_total", **lab) == own["in"] == 5050
    assert val(s, "fog_records_out_total", **lab) == own["out"]
    assert val(s, "fog_records_invalid_total", **lab) == own["bad"]
    assert own["in"] == own["out"] + own["bad"]
    assert val(s, "fog_queue_length", queue="inbox", **lab) == 42
    assert val(s, "fog_load_ratio", **lab) == 0.85
    assert val(s, "fog_protocol_messages_total", type="duplication_ack", direction="out") == 2
    assert val(s, "fog_lock_messages_total", kind="req", direction="in") == 3
    assert val(s, "fog_scaling_decisions_total", pipeline="taxi", operator="validate", action="duplicate") == 1
    assert val(s, "fog_mqtt_reconnects_total", client="agent") == 2
    assert val(s, "fog_instances", pipeline="taxi", operator="validate", phase="active") == 3
    assert val(s, "fog_instances", pipeline="taxi", operator="in_zone", phase="starting") == 0
    assert (val(s, "fog_spool_bytes"), val(s, "fog_spool_files")) == (4096, 2)


AGENT = textwrap.dedent("""
    import sys
    from agent.measure import metrics
    metrics.enable_multiprocess(sys.argv[1])
    m = metrics.Metrics()
    m.reconnect("agent")
    m.set_instances({("taxi", "in_zone", "active"): 2})
    server = metrics.serve(0, ephemeral=True)
    print(server.port, flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "dead":
            metrics.process_exited(int(arg))
        print("ok", flush=True)
""")

WORKER = textwrap.dedent("""
    import json, random, sys
    from agent.measure import metrics
    k, batches, stay = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "stay"
    m = metrics.Metrics()
    im = m.instance("taxi", "in_zone", f"in_zone-{k}")
    rng = random.Random(k)
    own = {"in": 0, "out": 0, "invalid": 0, "dup": 0}
    for _ in range(batches):
        n = rng.randint(1, 100)
        bad = rng.randint(0, n // 10)
        im.records_in.inc(n); own["in"] += n
        im.records_invalid.inc(bad); own["invalid"] += bad
        im.records_out.inc(n - bad); own["out"] += n - bad
        if rng.random() < 0.1:
            m.protocol_message("duplication", "out"); own["dup"] += 1
    im.queue.set(10 * k)
    print(json.dumps(own), flush=True)
    if stay:
        sys.stdin.read()
""")


def test_multiprocess_agent_endpoint_sums_workers(tmp_path) -> None:
    d = tmp_path / "prom"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(metrics.ENV, None)
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    workers = []
    try:
        port = int(agent.stdout.readline())
        wenv = dict(env, **{metrics.ENV: str(d)})
        w1 = subprocess.Popen([sys.executable, "-c", WORKER, "1", "300", "stay"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=wenv)
        w2 = subprocess.Popen([sys.executable, "-c", WORKER, "2", "500", "exit"], stdout=subprocess.PIPE,
                              text=True, env=wenv)
        workers = [w1, w2]
        own = {1: json.loads(w1.stdout.readline()), 2: json.loads(w2.stdout.readline())}
        assert w2.wait(timeout=30) == 0
        url = f"http://127.0.0.1:{port}/metrics"
        s = scrape(url)
        for k in (1, 2):
            lab = dict(pipeline="taxi", operator="in_zone", instance=f"in_zone-{k}")
            assert val(s, "fog_records_in_total", **lab) == own[k]["in"]
            assert val(s, "fog_records_out_total", **lab) == own[k]["out"]
            assert val(s, "fog_records_invalid_total", **lab) == own[k]["invalid"]
        assert val(s, "fog_protocol_messages_total", type="duplication", direction="out") == own[1]["dup"] + own[2]["dup"]
        assert val(s, "fog_mqtt_reconnects_total", client="agent") == 1
        assert val(s, "fog_instances", pipeline="taxi", operator="in_zone", phase="active") == 2
        q2 = ("fog_queue_length", tuple(sorted(dict(pipeline="taxi", operator="in_zone", instance="in_zone-2",
                                                     queue="inbox").items())))
        assert s[q2] == 20
        # The agent learns that worker 2 exited: its gauge leaves, its counters stay.
        agent.stdin.write(f"dead {w2.pid}\n")
        agent.stdin.flush()
        assert agent.stdout.readline().strip() == "ok"
        s = scrape(url)
        assert q2 not in s
        assert val(s, "fog_queue_length", pipeline="taxi", operator="in_zone", instance="in_zone-1", queue="inbox") == 10
        assert val(s, "fog_records_in_total", pipeline="taxi", operator="in_zone", instance="in_zone-2") == own[2]["in"]
    finally:
        for p in workers + [agent]:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_grafana_dashboard_queries_only_existing_metrics() -> None:
    import re

    dash = json.loads((ROOT / "examples" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    used = {m for e in exprs for m in re.findall(r"\bfog_[a-z_]+", e)}
    assert used <= set(metrics.METRICS), used - set(metrics.METRICS)
    # Every metric family is on the dashboard except the spool file count.
    assert set(metrics.METRICS) - used <= {"fog_spool_files"}


def test_stats_bridge_counters_equal_the_workers_reported_totals() -> None:
    reg = CollectorRegistry()
    m = metrics.Metrics(reg)
    bridge = metrics.StatsBridge(m)
    # Heartbeats of one worker (cumulative), then a restart of the same instance from 0.
    beats = [
        {"records_in": 100, "records_out": 90, "malformed": 1, "operator_errors": 0, "queued": 5, "outbox": 2,
         "load": 300.0, "scale_outs": 0},
        {"records_in": 250, "records_out": 230, "malformed": 3, "operator_errors": 2, "queued": 7, "outbox": 0,
         "load": 450.0, "scale_outs": 1},
        {"records_in": 40, "records_out": 40, "malformed": 0, "operator_errors": 0, "queued": 1, "outbox": 0,
         "load": 100.0, "scale_outs": 0},  # restarted
        {"records_in": 60, "records_out": 59, "malformed": 1, "operator_errors": 0, "queued": 0, "outbox": 0,
         "load": 200.0, "scale_outs": 1, "reconnects": 2},
    ]
    for b in beats:
        bridge.observe("taxi", "in_zone", "in_zone-1", b, capacity=400.0)
    server = metrics.serve(0, registry=reg, ephemeral=True)
    try:
        s = scrape(server.url)
    finally:
        server.close()
    lab = dict(pipeline="taxi", operator="in_zone", instance="in_zone-1")
    assert val(s, "fog_records_in_total", **lab) == 250 + 60  # both incarnations
    assert val(s, "fog_records_out_total", **lab) == 230 + 59
    assert val(s, "fog_records_invalid_total", **lab) == (3 + 2) + 1
    assert val(s, "fog_scaling_decisions_total", pipeline="taxi", operator="in_zone", action="duplicate") == 2
    assert val(s, "fog_mqtt_reconnects_total", client="in_zone-1") == 2
    assert val(s, "fog_queue_length", queue="inbox", **lab) == 0
    assert val(s, "fog_load_ratio", **lab) == 0.5
