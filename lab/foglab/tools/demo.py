"""`fog-agent demo` (`make demo`): three agents on a private Mosquitto scale a taxi pipeline live.

What it shows: a load profile drives `in_zone` from its keeper out to several instances and back,
while every record id is accounted for. The pieces are reusable (the integration tests drive the
same `Fleet` and `Monitor`):

- `Fleet`: a private broker (`foglab.tools.broker`), N agents as separate `fog-agent run`
  processes, `deploy`, and a clean stop (SIGTERM, bounded wait, kill as last resort).
- `Monitor`: one MQTT client that follows the agents' retained state and the events topic, and
  keeps the last stats of every instance it ever saw (exited instances included: the daemon puts
  a worker's final stats into its "terminated" event).
- `verify`: exactly-once check. Sources are seeded, so the verifier regenerates each source's
  records (`taxi.TaxiGenerator`), passes them through the pipeline's map operators, and compares
  the ids that should reach the sink with the ids the counting sinks recorded (`*.ids` files).

The analytics step (`run_analytics`, lab/foglab/tools/demo_analytics.py, PySpark) runs after the
verdict and merges what it returns under `summary["analytics"]`.

Why one module: the fleet, the monitor and the live table are used together by the
demo, chaos and the integration tests; verification (verify.py) and analytics are apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import agent
from agent import topics
from agent.config import load_pipeline_text
from agent.mqtt import client as mqttc
from agent.mqtt.requester import SYNC_PREFIX
from foglab.operators import MODULES as OPERATOR_MODULES
from foglab.tools.footprint import Sampler
from foglab.tools.footprint import table as footprint_table
from foglab.tools.verify import expected_ids, verify

log = logging.getLogger(__name__)

ROOT = Path(agent.__file__).resolve().parents[1]
DEFAULT_PIPELINE = ROOT / "examples" / "demo-pipeline.toml"
# the instance stats that say a window's answer may differ from the batch one (agent.instance.keyed_state,
# foglab.operators.debs.MergeTopRoutes, foglab.operators.debs_areas): summed over the instances into summary["keyed_late"]
LATENESS_STATS = ("late_dropped", "incomplete_windows", "late_counts", "late_trips", "long_trips")
EXIT_OK = 0
EXIT_LOSS = 3  # a record was lost or duplicated
EXIT_SETUP = 1  # broker, agents or deploy failed
SYNC_TIMEOUT = 30.0  # seconds a Monitor waits for the echo of its sync marker (against a hang only)

# ---- the fleet ---------------------------------------------------------------------------------


AGENT_TOML = """\
[agent]
node = "{node}"
cluster = "{cluster}"
slots = {slots}
state_dir = "{state_dir}"
sink_dirs = ["{sink_dir}"]
state_period = {state_period}
heartbeat_period = {heartbeat_period}
shutdown_timeout = {shutdown_timeout}
dead_after = {dead_after}

[mqtt]
host = "{host}"
port = {port}
inbox_per_node = {inbox_per_node}

