"""`fog-agent bench fleet --nodes N`: what an idle fleet of N real agents costs on one broker.

Issue #40, part 1 ("scale measured"). N `fog-agent run` processes, each with its own agent.toml
and state dir under a temp dir (1 slot each, the production periods: `state_period` 5 s,
`[latency] period` 5 s), on one private Mosquitto (foglab.tools.broker). Once every agent says
online and a settle time has passed (the first state and latency rounds are out), one window of
`--seconds` measures:

- every publication on `fog/<cluster>/#`, seen once by a counting subscriber of this process,
  split by topic kind (agent.topics.parse: state, status, hosted, latency, ping, pong, reply,
  events, ...) and attributed to the node that published it;
- the broker's fan-out of each publication, computed from the subscriptions the daemon makes
  (`AGENT_FILTERS`, a copy of `agent.node.bus.subscriptions` and `LatencyCore.subscriptions`) with
  paho's own matcher, so "messages in per node" is what the broker delivers to that agent; checked
  against `$SYS/broker/publish/messages/sent` (minus this subscriber's own share);
- each agent's CPU (psutil, user + system over the window, its children included) and RSS, the
  broker's CPU and RSS;
- then the real CLI: `fogctl --json status` (3 times), `fogctl deploy` and `fogctl undeploy` of a
  two-operator pipeline (a 5 records/s source and a counting sink), wall seconds each.

The model (`fit_model`, `extrapolate`) is sans-IO and tested (tests/test_fleet_bench.py): per
topic kind, publications per node per second and bytes per publication as a + b*N, fan-out per
publication as a + b*N (1 for a directed message, N for a record every agent reads), fitted on
the measured N, evaluated at 1,000 nodes. docs/scale.md has the runs and what they mean.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import agent
from agent import topics

ROOT = Path(agent.__file__).resolve().parents[1]
CLUSTER = "bench"

AGENT_TOML = """\
[agent]
node = "{node}"
cluster = "{cluster}"
slots = {slots}
state_dir = "{state_dir}"
sink_dirs = ["{sink_dir}"]

[mqtt]
host = "127.0.0.1"
port = {port}

[metrics]
port = 0
"""

PIPELINE_TOML = """\
[pipeline]
name = "fleetbench"

