"""fogctl against three real agents (`fog-agent run`, real workers) on the real broker.

What fogctl shows is compared with what each agent says itself over its rpc (`ping` lists the
instances its supervisor runs), not with the retained state fogctl reads. A SIGKILLed agent must
show as offline within the MQTT keepalive bound (1.5 x keepalive) plus one state period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict

import pytest
from agent_process import ONLINE_BOUND, AgentProcess

import agent.node.daemon  # noqa: E402,F401  (a broken daemon must fail here, not skip)

from agent.cli.fogctl import main  # noqa: E402
from agent import topics  # noqa: E402
from agent.fogctl.client import Connection  # noqa: E402
from agent.fogctl.config import FogctlConfig  # noqa: E402

from pipelines import taxi_in_zone  # noqa: E402

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parent.parent
KEEPALIVE = 2  # seconds, [mqtt].keepalive of the agents under test

PIPELINE = taxi_in_zone("taxi", seed=1, rate=50.0)


class Agent(AgentProcess):
    STOP_TIMEOUT = 8.0

    def __init__(self, tmp: Path, broker: Any, cluster: str, node: str) -> None:
        self.node = node
        conf = tmp / f"{node}.toml"
        conf.write_text(
            f'[agent]\nnode = "{node}"\ncluster = "{cluster}"\nslots = 2\nstate_dir = "{tmp}/state-{node}"\n'
            f"state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 3.0\n"
            f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\nkeepalive = {KEEPALIVE}\n[metrics]\nport = 0\n'
        )
        super().__init__(conf, tmp / f"{node}.log")


def fogctl(capsys: Any, broker: Any, cluster: str, *argv: str) -> Any:
    code = main(["--broker", broker.address, "--cluster", cluster, "--timeout", "5", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out) if "--json" in argv else out


def wait_for(pred: Any, timeout: float, step: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(step)


@pytest.fixture(scope="module")
def fleet(mosquitto, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fogctl-agents")
    cluster = "r" + uuid.uuid4().hex[:8]
    agents = [Agent(tmp, mosquitto, cluster, n) for n in ("n1", "n2", "n3")]
    yield cluster, agents, tmp
    for a in agents:
        a.stop()


def test_real_fleet_status_topology_match_agents_own_view(capsys, mosquitto, fleet) -> None:
    cluster, agents, tmp = fleet

    def all_online() -> bool:
        doc = fogctl(capsys, mosquitto, cluster, "--json", "status")
        return [n["status"] for n in doc["nodes"]] == ["online"] * 3

    assert wait_for(all_online, ONLINE_BOUND), "the three agents did not come online"
    # `watch` runs while the deploy happens and must show each keeper's start as it happens.
    watch = subprocess.Popen([sys.executable, "-m", "agent.cli.fogctl", "--broker", mosquitto.address,
                              "--cluster", cluster, "--json", "watch", "--filter", "type=spawned",
                              "--count", "3", "--duration", "40"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert watch.stderr.readline().startswith("watching fog/")  # subscribed from here on
        p = tmp / "taxi.toml"
        p.write_text(PIPELINE)
        deployed = fogctl(capsys, mosquitto, cluster, "--json", "deploy", str(p))
        keepers = {k["instance"]: k["node"] for k in deployed["keepers"]}
        assert len(keepers) == 3
        out, err = watch.communicate(timeout=40)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0, err
    seen = [json.loads(line) for line in out.splitlines()]
    assert {(e["instance"], e["node"]) for e in seen} == set(keepers.items())
    assert all(e["type"] == "spawned" and e["pipeline"] == "taxi" for e in seen)

    def active_topology() -> Any:
        doc = fogctl(capsys, mosquitto, cluster, "--json", "topology", "taxi")
        insts = [i for o in doc["pipelines"][0]["operators"] for i in o["instances"]]
        return doc if len(insts) == 3 and all(i["phase"] == "active" for i in insts) else None

    topo = wait_for(active_topology, 30)
    assert topo, "keepers did not become active"
    # The agents' own answer: what their supervisors run.
    with Connection(FogctlConfig(broker=mosquitto.address, cluster=cluster)) as conn:
        own = {a.node: set(conn.rpc(a.node, {"op": "ping"})["instances"])
               for a in agents}
    status = fogctl(capsys, mosquitto, cluster, "--json", "status")
    assert {n["node"]: set(n["instances"]) for n in status["nodes"]} == own
    for n in status["nodes"]:
        assert n["slots"] == 2 and n["free_slots"] == 2 - len(own[n["node"]])
        assert n["cpu"] is not None and n["memory"] is not None and n["last_seen_s"] < 5
    ops = topo["pipelines"][0]["operators"]
    assert [o["operator"] for o in ops] == ["source", "in_zone", "sink"]
    for o in ops:
        (i,) = o["instances"]
        assert i["keeper"] is True and i["id"] in own[i["node"]] and keepers[i["id"]] == i["node"]
    text = fogctl(capsys, mosquitto, cluster, "status")
    for a in agents:
        row = next(line.split() for line in text.splitlines() if line.startswith(a.node + " "))
        assert row[1] == "online"
    # No agent publishes latency or 2-FGME lock state here ("ack" coordination): fogctl says so.
    assert fogctl(capsys, mosquitto, cluster, "--json", "locks")["boundaries"] == []
    assert "no 2-FGME lock state" in fogctl(capsys, mosquitto, cluster, "locks")


def test_metrics_bridge_exports_the_real_workers_counts(mosquitto, fleet) -> None:
    """The agents' own per-instance counters (worker heartbeat stats in their state) exported
    through StatsBridge parse with the Prometheus text parser and equal those counts."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from agent.measure import metrics

    cluster, agents, _ = fleet

    def states() -> Dict[str, Any]:
        with Connection(FogctlConfig(broker=mosquitto.address, cluster=cluster)) as conn:
            snap = conn.snapshot([topics.all_agents_state(cluster)])
        docs = {t: json.loads(m.payload) for t, m in snap.items()}
        insts = [i for d in docs.values() for i in d.get("instances", [])]
        return {i["id"]: i for i in insts}

    def flowing() -> Any:
        """Records reached every non-source instance, and every instance (a source copy too) has
        sent its first heartbeat: before it, its state carries no stats to compare with."""
        s = states()
        return s if s and all("records_in" in (i.get("stats") or {}) for i in s.values()) and all(
            i["stats"]["records_in"] > 0 for i in s.values() if i["operator"] != "source") else None

    insts = wait_for(flowing, 20)
    assert insts, "no records reached in_zone and sink"
    reg = CollectorRegistry()
    bridge = metrics.StatsBridge(metrics.Metrics(reg))
    for i in insts.values():
        bridge.observe("taxi", i["operator"], i["id"], i["stats"])
    samples = {(s.name, s.labels.get("instance")): s.value
               for fam in text_string_to_metric_families(metrics.render(reg)) for s in fam.samples}
    for i in insts.values():
        st = i["stats"]
        assert samples[("fog_records_in_total", i["id"])] == st["records_in"]
        assert samples[("fog_records_out_total", i["id"])] == st["records_out"]
        assert samples[("fog_records_invalid_total", i["id"])] == st.get("malformed", 0) + st.get("operator_errors", 0)