[metrics]
port = 0
"""

# The demo's DEBS operators are the lab's (foglab.operators): every agent of a fleet lists them in
# `[operators] modules`, so that it admits them from a checkout as well as where fog-agent-lab is
# installed (which registers them as entry points too).
DEMO_OPERATOR_MODULES = OPERATOR_MODULES

# With `Fleet(spill=True)`: the sinks spool what reaches them, the agent spools metrics and
# events, and a path shipper lands closed files in <workdir>/landing (the analytics' input).
SPILL_TOML = """
[spill]
enabled = true
spool_dir = "{spool_dir}"
rotate_seconds = 5.0
ship = "path"
ship_path = "{landing}"
ack = "{ack}"
"""


@dataclass
class Fleet:
    """A broker and N agent processes under one work directory."""

    workdir: Path
    nodes: Sequence[str] = ("n1", "n2", "n3")
    slots: int = 6
    cluster: str = "demo"
    state_period: float = 1.0
    heartbeat_period: float = 0.5
    shutdown_timeout: float = 10.0
    dead_after: float = 0.0  # > 0: a node offline this long has its instances re-homed
    broker_host: Optional[str] = None  # use an existing broker instead of starting one
    broker_port: Optional[int] = None
    max_queued: int = 10000
    log_level: str = "info"
    agent_args: Sequence[str] = ()  # extra `fog-agent run` options (e.g. --no-warm-worker)
    spill: bool = False  # [spill] on every agent, shipped by path into `landing`
    spill_ack: str = "written"  # its [spill] ack: "landed" has the sinks ack once their files landed
    extra_toml: str = ""  # appended to every agent's file (e.g. a [site_manager] section)
    operator_modules: Sequence[str] = DEMO_OPERATOR_MODULES  # every agent's `[operators] modules`
    # Each node's agent (and so its workers) reaches the broker through a proxy of its own
    # (foglab.tools.delayproxy), which can cut the node off: the chaos fault `partition`.
    proxied: bool = False
    inbox_per_node: bool = True  # [mqtt] inbox_per_node of every agent (docs/security.md)
    # A throwaway admin key in the work dir: every agent requires signed specs, deploy signs
    # (docs/security.md, "Signed pipeline specs"), so the path runs wherever the demo does.
    signed: bool = False
    procs: Dict[str, subprocess.Popen] = field(default_factory=dict)
    broker: Any = None
    proxies: Any = None  # a ProxyBank when `proxied`

    @property
    def sink_dir(self) -> Path:
        return self.workdir / "sink"

    @property
    def landing(self) -> Path:
        return self.workdir / "landing"

    @property
    def admin_key(self) -> Path:
        return self.workdir / "admin-sign.key"

    @property
    def host(self) -> str:
        return self.broker_host or self.broker.host

    @property
    def port(self) -> int:
        return int(self.broker_port or self.broker.port)

    def start(self) -> "Fleet":
        from foglab.tools.broker import start_private_broker

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sink_dir.mkdir(parents=True, exist_ok=True)
        if self.signed and not self.admin_key.exists():
            from agent.signing import generate_keypair

            generate_keypair(self.admin_key, self.admin_key.with_name(self.admin_key.name + ".pub"))
        if self.broker_host is None:
            self.broker = start_private_broker(self.workdir / "broker", max_queued=self.max_queued)
        if self.proxied:
            from foglab.tools.delayproxy import ProxyBank

            self.proxies = ProxyBank((self.host, self.port), {n: 0.0 for n in self.nodes}).start()
        for node in self.nodes:
            self.start_agent(node)
        return self

    def wait_online(self, mon: "Monitor", bound: float = 120.0) -> None:
        """Until every agent of the fleet says online (`wait_online`)."""
        wait_online(mon, {n: self.procs[n] for n in self.nodes}, bound, f" (logs in {self.workdir})")

    @staticmethod
    def agent_env() -> Dict[str, str]:
        """This environment with the project on PYTHONPATH (agents run from a checkout too)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        return env

    def start_agent(self, node: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        conf = self.workdir / f"{node}.toml"
        conf.write_text(AGENT_TOML.format(
            node=node, cluster=self.cluster, slots=self.slots, state_dir=self.workdir / f"state-{node}",
            sink_dir=self.sink_dir,
            state_period=self.state_period, heartbeat_period=self.heartbeat_period,
            shutdown_timeout=self.shutdown_timeout, dead_after=self.dead_after, host=self.host,
            port=self.proxies.port(node) if self.proxies is not None else self.port,
            inbox_per_node=str(self.inbox_per_node).lower(),
        ) + (SPILL_TOML.format(spool_dir=self.workdir / f"spool-{node}", landing=self.landing, ack=self.spill_ack) if self.spill else "")
            + (f'[security]\nadmin_keys = ["{self.admin_key}.pub"]\n' if self.signed else "")
            + (f'\n[operators]\nmodules = {json.dumps(list(self.operator_modules))}\n' if self.operator_modules else "")
            + self.extra_toml)
        logf = open(self.workdir / f"{node}.log", "a")
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "--log-level", self.log_level, "run", "--config", str(conf),
             *self.agent_args],
            stdout=logf, stderr=subprocess.STDOUT, env=env or self.agent_env(), cwd=str(ROOT),
        )
        logf.close()
        self.procs[node] = proc
        return proc

    def deploy(self, text: str, extra: Optional[Dict[str, Any]] = None, timeout: float = 30.0) -> List[Any]:
        from agent.node.deploy import deploy

        merged = {"sink_dir": str(self.sink_dir)}
        merged.update(extra or {})
        signer = None
        if self.signed:
            from agent.signing import load_signer

            signer = load_signer(self.admin_key)
        return deploy(text, self.host, self.port, self.cluster, extra=merged, timeout=timeout, signer=signer)

    def stop(self, timeout: Optional[float] = None) -> Dict[str, Optional[int]]:
        """SIGTERM every agent, wait up to the documented bound, kill what is left; exit codes."""
        bound = timeout if timeout is not None else self.shutdown_timeout + 5.0
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + bound
        codes: Dict[str, Optional[int]] = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes[node] = None
        if self.proxies is not None:
            self.proxies.stop()
        if self.broker is not None:
            self.broker.stop()
        return codes

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- the monitor -------------------------------------------------------------------------------


def wait_online(mon: "Monitor", procs: Dict[str, "subprocess.Popen[Any]"], bound: float = 120.0,
                where: str = "") -> None:
    """Until the agent of every node in `procs` (node -> its process) says online, on the event
    rather than a fixed time: 3 agents starting at once took over 30 s at load ~19, and one alone
    did not log its first line within 30 s at load ~34 (a python start and the imports on shared
    cores). An agent process that exits fails at once; `bound` only ends a hang."""
    def up_or_dead(m: "Monitor") -> bool:
        return (all(m.status.get(n) == "online" for n in procs)
                or any(p.poll() is not None for p in procs.values()))

    if not mon.wait(up_or_dead, bound) or any(p.poll() is not None for p in procs.values()):
        raise RuntimeError(f"agents did not come online: {mon.status}{where}")