[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
params = { seed = 1, profile = "constant", rate = 5.0 }

[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""

# The subscriptions of one agent (agent/node/bus.py, subscriptions, and
# agent/measure/latency.py, LatencyCore.subscriptions): "{n}" is the agent's node. Those without
# "{n}" are the cluster-wide ones: every agent gets every publication on them.
AGENT_FILTERS = (
    "agents/{n}/rpc/+",
    "agents/{n}/peer/+",
    "replies/{n}/+",
    "agents/+/state",
    "agents/+/status",
    "latency/+",
    "agents/+/hosted",
    "agents/+/rehomed",
    "pipelines/+",
    "agents/+/site_manager",
    "latency/{n}/ping/+",
    "latency/{n}/pong/+",
)

# ---- sans-IO: classification, fan-out, the model ------------------------------------------------


def publisher(cluster: str, topic: str, payload: bytes) -> Tuple[str, Optional[str]]:
    """(topic kind, the node or client that published it) of one publication on the bus."""
    p = topics.parse(cluster, topic)
    if p is None:
        return ("other", None)
    if p.kind in ("state", "status", "hosted", "rehomed", "latency"):
        return (p.kind, p.node)
    if p.kind in ("ping", "reply", "rpc", "peer", "pong"):
        # ping latency/<target>/ping/<sender>; pong latency/<sender>/pong/<target> (written by
        # target); reply replies/<requester>/<replier>; rpc/peer agents/<node>/<kind>/<requester>
        return (p.kind, p.sender)
    if p.kind == "events":
        try:
            node = json.loads(payload).get("node")
        except (ValueError, AttributeError):
            node = None
        return ("events", node if isinstance(node, str) else None)
    return (p.kind, p.node)


def agent_filters(cluster: str, node: str) -> List[str]:
    return [f"{topics.base(cluster)}/{f.format(n=node)}" for f in AGENT_FILTERS]


# Kinds every agent receives (a filter with "+" for the node) and kinds only the addressed node
# receives (its own node in the filter): `receivers` without paho's matcher, which at N=60 (3,600
# ping topics x 60 agents x 12 filters) took minutes on the loaded machine. The test checks both
# ways agree.
BROADCAST = frozenset({"state", "status", "hosted", "rehomed", "latency", "pipeline", "site_manager"})
DIRECTED = frozenset({"rpc", "peer", "reply", "ping", "pong"})


def receivers(cluster: str, topic: str, nodes: Sequence[str], exact: bool = False) -> List[str]:
    """The agents among `nodes` the broker delivers `topic` to (one delivery per agent even if
    several of its filters match: Mosquitto's default, `allow_duplicate_messages false`).
    exact: match every filter of `agent_filters` with paho's matcher instead of by topic kind."""
    p = topics.parse(cluster, topic)
    if not exact and p is not None and p.kind in BROADCAST:
        return list(nodes)
    if not exact and p is not None and p.kind in DIRECTED:
        return [p.node] if p.node in nodes else []
    from paho.mqtt.client import topic_matches_sub

    return [n for n in nodes if any(topic_matches_sub(f, topic) for f in agent_filters(cluster, n))]


def linfit(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """(a, b) of y = a + b*x by least squares; one point: (y, 0)."""
    n = len(xs)
    if n == 0:
        return (0.0, 0.0)
    if n == 1 or len(set(xs)) == 1:
        return (sum(ys) / n, 0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return (my - b * mx, b)


def growing_fit(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """`linfit`, but a negative slope is taken as noise around a constant (the mean): no cost of
    the fleet shrinks as it grows, and extrapolated 30 -> 1,000 a slope of -0.001 would erase it."""
    a, b = linfit(xs, ys)
    return (sum(ys) / len(ys), 0.0) if b < 0 and ys else (a, b)


def fit_model(runs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Tuple[float, float]]]:
    """Per topic kind, fitted over the runs (each `run["kinds"][kind]` has `pubs_per_node_s`,
    `bytes_per_pub`, `fanout`): pubs per node per second, bytes per publication and fan-out per
    publication, each (a, b) of a + b*N (`growing_fit`)."""
    kinds = sorted({k for r in runs for k in r["kinds"]})
    model: Dict[str, Dict[str, Tuple[float, float]]] = {}
    for k in kinds:
        pts = [(r["nodes"], r["kinds"].get(k)) for r in runs]
        ns = [float(n) for n, _ in pts]
        get = lambda key: [float(v[key]) if v else 0.0 for _, v in pts]  # noqa: E731
        model[k] = {"pubs_per_node_s": growing_fit(ns, get("pubs_per_node_s")),
                    "bytes_per_pub": growing_fit(ns, get("bytes_per_pub")),
                    "fanout": growing_fit(ns, get("fanout"))}
    return model


def extrapolate(model: Dict[str, Dict[str, Tuple[float, float]]], n: int) -> Dict[str, Any]:
    """The broker's and one agent's load at `n` nodes from `fit_model`'s lines."""
    ev = lambda ab: max(0.0, ab[0] + ab[1] * n)  # noqa: E731
    out: Dict[str, Any] = {"nodes": n, "kinds": {}}
    tot = defaultdict(float)
    for k, m in model.items():
        pubs = ev(m["pubs_per_node_s"]) * n
        size = ev(m["bytes_per_pub"])
        fan = ev(m["fanout"])
        row = {"broker_in_msgs_s": pubs, "broker_out_msgs_s": pubs * fan,
               "broker_in_bytes_s": pubs * size, "broker_out_bytes_s": pubs * fan * size}
        out["kinds"][k] = row
        for key, v in row.items():
            tot[key] += v
    out.update(tot)
    out["per_node_in_msgs_s"] = tot["broker_out_msgs_s"] / n
    out["per_node_in_bytes_s"] = tot["broker_out_bytes_s"] / n
    out["per_node_out_msgs_s"] = tot["broker_in_msgs_s"] / n
    out["per_node_out_bytes_s"] = tot["broker_in_bytes_s"] / n
    return out


def summarize_window(cluster: str, nodes: Sequence[str], pubs: Sequence[Tuple[str, bytes]], seconds: float) -> Dict[str, Any]:
    """Per kind and per node, from the publications seen in a window of `seconds`."""
    n = len(nodes)
    kinds: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    node_in = defaultdict(lambda: [0, 0])
    node_out = defaultdict(lambda: [0, 0])
    fan_cache: Dict[str, List[str]] = {}
    for topic, payload in pubs:
        kind, who = publisher(cluster, topic, payload)
        size = len(topic) + len(payload)
        rec = fan_cache.get(topic)
        if rec is None:
            rec = fan_cache[topic] = receivers(cluster, topic, nodes)
        k = kinds[kind]
        k["pubs"] += 1
        k["bytes"] += size
        k["deliveries"] += len(rec)
        k["delivered_bytes"] += len(rec) * size
        if who in node_out or who in nodes:
            node_out[who][0] += 1
            node_out[who][1] += size
        for r in rec:
            node_in[r][0] += 1
            node_in[r][1] += size
    out_kinds = {}
    for kind, k in sorted(kinds.items()):
        out_kinds[kind] = {
            "pubs_s": k["pubs"] / seconds, "pubs_per_node_s": k["pubs"] / seconds / n,
            "bytes_per_pub": k["bytes"] / k["pubs"] if k["pubs"] else 0.0,
            "fanout": k["deliveries"] / k["pubs"] if k["pubs"] else 0.0,
            "deliveries_s": k["deliveries"] / seconds, "delivered_bytes_s": k["delivered_bytes"] / seconds,
            "in_msgs_per_node_s": k["deliveries"] / seconds / n,
            "in_bytes_per_node_s": k["delivered_bytes"] / seconds / n,
        }
    per_node = {nd: {"in_msgs_s": node_in[nd][0] / seconds, "in_bytes_s": node_in[nd][1] / seconds,
                     "out_msgs_s": node_out[nd][0] / seconds, "out_bytes_s": node_out[nd][1] / seconds}
                for nd in nodes}
    mean = {key: sum(v[key] for v in per_node.values()) / n for key in ("in_msgs_s", "in_bytes_s", "out_msgs_s", "out_bytes_s")}
    return {"kinds": out_kinds, "per_node": per_node, "mean": mean}


# ---- the run --------------------------------------------------------------------------------------


class Counter:
    """A subscriber on `fog/<cluster>/#` and the broker's $SYS counters; keeps every publication
    of the current window and each agent's first "online"."""

    SYS = ("$SYS/broker/publish/messages/sent", "$SYS/broker/publish/messages/received",
           "$SYS/broker/bytes/sent", "$SYS/broker/bytes/received", "$SYS/broker/clients/connected")

    def __init__(self, host: str, port: int, cluster: str) -> None:
        from agent.mqtt import client as mqttc

        self.cluster = cluster
        self.lock = threading.Lock()
        self.pubs: List[Tuple[str, bytes]] = []
        self.recording = False
        self.own = [0, 0]  # messages and bytes delivered to this subscriber in the window
        self.sys: Dict[str, float] = {}
        self.online_at: Dict[str, float] = {}
        broker = mqttc.broker_from(host, port, keepalive=30)
        c = mqttc.make_client(broker, f"fleet-bench-{uuid.uuid4().hex[:8]}", mqttc.CLEAN)
        c.on_connect = lambda cl, ud, fl, rc, pr=None: cl.subscribe(
            [(f"{topics.base(cluster)}/#", 0)] + [(t, 0) for t in self.SYS])
        c.on_message = self._on_message
        self.client = c
        mqttc.connect_and_wait(c, broker, mqttc.CLEAN, timeout=10)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        now = time.monotonic()
        with self.lock:
            if self.recording:
                self.own[0] += 1
                self.own[1] += len(msg.topic) + len(msg.payload) + 4
            if msg.topic.startswith("$SYS/"):
                try:
                    self.sys[msg.topic] = float(msg.payload)
                except ValueError:
                    pass
                return
            if self.recording:
                self.pubs.append((msg.topic, bytes(msg.payload)))
            p = topics.parse(self.cluster, msg.topic)
            if p is not None and p.kind == "status" and msg.payload == b"online" and p.node not in self.online_at:
                self.online_at[p.node] = now

    def start_window(self) -> Dict[str, float]:
        with self.lock:
            self.pubs = []
            self.own = [0, 0]
            self.recording = True
            return dict(self.sys)

    def end_window(self) -> Tuple[List[Tuple[str, bytes]], Dict[str, float], List[int]]:
        with self.lock:
            self.recording = False
            return self.pubs, dict(self.sys), list(self.own)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _cpu(proc: Any) -> float:
    """User + system seconds of a process and its living children (psutil)."""
    import psutil

    total = 0.0
    for p in [proc] + proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _rss(proc: Any) -> float:
    import psutil

    total = 0
    for p in [proc] + proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2 ** 20


def _fogctl(port: int, *args: str, timeout: float = 120.0) -> Tuple[float, int, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "agent.cli.fogctl", "--broker", f"127.0.0.1:{port}", "--cluster",
                            CLUSTER, "--timeout", "30", *args], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        # N=60 on the loaded 2-core machine: a deploy not done in 120 s. A figure, not a crash
        # that loses the window's measurements (subprocess.run killed the child).
        return time.monotonic() - t0, -1, f"timed out after {timeout:g}s"
    return time.monotonic() - t0, r.returncode, (r.stdout + r.stderr)


def run_fleet(n: int, seconds: float = 60.0, settle: float = 15.0, workdir: Optional[Path] = None,
              deploy: bool = True, online_bound: float = 300.0, log: Any = None,
              with_pipeline: bool = False) -> Dict[str, Any]:
    """Start a broker and `n` agents, measure one idle window, time fogctl; stop everything.
    with_pipeline: the small pipeline is deployed (timed) before the window and undeployed
    after it, so the window measures the fleet with its two instances running."""
    import psutil

    from foglab.tools.broker import start_private_broker

    say = log or (lambda *a: print(*a, file=sys.stderr, flush=True))
    own_dir = workdir is None
    wd = Path(workdir or tempfile.mkdtemp(prefix=f"fog-fleet-{n}-"))
    wd.mkdir(parents=True, exist_ok=True)
    nodes = [f"n{i:03d}" for i in range(1, n + 1)]
    broker = start_private_broker(wd / "broker", persistence=False)
    procs: Dict[str, subprocess.Popen] = {}
    counter = None
    result: Dict[str, Any] = {"nodes": n, "seconds": seconds, "settle": settle}
    try:
        counter = Counter(broker.host, broker.port, CLUSTER)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        t0 = time.monotonic()
        for node in nodes:
            conf = wd / f"{node}.toml"
            conf.write_text(AGENT_TOML.format(node=node, cluster=CLUSTER, slots=1, state_dir=wd / f"state-{node}",
                                              sink_dir=wd / "sink", port=broker.port))
            logf = open(wd / f"{node}.log", "a")
            procs[node] = subprocess.Popen(
                [sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config", str(conf), "--no-warm-worker"],
                stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(wd))
            logf.close()
        (wd / "sink").mkdir(exist_ok=True)
        deadline = t0 + online_bound
        while time.monotonic() < deadline:
            if len(counter.online_at) >= n or any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.2)
        dead = [nd for nd, p in procs.items() if p.poll() is not None]
        ups = sorted(counter.online_at.get(nd, float("nan")) - t0 for nd in nodes)
        result["online_s"] = {"first": ups[0], "median": ups[len(ups) // 2], "last": ups[-1],
                              "online": len(counter.online_at), "dead": dead}
        say(f"[fleet {n}] {len(counter.online_at)}/{n} online, last after {ups[-1]:.1f}s; settling {settle:g}s")
        if dead or len(counter.online_at) < n:
            raise RuntimeError(f"agents not online: {len(counter.online_at)}/{n}, dead {dead} (logs in {wd})")
        time.sleep(settle)
        pipe = wd / "fleetbench.toml"
        pipe.write_text(PIPELINE_TOML)
        result["with_pipeline"] = with_pipeline
        if with_pipeline and deploy:
            dt, rc, out = _fogctl(broker.port, "deploy", str(pipe))
            result["deploy_s"], result["deploy_rc"] = dt, rc
            if rc != 0:
                result["deploy_out"] = out[-400:]
            time.sleep(settle)
        ps = {nd: psutil.Process(p.pid) for nd, p in procs.items()}
        bp = psutil.Process(broker.pid)
        load0 = os.getloadavg()
        cpu0 = {nd: _cpu(p) for nd, p in ps.items()}
        bcpu0 = _cpu(bp)
        sys0 = counter.start_window()
        w0 = time.monotonic()
        time.sleep(seconds)
        pubs, sys1, own = counter.end_window()
        span = time.monotonic() - w0
        cpu1 = {nd: _cpu(p) for nd, p in ps.items()}
        bcpu1 = _cpu(bp)
        rss = {nd: _rss(p) for nd, p in ps.items()}
        load1 = os.getloadavg()
        summary = summarize_window(CLUSTER, nodes, pubs, span)
        result.update(summary)
        cpu = {nd: 100.0 * (cpu1[nd] - cpu0[nd]) / span for nd in nodes}
        for nd in nodes:
            summary["per_node"][nd]["cpu_pct"] = cpu[nd]
            summary["per_node"][nd]["rss_mb"] = rss[nd]
        result["window_s"] = span
        result["agent_cpu_pct"] = {"mean": sum(cpu.values()) / n, "max": max(cpu.values())}
        result["agent_rss_mb"] = {"mean": sum(rss.values()) / n, "max": max(rss.values())}
        result["broker_cpu_pct"] = 100.0 * (bcpu1 - bcpu0) / span
        result["broker_rss_mb"] = _rss(bp)
        result["loadavg"] = {"start": load0, "end": load1}

        def d(key: str) -> Optional[float]:
            return (sys1[key] - sys0[key]) / span if key in sys0 and key in sys1 else None

        sent = d("$SYS/broker/publish/messages/sent")
        result["sys"] = {
            "publish_received_s": d("$SYS/broker/publish/messages/received"),
            "publish_sent_s": sent,
            "publish_sent_to_agents_s": None if sent is None else sent - own[0] / span,
            "bytes_received_s": d("$SYS/broker/bytes/received"),
            "bytes_sent_s": d("$SYS/broker/bytes/sent"),
            "bytes_sent_to_agents_s": None if d("$SYS/broker/bytes/sent") is None else d("$SYS/broker/bytes/sent") - own[1] / span,
            "computed_deliveries_s": sum(k["deliveries_s"] for k in summary["kinds"].values()),
        }
        # The counting subscriber (QoS 0, in this process) against what the broker received: on
        # a saturated machine it falls behind and Mosquitto drops its QoS 0 backlog, and every
        # per-kind figure undercounts (N=60 at load ~60: it saw a tenth of what the model says).
        got = len(pubs) / span
        recv = result["sys"]["publish_received_s"]
        result["counted_share"] = None if not recv else got / recv
        if recv and got < 0.9 * recv:
            say(f"[fleet {n}] WARNING: counted {got:.0f} publications/s, the broker received {recv:.0f}/s: "
                f"the counting subscriber fell behind, the figures below undercount (machine saturated?)")
        m = summary["mean"]
        say(f"[fleet {n}] per node: in {m['in_msgs_s']:.1f} msg/s {m['in_bytes_s'] / 1024:.1f} KiB/s, out "
            f"{m['out_msgs_s']:.2f} msg/s; agent CPU {result['agent_cpu_pct']['mean']:.2f}%, RSS "
            f"{result['agent_rss_mb']['mean']:.0f} MiB; broker CPU {result['broker_cpu_pct']:.1f}%")
        # the real CLI
        runs = [_fogctl(broker.port, "--json", "status") for _ in range(3)]
        rows = None
        with contextlib.suppress(ValueError, TypeError):
            doc = json.loads(runs[-1][2])
            rows = len(doc.get("nodes", doc)) if isinstance(doc, (dict, list)) else None
        result["fogctl_status_s"] = sorted(r[0] for r in runs)
        result["fogctl_status_rc"] = [r[1] for r in runs]
        result["fogctl_status_rows"] = rows
        if deploy:
            if not with_pipeline:
                dt, rc, out = _fogctl(broker.port, "deploy", str(pipe))
                result["deploy_s"], result["deploy_rc"] = dt, rc
                if rc != 0:
                    result["deploy_out"] = out[-400:]
                time.sleep(3.0)
            dt, rc, out = _fogctl(broker.port, "undeploy", "fleetbench")
            result["undeploy_s"], result["undeploy_rc"] = dt, rc
            if rc != 0:
                result["undeploy_out"] = out[-400:]
        say(f"[fleet {n}] fogctl status {result['fogctl_status_s'][1]:.2f}s (median), deploy "
            f"{result.get('deploy_s', float('nan')):.2f}s, undeploy {result.get('undeploy_s', float('nan')):.2f}s")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        stop_deadline = time.monotonic() + 30.0
        for p in procs.values():
            try:
                p.wait(timeout=max(0.1, stop_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if counter is not None:
            counter.close()
        broker.stop()
        if own_dir:
            shutil.rmtree(wd, ignore_errors=True)
    return result


# ---- report ---------------------------------------------------------------------------------------

TABLE_HEAD = ("| N | online (last, s) | in msg/s per node | in KiB/s per node | out msg/s per node | out B/s per node "
              "| agent CPU % (mean/max) | agent RSS MiB | broker CPU % | broker msg/s out ($SYS) | fogctl status s "
              "| deploy s | undeploy s |")


def table(runs: Sequence[Dict[str, Any]]) -> str:
    lines = [TABLE_HEAD, "|" + "---|" * (TABLE_HEAD.count("|") - 1)]
    for r in runs:
        m = r["mean"]
        s = r.get("sys", {})
        lines.append(
            f"| {r['nodes']} | {r['online_s']['last']:.1f} | {m['in_msgs_s']:.1f} | {m['in_bytes_s'] / 1024:.1f} | "
            f"{m['out_msgs_s']:.2f} | {m['out_bytes_s']:.0f} | {r['agent_cpu_pct']['mean']:.2f} / {r['agent_cpu_pct']['max']:.2f} | "
            f"{r['agent_rss_mb']['mean']:.0f} | {r['broker_cpu_pct']:.1f} | "
            f"{(s.get('publish_sent_to_agents_s') or 0):.0f} | {r['fogctl_status_s'][1]:.2f} | "
            f"{r.get('deploy_s', float('nan')):.2f} | {r.get('undeploy_s', float('nan')):.2f} |")
    return "\n".join(lines)


def kinds_table(runs: Sequence[Dict[str, Any]]) -> str:
    ns = [r["nodes"] for r in runs]
    head = "| kind | " + " | ".join(f"N={n}: pubs/s per node, B/pub, fan-out, in msg/s per node" for n in ns) + " |"
    lines = [head, "|---|" + "---|" * len(ns)]
    for k in sorted({k for r in runs for k in r["kinds"]}):
        cells = []
        for r in runs:
            v = r["kinds"].get(k)
            cells.append("-" if not v else f"{v['pubs_per_node_s']:.3f}, {v['bytes_per_pub']:.0f}, {v['fanout']:.1f}, {v['in_msgs_per_node_s']:.2f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_model(runs: Sequence[Dict[str, Any]]) -> Tuple[float, float]:
    """Agent CPU % = a + b * (messages/s delivered to it), fitted over the runs."""
    return linfit([r["mean"]["in_msgs_s"] for r in runs], [r["agent_cpu_pct"]["mean"] for r in runs])


def plot(runs: Sequence[Dict[str, Any]], path: str, model: Optional[Dict[str, Any]] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["nodes"] for r in runs]
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    xs = list(range(min(ns), max(ns) * 2 + 1, max(1, max(ns) // 20)))
    ex = [extrapolate(model, x) for x in xs] if model else []
    a = ax[0][0]
    a.plot(ns, [r["mean"]["in_msgs_s"] for r in runs], "o", label="in (delivered to each agent)")
    a.plot(ns, [r["mean"]["out_msgs_s"] for r in runs], "s", label="out (published by each agent)")
    if ex:
        a.plot(xs, [e["per_node_in_msgs_s"] for e in ex], "-", alpha=0.5, label="model in")
        a.plot(xs, [e["per_node_out_msgs_s"] for e in ex], "--", alpha=0.5, label="model out")
    a.set_title("control-plane messages/s per node (idle)")
    a.set_xlabel("nodes N")
    a.legend()
    a = ax[0][1]
    a.plot(ns, [r["mean"]["in_bytes_s"] / 1024 for r in runs], "o", label="in")
    a.plot(ns, [r["mean"]["out_bytes_s"] / 1024 for r in runs], "s", label="out")
    if ex:
        a.plot(xs, [e["per_node_in_bytes_s"] / 1024 for e in ex], "-", alpha=0.5, label="model in")
    a.set_title("KiB/s per node (topic + payload)")
    a.set_xlabel("nodes N")
    a.legend()
    a = ax[1][0]
    a.plot(ns, [r["agent_cpu_pct"]["mean"] for r in runs], "o", label="agent CPU % (mean)")
    a.plot(ns, [r["agent_cpu_pct"]["max"] for r in runs], "^", label="agent CPU % (max)")
    a.plot(ns, [r["broker_cpu_pct"] / r["nodes"] for r in runs], "s", label="broker CPU % / N")
    a.set_title("CPU % of one core, per node")
    a.set_xlabel("nodes N")
    a.legend()
    a = ax[1][1]
    kinds = sorted({k for r in runs for k in r["kinds"]})
    for k in kinds:
        a.plot(ns, [r["kinds"].get(k, {}).get("in_msgs_per_node_s", 0.0) for r in runs], "o-", label=k)
    a.set_title("messages/s delivered per node, by topic kind")
    a.set_xlabel("nodes N")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report(runs: Sequence[Dict[str, Any]], at: int = 1000) -> Dict[str, Any]:
    model = fit_model(runs) if len(runs) >= 2 else None
    out: Dict[str, Any] = {"runs": list(runs)}
    if model:
        out["model"] = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in model.items()}
        ext = extrapolate(model, at)
        a, b = cpu_model(runs)
        ext["agent_cpu_pct"] = a + b * ext["per_node_in_msgs_s"]
        ext["cpu_model"] = [a, b]
        out["extrapolated"] = ext
    return out


def main_cmd(args: argparse.Namespace) -> int:
    ns = sorted(set(args.nodes or []))
    runs = []
    for f in args.load or []:  # earlier runs' --json output: report and plot them with these
        runs.extend(json.loads(Path(f).read_text())["runs"])
    if not ns and not runs:
        print("fog-agent bench fleet: --nodes N (or --load FILE)", file=sys.stderr)
        return 2
    for n in ns:
        runs.append(run_fleet(n, seconds=args.seconds, settle=args.settle, deploy=not args.no_deploy,
                              with_pipeline=args.with_pipeline,
                              workdir=Path(args.workdir) / f"n{n}" if args.workdir else None))
    runs.sort(key=lambda r: r["nodes"])
    rep = report(runs)
    if args.plot:
        plot(runs, args.plot, fit_model(runs) if len(runs) >= 2 else None)
    if args.json:
        json.dump(rep, sys.stdout, indent=1, sort_keys=True, default=str)
        print()
    else:
        print(table(runs))
        print()
        print(kinds_table(runs))
        if "extrapolated" in rep:
            e = rep["extrapolated"]
            print(f"\nmodel at {e['nodes']} nodes: broker in {e['broker_in_msgs_s']:.0f} msg/s, out "
                  f"{e['broker_out_msgs_s']:.0f} msg/s ({e['broker_out_bytes_s'] / 2 ** 20:.1f} MiB/s); per agent in "
                  f"{e['per_node_in_msgs_s']:.0f} msg/s ({e['per_node_in_bytes_s'] / 1024:.0f} KiB/s), CPU "
                  f"{e['agent_cpu_pct']:.1f}% of a core (this machine)")
    return 0


def register_bench(groups: Any) -> None:
    p = groups.bench.add_parser("fleet", help="an idle fleet of N real agents on one broker: control-plane "
                                "messages, bytes, CPU and RSS per node, fogctl status / deploy times")
    p.add_argument("--nodes", type=int, action="append",
                   help="fleet size; repeat for several runs, one after the other (e.g. --nodes 10 --nodes 30)")
    p.add_argument("--load", action="append", metavar="JSON",
                   help="also report (table, model, plot) the runs of an earlier --json output; repeatable")
    p.add_argument("--seconds", type=float, default=60.0, help="measured window once the fleet is online (default 60)")
    p.add_argument("--settle", type=float, default=15.0, help="seconds after the last agent is online (default 15)")
    p.add_argument("--no-deploy", action="store_true", help="skip the fogctl deploy / undeploy timing")
    p.add_argument("--with-pipeline", action="store_true",
                   help="measure the window with the small pipeline deployed (5 records/s source -> sink)")
    p.add_argument("--workdir", default=None, help="keep configs and logs here (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="the runs, the model and the extrapolation as JSON")
    p.add_argument("--plot", default=None, help="PNG of per-node cost vs N")
    p.set_defaults(func=main_cmd)