def test_sigkilled_agent_offline_within_keepalive_bound(capsys, mosquitto, fleet) -> None:
    cluster, agents, _ = fleet
    victim = agents[2]
    assert wait_for(lambda: {n["node"]: n["status"] for n in
                             fogctl(capsys, mosquitto, cluster, "--json", "status")["nodes"]}.get("n3") == "online", 30)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    t0 = time.monotonic()

    def offline() -> bool:
        nodes = {n["node"]: n["status"] for n in fogctl(capsys, mosquitto, cluster, "--json", "status")["nodes"]}
        return nodes["n3"] == "offline" and nodes["n1"] == nodes["n2"] == "online"

    assert wait_for(offline, 1.5 * KEEPALIVE + 5, step=0.1)
    elapsed = time.monotonic() - t0
    # The broker publishes the Will 1.5 x keepalive after the last packet; fogctl needs up to one
    # snapshot (well under a second, more on a loaded machine) to show it.
    assert elapsed <= 1.5 * KEEPALIVE + 2.0, f"offline shown after {elapsed:.1f}s"
    text = fogctl(capsys, mosquitto, cluster, "status")
    assert next(line for line in text.splitlines() if line.startswith("n3 ")).split()[1] == "offline"


HOT_PIPELINE = """
[pipeline]
name = "hot"
[scaling]
policy = "decentralized"
capacity = 20.0
period = 1.0
max_instances = 3
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
params = { seed = 2, profile = "constant", rate = 60.0 }
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def test_watch_shows_a_real_scale_out_with_its_reason(capsys, mosquitto, tmp_path) -> None:
    """in_zone receives ~60 records/s for a capacity of 20: its keeper duplicates itself; watch,
    started before the deploy, prints that scale-out with load, capacity and ratio >= up."""
    cluster = "h" + uuid.uuid4().hex[:8]
    agents = [Agent(tmp_path, mosquitto, cluster, n) for n in ("h1", "h2")]
    watch = None
    try:
        assert wait_for(lambda: [n["status"] for n in fogctl(capsys, mosquitto, cluster, "--json", "status")["nodes"]]
                        == ["online"] * 2, 30)
        watch = subprocess.Popen([sys.executable, "-m", "agent.cli.fogctl", "--broker", mosquitto.address,
                                  "--cluster", cluster, "--json", "watch", "--filter", "type=scale_out",
                                  "--filter", "operator=in_zone", "--count", "1", "--duration", "60"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert watch.stderr.readline().startswith("watching fog/")
        p = tmp_path / "hot.toml"
        p.write_text(HOT_PIPELINE)
        fogctl(capsys, mosquitto, cluster, "--json", "deploy", str(p))
        out, err = watch.communicate(timeout=70)
        assert watch.returncode == 0, err
        (ev,) = [json.loads(line) for line in out.splitlines()]
        assert ev["type"] == "scale_out" and ev["operator"] == "in_zone" and ev["node"] in ("h1", "h2")
        r = ev["reason"]
        assert r["capacity"] == 20.0 and r["load"] > 0
        assert r["ratio"] == pytest.approx(r["load"] / r["capacity"], rel=1e-6) and r["ratio"] >= 0.8  # up
        assert r["action"] == "duplicate"
        # The worker's own decision event: the replication factor p = l/(rC) - 1 and the uniform
        # draw it used, and the copy count they give (floor(p), +1 when draw < frac(p)).
        assert (ev.get("detail") or {}).get("source") == "worker", ev
        p = r["load"] / (0.7 * r["capacity"]) - 1.0
        assert r["probability"] == pytest.approx(p, rel=1e-6) and 0.0 <= r["draw"] < 1.0
        assert r["count"] == int(p) + (1 if r["draw"] < p - int(p) else 0) and r["count"] >= 1
        assert len(ev["detail"]["new"]) == r["count"]
        # The decision is the instance's own: `why` finds it in the agent's state.
        why = fogctl(capsys, mosquitto, cluster, "--json", "why", ev["instance"])
        assert any(d["ts"] == ev["ts"] and d["type"] == "scale_out" for d in why["decisions"])
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.wait()
        for a in agents:
            a.stop()


STEER_PIPELINE = taxi_in_zone("steer", seed=3, rate=40.0)


def test_fogctl_scale_and_drain_on_real_agents_lose_no_record(capsys, mosquitto, tmp_path) -> None:
    """`fogctl scale in_zone +2` gives exactly 2 more in_zone instances (policy "none": nobody
    else scales), `fogctl drain s2` empties s2 through the protocol's scale-in, and every record
    generated reaches the sink exactly once (the demo's verifier)."""
    from agent.config import load_pipeline_text
    from foglab.tools.demo import Fleet, Monitor
    from foglab.tools.verify import verify

    cluster = "s" + uuid.uuid4().hex[:8]
    # s1 and s3 hold the three keepers (4 slots): the copies need s2, which hosts no keeper.
    fleet = Fleet(tmp_path, nodes=("s1", "s3"), slots=2, cluster=cluster, broker_host=mosquitto.host,
                  broker_port=mosquitto.port, state_period=0.5, heartbeat_period=0.2, shutdown_timeout=8.0)
    fleet.start()
    mon = Monitor(mosquitto.host, mosquitto.port, cluster)
    try:
        fleet.wait_online(mon)
        fleet.deploy(STEER_PIPELINE)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        fleet.nodes = ("s1", "s2", "s3")
        fleet.start_agent("s2", env)
        fleet.wait_online(mon)

        def in_zone(m: Any, node: Any = None) -> int:
            return sum(1 for n, doc in m.states.items() if node in (None, n) and m.status.get(n) == "online"
                       for i in doc.get("instances", []) if i["operator"] == "in_zone" and i["status"] == "active")

        assert mon.wait(lambda m: m.instances_per_operator().get("sink") == 1 and in_zone(m) == 1, 30)
        time.sleep(1.0)  # a state period: fogctl's view includes s2's free slots
        out = fogctl(capsys, mosquitto, cluster, "scale", "in_zone", "+2")
        assert "accepted" in out
        assert mon.wait(lambda m: in_zone(m) == 3, 40), mon.instances_per_operator()
        time.sleep(2.0)
        assert in_zone(mon) == 3  # exactly +2, no more (policy "none")
        on_s2 = in_zone(mon, "s2")
        assert on_s2 >= 1  # the only free slots left were there (1 elsewhere)
        out = fogctl(capsys, mosquitto, cluster, "drain", "s2")
        assert "accepted" in out
        assert mon.wait(lambda m: len(m.states.get("s2", {}).get("instances", [])) == 0, 40), mon.states.get("s2")
        assert in_zone(mon) == 3 - on_s2
        terminated = [e for e in mon.events if e.get("type") == "terminated"]
        assert len(terminated) >= on_s2
        time.sleep(2.0)  # records keep flowing through the remaining instances
        # Stop the source, let the pipeline empty, then stop the agents (as the demo's profile end).
        from agent.node.deploy import RpcClient

        src = "steer.source.0"
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            reply = client.call(mon.instance_node[src], {"op": "set", "instance": src, "fields": {"paused": True}})
        assert reply["ok"], reply

        mon.wait_sink_quiet(30)
    finally:
        codes = fleet.stop()
        mon.close()
    assert all(c == 0 for c in codes.values()), codes
    v = verify(load_pipeline_text(STEER_PIPELINE), fleet.sink_dir)
    assert v.generated > 100, v
    assert v.ok, v


HANDOVER_PIPELINE = taxi_in_zone("hand", seed=5, rate=40.0)


def test_fogctl_drain_hands_a_keeper_over_to_another_node(capsys, mosquitto, tmp_path) -> None:
    """`fogctl drain h2` when h2 hosts all three keepers (source, in_zone, sink) and a copy of
    in_zone: the copy leaves by scale-in, each keeper migrates with its identity (same instance
    id, still the keeper, a new epoch restored from the state h2 shipped), h2 ends empty and
    forgets them (no spec or state file left to re-adopt), records keep flowing through the new
    incarnations, every generated id reaches the sink exactly once, and the pipeline is back to
    one instance per operator. Without the state shipped in the spec the new incarnation would
    start at epoch 0 (asserted >= 1 below) and its predecessors would not replay to it."""
    from agent.config import load_pipeline_text
    from foglab.tools.demo import Fleet, Monitor
    from foglab.tools.verify import verify
    from agent.node.deploy import RpcClient

    started = time.monotonic()
    cluster = "h" + uuid.uuid4().hex[:8]
    # h2 alone at deploy time: it gets every keeper, then h1 and h3 join with free slots.
    fleet = Fleet(tmp_path, nodes=("h2",), slots=4, cluster=cluster, broker_host=mosquitto.host,
                  broker_port=mosquitto.port, state_period=0.5, heartbeat_period=0.2, shutdown_timeout=8.0)
    fleet.start()
    mon = Monitor(mosquitto.host, mosquitto.port, cluster)
    keepers = [f"hand.{op}.0" for op in ("source", "in_zone", "sink")]

    def hosts(m: Any, inst: str) -> list:
        return [(n, i) for n, doc in m.states.items() if m.status.get(n) == "online"
                for i in doc.get("instances", []) if i["id"] == inst]

    def in_zone(m: Any, node: Any = None) -> int:
        return sum(1 for n, doc in m.states.items() if node in (None, n) and m.status.get(n) == "online"
                   for i in doc.get("instances", []) if i["operator"] == "in_zone" and i["status"] == "active")

    try:
        fleet.wait_online(mon)
        fleet.deploy(HANDOVER_PIPELINE)
        assert mon.wait(lambda m: all(hosts(m, k) and hosts(m, k)[0][0] == "h2" for k in keepers), 20), mon.states
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        fleet.nodes = ("h1", "h2", "h3")
        for node in ("h1", "h3"):
            fleet.start_agent(node, env)
        fleet.wait_online(mon)
        # A copy of in_zone: a local free slot comes first, so it also lands on h2.
        out = fogctl(capsys, mosquitto, cluster, "scale", "in_zone", "+1")
        assert "accepted" in out
        assert mon.wait(lambda m: in_zone(m, "h2") == 2, 30), mon.states.get("h2")
        assert mon.wait(lambda m: m.sink_records_in() > 40, 20), mon.sink_records_in()  # records flow through h2

        doc = fogctl(capsys, mosquitto, cluster, "--json", "drain", "h2")
        assert doc["ok"] and doc["result"]["node"] == "h2", doc
        assert set(keepers) <= set(doc["result"]["leaving"]) and len(doc["result"]["leaving"]) == 4, doc
        assert mon.wait(lambda m: m.states.get("h2", {}).get("instances") == [], 30), mon.states.get("h2")
        assert mon.states["h2"]["free_slots"] == 0  # draining: it offers no slot to the others
        moved = {}
        for k in keepers:
            assert mon.wait(lambda m: any(n != "h2" and i["status"] == "active" for n, i in hosts(m, k)), 20), k
            [(node, inst)] = hosts(mon, k)  # one process per identity
            assert node in ("h1", "h3") and inst["keeper"] is True, (k, node, inst)
            moved[k] = node
        spawned = {e["instance"]: e["node"] for e in mon.agent_events("spawned", "handover")}
        assert spawned == moved, (spawned, moved)
        assert {e["instance"] for e in mon.agent_events("terminated", "handover")} == set(keepers)
        assert not mon.agent_events("terminated", "crash")  # a clean move: nothing killed or restarted
        # h2 forgot them: nothing left there for a restart of its agent to re-adopt.
        left = sorted(p.name for p in (tmp_path / "state-h2").glob("hand.*.json"))
        assert left == [], left
        for k, node in moved.items():
            state = json.loads((tmp_path / f"state-{node}" / f"{k}.state.json").read_text())
            assert state["epoch"] >= 1, (k, state["epoch"])  # restored from the shipped state, then + 1
        # Records keep flowing through the migrated keepers.
        before = mon.sink_records_in()
        assert mon.wait(lambda m: m.sink_records_in() >= before + 40, 20), (before, mon.sink_records_in())
        assert in_zone(mon) == 1 and mon.instances_per_operator() == {"source": 1, "in_zone": 1, "sink": 1}
        # Stop the source, let the pipeline empty, then stop the agents.
        src = keepers[0]
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            reply = client.call(moved[src], {"op": "set", "instance": src, "fields": {"paused": True}})
        assert reply["ok"], reply
        mon.wait_sink_quiet(20)
    finally:
        codes = fleet.stop()
        mon.close()
    assert all(c == 0 for c in codes.values()), codes
    v = verify(load_pipeline_text(HANDOVER_PIPELINE), fleet.sink_dir)
    assert v.generated > 100, v
    assert v.ok, v
    print(f"drain hand-over test: {time.monotonic() - started:.1f}s, {v}")