class Monitor:
    """Follows `fog/<cluster>/agents/+/state`, `.../status` and `fog/<cluster>/events`.

    paho's network thread only stores into dicts under a lock; readers take consistent copies.
    Built, it has every retained state and status and is subscribed to the events: the
    constructor waits for the echo of a sync marker published after subscribing (the broker
    sends a subscription's retained messages before it routes our next publish). Returning at
    the CONNACK, a check made at once (nothing running yet: fewer instances than a bound) passed
    on an empty view, and an event published right after was missed.
    """

    def __init__(self, host: str, port: int, cluster: str) -> None:
        self.cluster = cluster
        self._lock = threading.Lock()
        self.states: Dict[str, Dict[str, Any]] = {}
        self.status: Dict[str, str] = {}
        self.instance_stats: Dict[str, Dict[str, Any]] = {}  # last stats of every instance ever seen
        self.instance_operator: Dict[str, str] = {}
        self.instance_node: Dict[str, str] = {}
        self.pids: Set[int] = set()  # every worker pid ever published (orphan checks)
        self.series: List[Tuple[float, Dict[str, int]]] = []  # (monotonic time, instances per operator)
        self.events: List[Dict[str, Any]] = []
        self.max_queued_dropped = 0.0
        self.dropped: Optional[float] = None
        self._connected = threading.Event()
        self._synced = threading.Event()
        self._marker = SYNC_PREFIX + uuid.uuid4().hex.encode()
        client_id = f"fog-demo-monitor-{uuid.uuid4().hex[:12]}"
        self._marker_topic = topics.replies(cluster, client_id, client_id)
        # A persistent session (MQTT 5, expiry 10 min): across a broker restart (chaos runs) the
        # events published while the monitor reconnects wait for it instead of being missed.
        broker = mqttc.broker_from(host, port, keepalive=10)
        session = mqttc.Session(persistent=True, expiry=600)
        c = mqttc.make_client(broker, client_id, session, reconnect_delay=(0.2, 2))
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        self._client = c
        try:
            mqttc.connect_and_wait(c, broker, session, timeout=10)
        except mqttc.ConnectFailed as exc:
            raise RuntimeError(f"monitor: {exc}") from None
        if not self._synced.wait(SYNC_TIMEOUT):
            c.disconnect()
            c.loop_stop()
            raise RuntimeError(f"monitor: the broker at {host}:{port} did not echo our sync marker "
                               f"within {SYNC_TIMEOUT:g}s")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any = None) -> None:
        client.subscribe([
            (topics.all_agents_state(self.cluster), 1),
            (topics.all_agents_status(self.cluster), 1),
            (topics.events(self.cluster), 1),
            ("$SYS/broker/publish/messages/dropped", 0),
            (self._marker_topic, 1),
        ])
        client.publish(self._marker_topic, self._marker, qos=1)  # after the subscriptions (see the class)
        self._connected.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        if msg.topic == self._marker_topic:
            if msg.payload == self._marker:
                self._synced.set()
            return
        parsed = topics.parse(self.cluster, msg.topic)
        try:
            if msg.topic == "$SYS/broker/publish/messages/dropped":
                with self._lock:
                    self.dropped = float(msg.payload.decode())
                return
            if msg.topic == topics.events(self.cluster):
                ev = json.loads(msg.payload)
                with self._lock:
                    self.events.append(ev)
                    det = ev.get("detail") or {}
                    if det.get("source") == "agent" and ev.get("type") == "terminated" and isinstance(det.get("stats"), dict) and ev.get("instance"):
                        self._merge_stats(ev["instance"], ev.get("operator") or "", det["stats"])
                return
            if parsed is not None and parsed.kind == "status":
                with self._lock:
                    self.status[parsed.node] = msg.payload.decode(errors="replace")
                return
            if parsed is not None and parsed.kind == "state" and msg.payload:
                node = parsed.node
                doc = json.loads(msg.payload)
                with self._lock:
                    self.states[node] = doc
                    for inst in doc.get("instances", []):
                        if isinstance(inst.get("stats"), dict) and inst["stats"]:
                            self._merge_stats(inst["id"], inst.get("operator", ""), inst["stats"])
                        self.instance_operator[inst["id"]] = inst.get("operator", "")
                        self.instance_node[inst["id"]] = node
                        if isinstance(inst.get("pid"), int):
                            self.pids.add(inst["pid"])
                    self.series.append((time.monotonic(), self._count_locked(True)))
        except (ValueError, KeyError, TypeError, AttributeError):
            pass

    def _merge_stats(self, instance: str, operator: str, stats: Dict[str, Any]) -> None:
        old = self.instance_stats.get(instance, {})
        # stats only grow; keep the newer of two (a state published after a terminated event)
        if not old or stats.get("records_in", 0) >= old.get("records_in", 0):
            self.instance_stats[instance] = stats
        if operator:
            self.instance_operator[instance] = operator

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    # -- views --------------------------------------------------------------------------------

    def instances_per_operator(self, include_terminating: bool = True) -> Dict[str, int]:
        with self._lock:
            return self._count_locked(include_terminating)

    def _count_locked(self, include_terminating: bool) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for node, doc in self.states.items():
            if self.status.get(node) == "offline":
                continue
            for inst in doc.get("instances", []):
                if not include_terminating and inst.get("status") == "terminating":
                    continue
                out[inst["operator"]] = out.get(inst["operator"], 0) + 1
        return out

    def stats_of(self, instance: str) -> Dict[str, Any]:
        with self._lock:
            return dict(self.instance_stats.get(instance, {}))

    def call(self, host: str, port: int, node: str, body: Dict[str, Any]) -> Dict[str, Any]:
        from agent.node.deploy import RpcClient

        with RpcClient(host, port, self.cluster) as client:
            return client.call(node, body, timeout=10)

    def totals(self) -> Dict[str, float]:
        """Sums over every instance ever seen: generated (sources), recorded (sinks), protocol."""
        with self._lock:
            t = {"generated": 0.0, "recorded": 0.0, "protocol_out": 0.0, "protocol_in": 0.0,
                 "malformed": 0.0, "sends_to_non_successor": 0.0, "credit_stalls": 0.0,
                 "duplicates_dropped": 0.0, "handover_out": 0.0, "handover_bytes_out": 0.0,
                 **{k: 0.0 for k in LATENESS_STATS}}
            for stats in self.instance_stats.values():
                for k in t:
                    v = stats.get(k)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        t[k] += v
            return t

    def rescale_delays(self) -> List[float]:
        """Seconds from each duplication decision to the first record processed by its new instance
        (wall clock: both stamps come from workers on this machine); for a keyed copy the first
        record it applied, not the first that arrived to wait for its group (rescale_split)."""
        return sorted(row["total"] for r in self.rescale_by_operator().values() for row in r["each"])

    def rescale_parts(self) -> Dict[str, Any]:
        """decision -> first record split into spawn, protocol round and first batch (medians)."""
        from foglab.tools.dataplane_bench import rescale_parts

        with self._lock:
            stats = {i: dict(s) for i, s in self.instance_stats.items()}
        return rescale_parts(stats)

    def rescale_by_operator(self) -> Dict[str, Any]:
        """decision -> first record per operator, a keyed operator's split into its parts."""
        from foglab.tools.rescale_split import rescale_by_operator

        with self._lock:
            stats = {i: dict(s) for i, s in self.instance_stats.items()}
            ops = dict(self.instance_operator)
        spawned = self.agent_events("spawned")
        warm = {str(e.get("instance")): e["detail"].get("warm_age_s") for e in spawned
                if isinstance(e["detail"].get("warm"), bool)}
        ready = {str(e.get("instance")): e["detail"].get("start_to_ready_s") for e in spawned}
        return rescale_by_operator(stats, ops, warm, ready)

    def agent_events(self, etype: str, cause: Optional[str] = None) -> List[Dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e.get("type") == etype and (e.get("detail") or {}).get("source") == "agent"
                    and (cause is None or (e.get("detail") or {}).get("cause") == cause)]

    def wait(self, pred: Callable[["Monitor"], bool], timeout: float, step: float = 0.2) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(self):
                return True
            time.sleep(step)
        return bool(pred(self))

    def sink_records_in(self) -> int:
        """Records received by the sink instances (every instance ever seen)."""
        with self._lock:
            return sum(int((st or {}).get("records_in", 0)) for i, st in self.instance_stats.items()
                       if self.instance_operator.get(i) == "sink")

    def wait_sink_quiet(self, timeout: float, quiet: float = 2.0) -> bool:
        """Until the sinks' count has not moved for `quiet` s (the tail of a paused source has
        arrived: a test then stops the fleet and verifies the sink). False after `timeout` s."""
        last, since = -1, time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            now_in = self.sink_records_in()
            if now_in != last:
                last, since = now_in, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return True
            time.sleep(0.2)
        return False


