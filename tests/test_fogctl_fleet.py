"""fogctl against a fake fleet on the real broker: human tables and --json show what agents publish.

The fake agents (agent.fogctl.testing) publish retained status with a Last Will, retained state
JSON, latency, events and decision histories, and answer rpc requests like the daemon should.
Each test module uses its own cluster name so retained messages of other tests never leak in.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List, Tuple

import pytest

from agent import events
from agent.cli.fogctl import main
from agent.fogctl.testing import FakeAgent, FakeInstance

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, broker, cluster: str, *argv: str) -> Tuple[int, str, str]:
    code = main(["--broker", broker.address, "--cluster", cluster, "--timeout", "5", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def fleet_instances() -> List[List[FakeInstance]]:
    fgme = lambda s: {"boundary": "validate|in_zone", "state": s}  # noqa: E731
    return [
        [FakeInstance("source-1", "source", keeper=True, load=200.0),
         FakeInstance("in_zone-1", "in_zone", keeper=True, load=380.0, capacity=400.0, lock=fgme("in_cs"))],
        [FakeInstance("validate-1", "validate", keeper=True, load=210.0, lock=fgme("requesting")),
         FakeInstance("in_zone-2", "in_zone", load=300.0, capacity=400.0, phase="starting", lock=fgme("in_cs"))],
        [FakeInstance("sink-1", "sink", keeper=True, load=190.0),
         FakeInstance("in_zone-3", "in_zone", load=50.0, capacity=400.0, phase="terminating", lock=fgme("idle"))],
    ]


@pytest.fixture(scope="module")
def fleet(mosquitto):
    cluster = "t" + uuid.uuid4().hex[:8]
    names = ["n1", "n2", "n3"]
    agents = []
    for k, (name, insts) in enumerate(zip(names, fleet_instances())):
        lat = {p: 1.0 + k + j for j, p in enumerate(names) if p != name}
        emu = {p: 10.0 * (k + 1) for p in names if p != name}
        agents.append(FakeAgent(mosquitto.host, mosquitto.port, cluster, name, slots=4, instances=insts,
                                cpu=10.0 + k, memory=30.0 + k, temperature=50.0 + k,
                                latency_ms=lat, emulated_ms=emu).start())
    yield cluster, agents
    for a in agents:
        a.stop()


def test_status_table_and_json_match_agent_state(capsys, mosquitto, fleet) -> None:
    cluster, agents = fleet
    code, out, err = run(capsys, mosquitto, cluster, "--json", "status")
    assert code == 0, err
    doc = json.loads(out)
    nodes = {n["node"]: n for n in doc["nodes"]}
    assert set(nodes) == {"n1", "n2", "n3"}
    for a in agents:
        st = a.state()
        n = nodes[a.node]
        assert n["status"] == "online"
        assert (n["cpu"], n["memory"], n["temperature"]) == (st["cpu"], st["memory"], st["temperature"])
        assert sorted(n["instances"]) == sorted(i["id"] for i in st["instances"])
        assert (n["slots"], n["free_slots"]) == (4, 4 - len(st["instances"]))
        assert 0 <= n["last_seen_s"] < 30
    code, out, _ = run(capsys, mosquitto, cluster, "status")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["NODE", "STATUS", "CPU%"]
    row = {line.split()[0]: line.split() for line in lines[1:]}
    assert row["n2"][1] == "online" and row["n2"][2] == "11.0" and row["n2"][5] == "2/4"
    assert "validate-1" in out and "in_zone-3" in out


def test_topology_shows_keeper_phase_load_ratio(capsys, mosquitto, fleet) -> None:
    cluster, agents = fleet
    code, out, err = run(capsys, mosquitto, cluster, "--json", "topology")
    assert code == 0, err
    (p,) = json.loads(out)["pipelines"]
    assert p["pipeline"] == "taxi"
    ops = {o["operator"]: o for o in p["operators"]}
    assert ops["in_zone"]["count"] == 3
    by_id = {i["id"]: i for o in p["operators"] for i in o["instances"]}
    want = {i.id: (a.node, i) for a in agents for i in a.instances}
    assert set(by_id) == set(want)
    for iid, (node, inst) in want.items():
        got = by_id[iid]
        assert (got["node"], got["keeper"], got["phase"], got["load"], got["capacity"]) == \
            (node, inst.keeper, inst.phase, inst.load, inst.capacity)
        assert got["ratio"] == pytest.approx(inst.load / inst.capacity, abs=1e-4)
    # The keeper is listed first among its siblings.
    assert ops["in_zone"]["instances"][0]["id"] == "in_zone-1"
    code, out, _ = run(capsys, mosquitto, cluster, "topology")
    line = next(ln for ln in out.splitlines() if "in_zone-1" in ln).split()
    assert line == ["taxi", "in_zone", "in_zone-1", "n1", "keeper", "active", "380.0", "400.0", "0.95"]
    code, out, _ = run(capsys, mosquitto, cluster, "topology", "--tree")
    assert "in_zone (3 instances)" in out and "in_zone-2 @n2 starting" in out


def test_latency_matrix_measured_and_emulated(capsys, mosquitto, fleet) -> None:
    cluster, agents = fleet
    code, out, err = run(capsys, mosquitto, cluster, "--json", "latency")
    assert code == 0, err
    doc = json.loads(out)
    for a in agents:
        assert doc["measured_ms"][a.node] == a.latency_ms
        assert doc["emulated_ms"][a.node] == a.emulated_ms
    code, out, _ = run(capsys, mosquitto, cluster, "latency")
    measured = out.split("\n\n")[0].splitlines()
    assert measured[1].split() == ["FROM\\TO", "n1", "n2", "n3"]
    assert measured[3].split() == ["n2", "2.0", "0.0", "4.0"]  # n2 -> n1 = 1+1+0, n2 -> n3 = 1+1+2
    assert "configured emulated delay" in out


def test_locks_per_boundary(capsys, mosquitto, fleet) -> None:
    cluster, _ = fleet
    code, out, err = run(capsys, mosquitto, cluster, "--json", "locks")
    assert code == 0, err
    (b,) = json.loads(out)["boundaries"]
    assert b["boundary"] == "validate|in_zone"
    assert b["in_cs"] == ["in_zone-1", "in_zone-2"] and b["groups_in_cs"] == ["in_zone"]
    assert b["requesting"] == ["validate-1"] and b["idle"] == ["in_zone-3"]
    code, out, _ = run(capsys, mosquitto, cluster, "locks")
    row = out.strip().splitlines()[1].split()
    assert row == ["validate|in_zone", "in_zone", "in_zone-1,in_zone-2", "validate-1", "1"]


def test_killed_agent_shows_offline_within_keepalive_bound(capsys, mosquitto) -> None:
    cluster = "k" + uuid.uuid4().hex[:8]
    keepalive = 1
    a = FakeAgent(mosquitto.host, mosquitto.port, cluster, "n9", keepalive=keepalive,
                  instances=[FakeInstance("source-1", "source", keeper=True)]).start()
    code, out, _ = run(capsys, mosquitto, cluster, "--json", "status")
    assert json.loads(out)["nodes"][0]["status"] == "online"
    a.kill()
    t0 = time.monotonic()
    bound = 1.5 * keepalive + 1.0  # MQTT: the broker gives up after 1.5 x keepalive
    status = "online"
    while time.monotonic() - t0 < bound + 2.0:
        code, out, _ = run(capsys, mosquitto, cluster, "--json", "status")
        status = json.loads(out)["nodes"][0]["status"]
        if status == "offline":
            break
        time.sleep(0.1)
    assert status == "offline"
    assert time.monotonic() - t0 <= bound + 0.5


def test_watch_prints_scale_out_with_reason_while_it_happens(capsys, mosquitto, fleet) -> None:
    cluster, agents = fleet
    ev = events.decision(ts=time.time(), node="n1", instance="in_zone-1", operator="in_zone", pipeline="taxi",
                         load=560.0, capacity=500.0, probability=0.6, draw=0.31, action="duplicate",
                         count=1, type="scale_out", detail={"new": ["in_zone-7"]})
    noise = events.make("lock_enter", ts=time.time(), node="n2", instance="validate-1", operator="validate")

    def publish_later() -> None:
        time.sleep(0.5)
        agents[1].publish_event(noise)
        agents[0].client.publish("fog/%s/events" % cluster, b"{not json", qos=1)
        agents[0].publish_event(ev)

    import threading

    threading.Thread(target=publish_later, daemon=True).start()
    code, out, err = run(capsys, mosquitto, cluster, "watch", "--filter", "type=scale_out,scale_in",
                         "--count", "1", "--duration", "10")
    assert code == 0, err
    (line,) = out.strip().splitlines()
    assert "n1 in_zone-1 scale_out" in line
    for part in ("load=560.0", "cap=500.0", "ratio=1.12", "p=0.600", "draw=0.310", "-> duplicate", "new=in_zone-7"):
        assert part in line
    assert "malformed event" in err  # bad payloads are reported, not fatal


def test_watch_json_lines_roundtrip(capsys, mosquitto, fleet) -> None:
    cluster, agents = fleet
    ev = events.make("lock_request", ts=123.5, node="n2", instance="validate-1", operator="validate",
                     detail={"boundary": "validate|in_zone"})
    import threading

    threading.Timer(0.5, agents[1].publish_event, args=(ev,)).start()
    code, out, _ = run(capsys, mosquitto, cluster, "--json", "watch", "--instance", "validate-1",
                       "--count", "1", "--duration", "10")
    assert code == 0
    assert events.parse(out.strip()) == ev


def test_why_shows_last_decisions_with_reasons(capsys, mosquitto, fleet) -> None:
    cluster, agents = fleet
    hist: List[events.Event] = []
    for k in range(13):
        e = events.decision(ts=1000.0 + k, node="n1", instance="in_zone-1", operator="in_zone",
                            load=100.0 + k, capacity=400.0, probability=0.1, draw=0.5, action="none")
        hist = events.remember(hist, e)
    assert len(hist) == events.HISTORY_LENGTH
    agents[0].publish_history("in_zone-1", hist)
    code, out, err = run(capsys, mosquitto, cluster, "--json", "why", "in_zone-1", "--last", "3")
    assert code == 0, err
    got = json.loads(out)["decisions"]
    assert [d["reason"]["load"] for d in got] == [110.0, 111.0, 112.0]
    code, out, _ = run(capsys, mosquitto, cluster, "why", "in_zone-1", "--last", "2")
    assert len(out.strip().splitlines()) == 2 and "load=112.0" in out


def test_pipelines_and_deploy_undeploy(capsys, mosquitto, tmp_path) -> None:
    cluster = "d" + uuid.uuid4().hex[:8]
    agents = [FakeAgent(mosquitto.host, mosquitto.port, cluster, n, slots=2).start() for n in ("n1", "n2", "n3")]
    try:
        f = tmp_path / "taxi.toml"
        f.write_text((ROOT / "examples" / "pipeline.toml").read_text())
        code, out, err = run(capsys, mosquitto, cluster, "--json", "deploy", str(f))
        assert code == 0, err
        doc = json.loads(out)
        keepers = {k["operator"]: (k["instance"], k["node"]) for k in doc["keepers"]}
        assert list(keepers) == ["source", "validate", "in_zone", "sink"]
        # Each keeper really runs where fogctl says (the fake agents' own lists).
        hosted = {i.id: a.node for a in agents for i in a.instances}
        assert {iid: node for iid, node in keepers.values()} == hosted
        assert all(i.keeper for a in agents for i in a.instances)
        time.sleep(0.5)  # the fake agents' starting -> active
        code, out, _ = run(capsys, mosquitto, cluster, "--json", "pipelines")
        (p,) = json.loads(out)["pipelines"]
        assert p["deployed"] is True
        # pipeline order (from the retained TOML), with the instance count of each operator
        assert [(o["operator"], o["instances"]) for o in p["operators"]] == \
            [("source", 1), ("validate", 1), ("in_zone", 1), ("sink", 1)]
        code, out, _ = run(capsys, mosquitto, cluster, "pipelines")
        assert out.splitlines()[1].split() == ["taxi", "yes", "4", "source=1", "validate=1", "in_zone=1", "sink=1"]
        bad = tmp_path / "bad.toml"
        bad.write_text('[pipeline]\nname = "x"\n')
        code, _, err = run(capsys, mosquitto, cluster, "deploy", str(bad))
        assert code == 1 and "bad.toml" in err and "Traceback" not in err
        code, out, err = run(capsys, mosquitto, cluster, "--json", "undeploy", "taxi")
        assert code == 0, err
        stopped = [s["instance"] for s in json.loads(out)["stopped"]]
        assert stopped == [keepers[op][0] for op in ("source", "validate", "in_zone", "sink")]  # sources first
        stops = [r for a in agents for r in a.requests if r.get("op") == "stop"]
        assert sorted(r["instance"] for r in stops) == sorted(stopped)
        time.sleep(0.5)
        code, out, _ = run(capsys, mosquitto, cluster, "--json", "pipelines")
        assert json.loads(out)["pipelines"] == []
        code, _, err = run(capsys, mosquitto, cluster, "undeploy", "taxi")
        assert code == 1 and "not deployed" in err
    finally:
        for a in agents:
            a.stop()


def test_console_script_status_in_subprocess(mosquitto, fleet) -> None:
    cluster, _ = fleet
    proc = subprocess.run([sys.executable, "-m", "agent.cli.fogctl", "--broker", mosquitto.address,
                           "--cluster", cluster, "--json", "status"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert {n["node"] for n in json.loads(proc.stdout)["nodes"]} == {"n1", "n2", "n3"}


def test_watch_survives_a_broker_restart(tmp_path) -> None:
    from conftest import start_broker, stop_broker

    import paho.mqtt.client as mqtt

    broker = start_broker(tmp_path / "b")
    cluster = "w" + uuid.uuid4().hex[:8]
    watch = subprocess.Popen([sys.executable, "-m", "agent.cli.fogctl", "--broker", broker.address,
                              "--cluster", cluster, "--json", "watch", "--count", "1", "--duration", "30"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watch.stderr.readline().startswith("watching")
        stop_broker(broker)
        broker = start_broker(tmp_path / "b", port=broker.port)
        ev = events.make("scale_in", ts=5.0, node="n1", instance="x-2", operator="x")
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        pub.connect(broker.host, broker.port)
        pub.loop_start()
        deadline = time.monotonic() + 20
        while watch.poll() is None and time.monotonic() < deadline:
            pub.publish(f"fog/{cluster}/events", ev.to_json(), qos=1)
            time.sleep(0.3)
        pub.disconnect()
        pub.loop_stop()
        out, err = watch.communicate(timeout=10)
        assert watch.returncode == 0, err
        assert events.parse(out.strip()) == ev
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        stop_broker(broker)


def test_watch_and_why_explain_decisions_carried_in_agent_state(capsys, mosquitto) -> None:
    """Workers keep recent decisions in their stats, which the agent republishes in its state:
    watch shows only the new one, live, with load/capacity/ratio; why shows the history."""
    cluster = "s" + uuid.uuid4().hex[:8]
    a = FakeAgent(mosquitto.host, mosquitto.port, cluster, "n1").start()
    topic = f"fog/{cluster}/agents/n1/state"

    def state(decisions):
        inst = {"id": "in_zone-1", "operator": "in_zone", "keeper": True, "status": "active", "load": 1.0,
                "capacity": 400.0, "stats": {"capacity": 400.0, "decisions": decisions}}
        return json.dumps({"node": "n1", "time": time.time(), "slots": 4, "free_slots": 3, "instances": [inst]})

    old = {"at": 1000.0, "kind": "scale_in", "load": 100.0, "new": []}
    new = {"at": 2000.0, "kind": "scale_out", "load": 600.0, "new": ["in_zone-9"]}
    try:
        a.client.publish(topic, state([old]), qos=1, retain=True).wait_for_publish(5)
        import threading

        # A newer decision every 0.5 s until watch returns: whichever state watch reads as its
        # starting snapshot (its subscription can take longer than any fixed delay on a loaded
        # machine), the next one carries a decision it has not seen.
        done = threading.Event()

        def decide() -> None:
            i = 0
            while not done.wait(0.5):
                i += 1
                a.client.publish(topic, state([old, dict(new, at=2000.0 + i)]), qos=1, retain=True)

        threading.Thread(target=decide, daemon=True).start()
        try:
            code, out, err = run(capsys, mosquitto, cluster, "watch", "--count", "1", "--duration", "10")
        finally:
            done.set()
        assert code == 0, err
        (line,) = out.strip().splitlines()
        assert "n1 in_zone-1 scale_out load=600.0 cap=400.0 ratio=1.50 -> duplicate new=in_zone-9" in line
        code, out, err = run(capsys, mosquitto, cluster, "--json", "why", "in_zone-1")
        assert code == 0, err
        got = json.loads(out)["decisions"]
        assert [(d["type"], d["reason"]["load"]) for d in got] == [("scale_in", 100.0), ("scale_out", 600.0)]
    finally:
        a.stop()


def test_latency_shows_what_the_real_latency_measurers_published(capsys, mosquitto) -> None:
    """Three agent.measure.latency measurers ping each other through the broker; every row
    fogctl shows is exactly a row that node published (measured and emulated)."""
    from agent.measure.latency import LatencyCore, MqttLatencyAgent

    cluster = "l" + uuid.uuid4().hex[:8]
    names = ["n1", "n2", "n3"]
    published: dict = {n: [] for n in names}
    agents = []
    for k, n in enumerate(names):
        core = LatencyCore(n, cluster, period=0.2, emulated={p: 25.0 * (k + 1) for p in names if p != n})
        core.set_neighbours([p for p in names if p != n])
        a = MqttLatencyAgent(core, mosquitto.host, mosquitto.port, client_id=f"lat-{cluster}-{n}")

        def record(topic, payload, retain=False, a=a, n=n, orig=a._publish):
            if retain:
                published[n].append(json.loads(payload))
            orig(topic, payload, retain)

        a._publish = record
        agents.append(a.start())
    try:
        # the rows are published when they changed, once a period: wait for the complete ones
        assert wait_for_published_rows(published, names, timeout=15)
    finally:
        for a in agents:
            a.stop()
    time.sleep(0.3)
    code, out, err = run(capsys, mosquitto, cluster, "--json", "latency")
    assert code == 0, err
    doc = json.loads(out)
    for k, n in enumerate(names):
        rows = [d["rtt_ms"] for d in published[n]]
        assert doc["measured_ms"][n] in rows
        assert set(doc["measured_ms"][n]) == {p for p in names if p != n}
        assert all(v > 0 for v in doc["measured_ms"][n].values())
        assert doc["emulated_ms"][n] == {p: 25.0 * (k + 1) for p in names if p != n}
    code, out, _ = run(capsys, mosquitto, cluster, "latency")
    assert "measured RTT (ms)" in out and "configured emulated delay (ms)" in out


def wait_for_published_rows(published: dict, names, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(published[n] and set(published[n][-1]["rtt_ms"]) >= {p for p in names if p != n} for n in names):
            return True
        time.sleep(0.1)
    return False