# ---- the demo itself ---------------------------------------------------------------------------


def _profile_end(params: Dict[str, Any]) -> Optional[float]:
    if params.get("profile") == "steps" and params.get("steps"):
        return float(params["steps"][-1][0])
    return None


def scale_profile(text: str, duration: Optional[float]) -> str:
    """Stretch the source's step profile to end at `duration` seconds (the --duration option)."""
    if duration is None:
        return text
    cfg = load_pipeline_text(text)
    params = cfg.operators[0].params
    end = _profile_end(params)
    if end is None or end <= 0:
        return text
    k = duration / end
    new_steps = [[round(t * k, 2), r] for t, r in params["steps"]]
    lines = []
    for line in text.splitlines():
        if line.strip().startswith("steps") and "=" in line:
            line = "steps = " + json.dumps(new_steps)
        lines.append(line)
    return "\n".join(lines) + "\n"


@dataclass
class Sample:
    t: float
    input_rate: float
    output_rate: float
    instances: Dict[str, int]


def run_demo(
    pipeline_path: Path = DEFAULT_PIPELINE,
    duration: Optional[float] = None,
    workdir: Optional[Path] = None,
    plot_path: Optional[Path] = None,
    live: bool = True,
    out: Any = sys.stderr,
    settle_timeout: float = 60.0,
    analytics: bool = True,
) -> Dict[str, Any]:
    """Run the whole demo; returns the summary dict (the `--json` output)."""
    text = scale_profile(Path(pipeline_path).read_text(), duration)
    cfg = load_pipeline_text(text, Path(pipeline_path).name)
    operators = [op.name for op in cfg.operators]
    profile_end = _profile_end(cfg.operators[0].params) or (duration or 120.0)
    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="fog-demo-"))
    started = time.monotonic()
    fleet = Fleet(workdir, log_level="warning", spill=True, signed=True)
    footprint = Sampler(os.getpid())  # peak memory per process kind of the whole fleet
    samples: List[Sample] = []
    monitor: Optional[Monitor] = None
    summary: Dict[str, Any] = {"workdir": str(workdir), "pipeline": cfg.pipeline.name,
                               "pipeline_path": str(pipeline_path), "operator_roles": operator_roles(cfg)}
    try:
        footprint.start()
        fleet.start()
        monitor = Monitor(fleet.host, fleet.port, fleet.cluster)
        fleet.wait_online(monitor)
        placed = fleet.deploy(text)
        print(f"deployed {cfg.pipeline.name}: " + ", ".join(f"{d.operator}@{d.node}" for d in placed), file=out)
        if live:
            print(_header(operators), file=out)
        t0 = time.monotonic()
        last = monitor.totals()
        # rates over a sliding window: stats arrive with the agents' state (every state_period),
        # so a 1 s difference would alias between 0 and twice the real rate
        history: List[Tuple[float, Dict[str, float]]] = [(t0, last)]
        max_inst: Dict[str, int] = {op: 0 for op in operators}
        stable_since: Optional[float] = None
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            tot = monitor.totals()
            inst = monitor.instances_per_operator()
            history.append((now, tot))
            ht, hv = history[max(0, len(history) - 4)]
            span = max(1e-6, now - ht)
            s = Sample(now - t0, (tot["generated"] - hv["generated"]) / span, (tot["recorded"] - hv["recorded"]) / span, inst)
            samples.append(s)
            for op in operators:
                max_inst[op] = max(max_inst[op], inst.get(op, 0))
            if live:
                print(_row(s, operators), file=out, flush=True)
            quiet = tot["generated"] == last["generated"] and tot["recorded"] == last["recorded"]
            last = tot
            if now - t0 < profile_end:
                continue
            back = all(inst.get(op, 0) <= 1 for op in operators)
            stable_since = (stable_since or now) if quiet else None
            if stable_since is not None and now - stable_since >= 3.0 and (back or now - t0 > profile_end + settle_timeout):
                break
            if now - t0 > profile_end + settle_timeout + 30:
                break
        summary["scale_outs"] = len(monitor.agent_events("spawned", "spawn"))
        summary["scale_ins"] = len(monitor.agent_events("terminated", "scale_in"))
        summary["scaling_by_operator"] = scaling_by_operator(monitor.agent_events("spawned", "spawn"),
                                                             monitor.agent_events("terminated", "scale_in"))
        summary["max_instances"] = max_inst
        summary["final_instances"] = monitor.instances_per_operator()
        tot = monitor.totals()
        summary["protocol_messages"] = int(tot["protocol_out"])
        summary["malformed"] = int(tot["malformed"])
        summary["sends_to_terminated"] = int(tot["sends_to_non_successor"])
        # key groups of keyed operators moving with their state (docs/operators.md, "Key groups that move")
        summary["handover"] = {"messages": int(tot["handover_out"]), "bytes": int(tot["handover_bytes_out"])}
        # records keyed operators left out of a window, and windows the DEBS merge closed incomplete
        summary["keyed_late"] = {k: int(tot[k]) for k in LATENESS_STATS}
        summary["broker_dropped"] = monitor.dropped
        delays = monitor.rescale_delays()
        summary["decision_to_first_record_s"] = _median_max(delays)
        # per operator, a keyed one's split into round, hand-over and first record (foglab.tools.rescale_split)
        summary["rescale_by_operator"] = monitor.rescale_by_operator()
    finally:
        if monitor is not None:
            monitor.close()
        codes = fleet.stop()
        summary["agent_exit_codes"] = codes
        summary["memory_mb"] = footprint.stop()
    verdict = verify(cfg, fleet.sink_dir)
    summary.update(records_in=verdict.generated, records_expected=verdict.expected, records_out=verdict.received,
                   lost=verdict.lost, duplicated=verdict.duplicated + verdict.unexpected,
                   lost_sample=[list(x) for x in verdict.lost_sample])
    summary["duration_s"] = round(time.monotonic() - started, 1)
    summary["ok"] = verdict.ok
    summary["samples"] = [{"t": round(s.t, 2), "input_rate": round(s.input_rate, 1),
                           "output_rate": round(s.output_rate, 1), "instances": s.instances} for s in samples]
    plot = plot_path or (workdir / "demo.png")
    try:
        summary["plot"] = str(plot_demo(samples, operators, plot))
    except ImportError:
        summary["plot"] = None  # matplotlib is an extra
    if analytics:
        run_analytics(workdir, summary)
    return summary


def run_analytics(workdir: Path, summary: Dict[str, Any]) -> Dict[str, Any]:
    """The analytics step (lab/foglab/tools/demo_analytics.py), merged into summary["analytics"]. It
    needs the `analytics` extra (PySpark): without it, or when it fails, the step reports an
    error and never hides the verdict printed before it."""
    try:
        from foglab.tools import demo_analytics  # PySpark: an extra, imported only for this step
    except ImportError as exc:
        res: Optional[Dict[str, Any]] = {"error": f"the analytics step needs the analytics extra ({exc})"}
    else:
        try:
            res = demo_analytics.analyse(workdir, Path(summary.get("pipeline_path") or DEFAULT_PIPELINE))
        except Exception as exc:  # noqa: BLE001 - the analytics step must not hide the verdict
            res = {"error": repr(exc)}
    if res:
        summary.setdefault("analytics", {}).update(res)
    return summary.get("analytics", {})


def _median_max(values: Sequence[float]) -> Dict[str, Any]:
    v = sorted(values)
    return {"median": round(v[len(v) // 2], 3) if v else None, "max": round(v[-1], 3) if v else None, "n": len(v)}


BENCH_PIPELINE = """
[pipeline]
name = "rb"
[scaling]
period = 1.0
capacity = 20000.0
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[operator.params]
seed = 5
profile = "steps"
steps = [[0, 50], [3, {rate}], [23, 50], [30, 0]]
[[operator]]
name = "work"
function = "agent.operators.builtin:in_zone"
service_time_ms = 4.0
[operator.scaling]
capacity = 200.0
period = 1.0
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def start_to_ready(host: str, port: int, workdir: Path, warm: bool, n: int = 5, burst: int = 1,
                   forked: Optional[List[bool]] = None) -> List[float]:
    """Seconds from `Supervisor.start` to the worker's "ready" (inbox subscribed), n rounds of
    `burst` starts at once (a round of several copies; each start's own figure); `forked`, if
    given, gets whether each start was a fork of the fork server."""
    import queue

    from agent.node.daemon import worker_env
    from agent.instance.spec import InstanceSpec
    from agent.mqtt.settings import BrokerSpec
    from agent.node.loopevents import WorkerLine
    from agent.node.supervisor import Supervisor
    from agent.node.workers import WorkerStatus

    q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
    sup = Supervisor(emit=q.put, warm=warm, env=worker_env())
    sup.prewarm(time.monotonic())
    deadline = time.monotonic() + 30
    while warm and not sup.warm_ready and time.monotonic() < deadline:  # the fork server's imports
        time.sleep(0.1)
    text = BENCH_PIPELINE.replace("{rate}", "10.0")
    out: List[float] = []
    try:
        for i in range(n):
            t0 = time.monotonic()
            ready: Dict[str, float] = {}
            for j in range(burst):
                spec = InstanceSpec(instance=f"ready-{'warm' if warm else 'cold'}-{i}-{j}", operator="sink",
                                    node="bench", cluster="benchready", pipeline="rb", pipeline_toml=text,
                                    broker=BrokerSpec(host, port), state_dir=str(workdir / "state"),
                                    extra={"sink_dir": str(workdir / "sink")})
                w = sup.start(spec, time.monotonic())
                if forked is not None:
                    forked.append(w.warm_age is not None)
            while len(ready) < burst:
                ev = q.get(timeout=60)
                if isinstance(ev, WorkerLine):
                    msg = sup.handle_line(ev.instance, ev.line, time.monotonic())
                    if msg is not None and msg.get("event") == "ready":
                        ready[ev.instance] = time.monotonic() - t0
            out.extend(sorted(ready.values()))
            time.sleep(1.0)  # as between two scale-outs
    finally:
        sup.stop_all(time.monotonic())
        sup.close_warm()
        deadline = time.monotonic() + 15
        while len(sup) and time.monotonic() < deadline:
            sup.poll(time.monotonic())
            time.sleep(0.1)
    return out


def bench_spawn(burst: int = 3, rounds: int = 5, workdir: Optional[Path] = None) -> Dict[str, Any]:
    """`fog-agent bench spawn`: start -> ready of `burst` workers started at once (a scale-out
    round of several copies, or several operators scaling in the same second), forked from the
    agent's fork server against started cold, in the same run (docs/runtime.md, "Pre-started
    workers"). Each start's own figure; `rounds` bursts per mode, 1 s apart."""
    from foglab.tools.broker import start_private_broker

    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="fog-bench-spawn-"))
    out: Dict[str, Any] = {"burst": burst, "rounds": rounds, "workdir": str(base)}
    with start_private_broker(base / "broker") as broker:
        for mode in ("forked", "cold"):
            kinds: List[bool] = []
            values = start_to_ready(broker.host, broker.port, base / mode, warm=mode == "forked", n=rounds, burst=burst,
                                    forked=kinds)
            out[mode] = {"start_to_ready_s": _median_max(values), "each": [round(v, 3) for v in values],
                         "forked_starts": sum(kinds)}
    forked_s, cold_s = out["forked"]["start_to_ready_s"], out["cold"]["start_to_ready_s"]
    out["cold_over_forked"] = {k: round(cold_s[k] / forked_s[k], 1) if forked_s[k] else None for k in ("median", "max")}
    return out


def bench_rescale(rate: float = 500.0, workdir: Optional[Path] = None) -> Dict[str, Any]:
    """`fog-agent bench rescale`: the same load step through one real agent, its workers forked
    from the fork server (default) and started cold; decision -> first record of the new
    instance, and loss."""
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="fog-bench-rescale-"))
    text = BENCH_PIPELINE.replace("{rate}", str(float(rate)))
    cfg = load_pipeline_text(text)
    out: Dict[str, Any] = {"rate": rate, "workdir": str(base)}
    for mode, args in (("warm", ()), ("cold", ("--no-warm-worker",))):
        fleet = Fleet(base / mode, nodes=("b1",), slots=12, cluster=f"bench{mode}", agent_args=args,
                      log_level="warning", shutdown_timeout=8.0)
        fleet.start()
        mon = Monitor(fleet.host, fleet.port, fleet.cluster)
        try:
            mon.wait(lambda m: m.status.get("b1") == "online", 20)
            fleet.deploy(text)
            time.sleep(30.0)
            mon.wait(lambda m: m.instances_per_operator().get("work", 0) <= 1, 30)
            time.sleep(2.0)
            delays = mon.rescale_delays()
            parts = mon.rescale_parts()
            scale_outs = len(mon.agent_events("spawned", "spawn"))
        finally:
            mon.close()
            fleet.stop()
        v = verify(cfg, fleet.sink_dir)
        out[mode] = {"decision_to_first_record_s": _median_max(delays), "breakdown_median_s": parts,
                     "scale_outs": scale_outs,
                     "records": v.generated, "lost": v.lost, "duplicated": v.duplicated + v.unexpected}
    from foglab.tools.broker import start_private_broker

    with start_private_broker(base / "ready-broker") as broker:
        for mode in ("warm", "cold"):
            out[mode]["start_to_ready_s"] = _median_max(start_to_ready(broker.host, broker.port, base / f"ready-{mode}",
                                                                       warm=mode == "warm"))
    return out


def operator_roles(cfg: Any) -> Dict[str, str]:
    """{operator: "source", "stateless", "keyed" or "sink"} of a pipeline (the memory table)."""
    from agent.operators.keyed import is_keyed
    from foglab.operators import lab_allow_list

    allowed = lab_allow_list()
    out: Dict[str, str] = {}
    for i, op in enumerate(cfg.operators):
        if i == 0 or i == len(cfg.operators) - 1:
            out[op.name] = "source" if i == 0 else "sink"
            continue
        try:
            out[op.name] = "keyed" if is_keyed(allowed.resolve(op.function)) else "stateless"
        except (ValueError, ImportError):
            out[op.name] = "?"
    return out


def _header(operators: Sequence[str]) -> str:
    return f"{'t(s)':>6} {'in/s':>7} {'out/s':>7}  " + " ".join(f"{op[:9]:>9}" for op in operators)


def _row(s: Sample, operators: Sequence[str]) -> str:
    return f"{s.t:6.0f} {s.input_rate:7.0f} {s.output_rate:7.0f}  " + " ".join(f"{s.instances.get(op, 0):>9}" for op in operators)


def plot_demo(samples: Sequence[Sample], operators: Sequence[str], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in samples]
    fig, ax1 = plt.subplots(figsize=(9, 4.5))
    ax1.plot(t, [s.input_rate for s in samples], label="input rate (records/s)", color="tab:blue")
    ax1.plot(t, [s.output_rate for s in samples], label="output rate (records/s)", color="tab:green")
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("records/s")
    ax2 = ax1.twinx()
    colors = ["tab:orange", "tab:purple", "tab:red", "tab:brown", "tab:gray"]
    for i, op in enumerate(operators[1:-1]):
        ax2.step(t, [s.instances.get(op, 0) for s in samples], where="post", label=f"{op} instances",
                 linestyle="--", color=colors[i % len(colors)])
    ax2.set_ylabel("instances")
    ax2.set_ylim(bottom=0)
    lines = ax1.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax1.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    ax1.set_title("fog-agent demo: load vs instances vs throughput")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def scaling_by_operator(spawned: List[Dict[str, Any]], terminated: List[Dict[str, Any]]) -> Dict[str, Dict[str, int]]:
    """{operator: {"outs", "ins"}} for the operators that scaled (from the agents' events)."""
    out: Dict[str, Dict[str, int]] = {}
    for evs, what in ((spawned, "outs"), (terminated, "ins")):
        for e in evs:
            row = out.setdefault(str(e.get("operator")), {"outs": 0, "ins": 0})
            row[what] += 1
    return dict(sorted(out.items()))


def print_summary(summary: Dict[str, Any], out: Any) -> None:
    keys = ("records_in", "records_expected", "records_out", "lost", "duplicated", "scale_outs", "scale_ins",
            "scaling_by_operator", "handover", "keyed_late", "max_instances", "protocol_messages", "decision_to_first_record_s", "broker_dropped",
            "duration_s", "plot", "workdir")
    print("summary:", file=out)
    for k in keys:
        print(f"  {k:<18} {summary.get(k)}", file=out)
        if k != "decision_to_first_record_s":
            continue
        for op, r in (summary.get("rescale_by_operator") or {}).items():  # docs/measurement.md
            d = r["decision_to_first_record_s"]
            parts = ", ".join(f"{p} {v}" for p, v in r["parts_median_s"].items())
            print(f"    {op:<16} median {d['median']} s, max {d['max']} s (n {d['n']}, {r['cold_spawns']} cold "
                  f"spawns; {'keyed' if r['keyed'] else 'stateless'}; medians: {parts})", file=out)
    if summary.get("memory_mb"):  # docs/runtime.md, "Memory (the budget: every process under 40 MB)"
        roles = summary.get("operator_roles") or {}
        notes = {k: (roles.get(k.partition(":")[2], "") + (" OVER 40 MB" if a["rss_peak_mb"] >= 40 else "")).strip()
                 for k, a in summary["memory_mb"].items()}
        notes["driver"] = "the demo itself (not a node's)"
        print("  memory per process kind (peak over the run):", file=out)
        for line in footprint_table(summary["memory_mb"], notes):
            print("    " + line, file=out)
    print("  verdict            " + ("OK: every record exactly once" if summary.get("ok") else "FAILED: loss or duplicates"), file=out)


class DemoArgumentError(ValueError):
    """A bad `fog-agent demo` argument, found before anything is started."""


def preflight(args: argparse.Namespace) -> Tuple[Path, Optional[Path]]:
    """Check every argument before a broker or agent starts: (pipeline path, work directory).

    Why up front: a bad pipeline or duration used to surface after a private broker and three
    agents were running (or at the very end, in the verifier), leaving a work directory behind."""
    from agent.schema import ConfigError

    pipeline = Path(args.pipeline) if args.pipeline else DEFAULT_PIPELINE
    if args.duration is not None and not (args.duration > 0 and args.duration < float("inf")):
        raise DemoArgumentError(f"--duration must be a positive number of seconds, got {args.duration}")
    try:
        text = pipeline.read_text()
    except OSError as exc:
        raise DemoArgumentError(f"cannot read pipeline file {pipeline}: {exc.strerror or exc}") from None
    try:
        cfg = load_pipeline_text(scale_profile(text, args.duration), pipeline.name)
        expected_ids(cfg, {})  # imports every operator; the verifier needs per-record maps between source and sink
    except (ConfigError, ValueError, ImportError, AttributeError) as exc:
        raise DemoArgumentError(f"{pipeline}: not usable by the demo: {exc}") from None
    steps = cfg.operators[0].params.get("steps") if cfg.operators[0].params.get("profile") == "steps" else None
    if not steps or steps[-1][1] != 0:
        # Records still in flight when the fleet stops would count as lost: the load must end.
        raise DemoArgumentError(f'{pipeline}: the demo needs a source with profile = "steps" whose last step '
                                f"has rate 0 (the load ends, then every record id is checked), as in {DEFAULT_PIPELINE.name}")
    workdir = Path(args.workdir) if args.workdir else None
    if workdir is not None:
        if workdir.exists() and not workdir.is_dir():
            raise DemoArgumentError(f"--workdir {workdir} exists and is not a directory")
        if (workdir / "sink").is_dir() and any((workdir / "sink").iterdir()):
            raise DemoArgumentError(f"--workdir {workdir} holds a previous run (sink/); choose a new or empty one")
    if args.plot and Path(args.plot).is_dir():
        raise DemoArgumentError(f"--plot {args.plot} is a directory; give a .png file name")
    return pipeline, workdir


def main(args: argparse.Namespace) -> int:
    from agent.log import stdout_to_stderr
    from foglab.tools.broker import BrokerError

    try:
        pipeline, workdir = preflight(args)
    except DemoArgumentError as exc:
        print(f"fog-agent demo: error: {exc}", file=sys.stderr)
        return 2
    created = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="fog-demo-"))
    # With --json, stdout carries the JSON summary and nothing else: the live table, the analytics
    # step and anything a library prints (even at the file-descriptor level) go to stderr.
    guard = stdout_to_stderr() if args.json else contextlib.nullcontext()
    with guard:
        try:
            summary = run_demo(pipeline, duration=args.duration, workdir=workdir,
                               plot_path=Path(args.plot) if args.plot else None, live=not args.quiet,
                               out=sys.stderr if args.json else sys.stdout, analytics=False)
        except (BrokerError, RuntimeError, OSError) as exc:
            print(f"demo failed: {exc}", file=sys.stderr)
            print(f"demo: work directory (broker, agent logs, sink files) kept in {workdir}", file=sys.stderr)
            return EXIT_SETUP
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the fleet is stopped; say where its files are
            print(f"demo: interrupted; work directory kept in {workdir}", file=sys.stderr)
            raise
        # The verdict first (the analytics step can take a while on a busy machine), then analytics.
        if not args.json:
            print_summary(summary, sys.stdout)
        if not getattr(args, "no_analytics", False):
            result = run_analytics(Path(summary["workdir"]), summary)
            if result and not args.json:
                print("analytics:", json.dumps(result, default=str)[:2000], file=sys.stdout)
                for n, key in ((1, "debs_edge_vs_batch"), (2, "debs_q2_edge_vs_batch")):
                    q = result.get(key)
                    if q:
                        print(f"DEBS query {n}, edge vs batch: {q['equal']} of {q['windows_edge']} windows equal, "
                              f"{q['differing']} differ, {q['open_at_edge']} still open at the edge when the load "
                              f"ended ({q['windows_batch']} in batch)", file=sys.stdout)
    if args.json:
        json.dump(summary, sys.stdout, indent=2, sort_keys=True, default=str)
        print()
    if not summary["ok"]:
        print(f"demo: FAILED (lost or duplicated records); work directory kept in {summary['workdir']}",
              file=sys.stderr)
    if created and workdir.is_dir() and not any(workdir.iterdir()):
        workdir.rmdir()  # nothing was written there (a run that never started its fleet)
    return EXIT_OK if summary["ok"] else EXIT_LOSS


__all__ = ["Fleet", "Monitor", "run_demo", "wait_online"]
