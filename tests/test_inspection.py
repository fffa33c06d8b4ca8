"""Inspection that helps (issue 23, item 6): `fogctl watch` shows changes in readable lines,
`fogctl status` flags draining and offline nodes and pins, a subscriber can leave the data out of
`fog/#`, and the latency matrix measures the network, not the agents' loops.

Real parts: the session broker (conftest `mosquitto`, `set_tcp_nodelay true`), `mosquitto_sub`,
real agents (`python -m agent run`) and the userspace delay proxy (lab/foglab/tools/delayproxy.py).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from agent import events, topics
from agent.cli.fogctl import main
from agent.fogctl import views
from agent.control.fleet import Fleet
from agent.fogctl.testing import FakeAgent, FakeInstance
from foglab.tools.delayproxy import DelayProxy, ProxyBank
from agent.measure.latency import BROKER, LatencyCore, MqttLatencyAgent, Probe, ping_topic, pong_topic, received_at

ROOT = Path(__file__).resolve().parent.parent


def fogctl(capsys, broker, cluster: str, *argv: str) -> Tuple[int, str, str]:
    code = main(["--broker", broker.address, "--cluster", cluster, "--timeout", "5", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- watch: one readable line per change ------------------------------------------------------------


def terminated(cause: str) -> events.Event:
    """What the daemon publishes when a worker leaves (agent/node/exits.py `Exits.reaped`):
    the worker's whole stats object rides along, ~1,500 characters of it."""
    stats = {f"counter_{k}": k * 1000 for k in range(80)}
    stats.update(decisions=[{"at": 1.0, "kind": "scale_out", "load": 5.0, "new": ["x"]}], state="terminated")
    return events.make("terminated", ts=1_700_000_000.25, node="n1", instance="taxi.in_zone.3", operator="in_zone",
                       pipeline="taxi", detail={"source": "agent", "cause": cause, "code": 0,
                                                "reason": "stopped:\n  undeploy requested", "clean": True,
                                                "stats": stats})


def test_an_event_line_is_bounded_key_value_and_names_the_cause_first() -> None:
    ev = terminated("undeploy")
    assert len(ev.to_json()) > 1500
    line = views.event_line(ev)
    assert line.startswith("22:13:20.250 n1 taxi.in_zone.3 terminated cause=undeploy ")
    assert len(line) <= views.EVENT_LINE_MAX and "\n" not in line
    assert "{" not in line and "'" not in line and "counter_" not in line  # no Python repr of the stats
    assert 'reason="stopped: undeploy requested"' in line and "clean=yes" in line and "code=0" in line
    assert "source=" not in line
    from_state = events.make("scale_out", ts=1.0, node="n1", instance="a", detail={"source": "state"})
    assert views.event_line(from_state).endswith(" scale_out source=state")  # docs/fogctl.md: read from a state
    many = events.make("scale_out", ts=1.0, node="n1", instance="a", detail={"new": [f"a-{k}" for k in range(9)],
                                                                               "note": "x" * 500})
    line = views.event_line(many)
    assert "new=a-0,a-1,a-2,a-3,a-4,+4" in line and len(line) < 140


def test_only_changes_count_as_changes() -> None:
    idle = events.decision(ts=1.0, node="n1", instance="i", operator="o", load=1.0, capacity=10.0, action="none")
    acted = events.decision(ts=1.0, node="n1", instance="i", operator="o", load=12.0, capacity=10.0,
                            action="duplicate", count=1, type="scale_out")
    assert not events.changes_something(idle)
    assert events.changes_something(acted)
    for etype in ("spawned", "terminated", "drain", "lock_enter", "refused", "steer", "spool_full"):
        assert events.changes_something(events.make(etype, ts=1.0, node="n1"))


@pytest.mark.broker
def test_watch_hides_heartbeat_decisions_unless_all(capsys, mosquitto) -> None:
    cluster = "i" + uuid.uuid4().hex[:8]
    agent = FakeAgent(mosquitto.host, mosquitto.port, cluster, "n1", instances=[FakeInstance("i-1", "op")]).start()
    idle = [events.decision(ts=time.time(), node="n1", instance="i-1", operator="op", load=1.0, capacity=10.0,
                            action="none", detail={"source": "worker"}) for _ in range(3)]
    spawned = events.make("spawned", ts=time.time(), node="n1", instance="i-2", operator="op", detail={"cause": "spawn"})
    gone = terminated("undeploy")

    def publish_later() -> None:
        time.sleep(0.6)
        for e in idle[:2] + [spawned] + idle[2:] + [gone]:
            agent.publish_event(e)

    publishers: List[threading.Thread] = []
    try:
        publishers.append(threading.Thread(target=publish_later, daemon=True))
        publishers[-1].start()
        code, out, err = fogctl(capsys, mosquitto, cluster, "watch", "--count", "2", "--duration", "10")
        assert code == 0, err
        lines = out.strip().splitlines()
        assert len(lines) == 2 and " spawned cause=spawn" in lines[0], lines
        assert " terminated cause=undeploy " in lines[1] and "-> none" not in out
        for t in publishers:
            t.join()  # the first batch is out before the second begins
        publishers.append(threading.Thread(target=publish_later, daemon=True))
        publishers[-1].start()
        code, out, err = fogctl(capsys, mosquitto, cluster, "--json", "watch", "--all", "--count", "4", "--duration", "10")
        assert code == 0, err
        got = [events.parse(line) for line in out.strip().splitlines()]  # one JSON object per line
        assert [e.type.value for e in got] == ["decision", "decision", "spawned", "decision"]
    finally:
        for t in publishers:
            t.join()  # the agent stays connected until every event is out
        agent.stop()


# ---- status: draining, offline, pins ------------------------------------------------------------


def test_status_flags_draining_and_offline_nodes_and_lists_pins() -> None:
    c = "c"
    now = 1_700_000_100.0
    pin = {"pipeline": "taxi", "operator": "in_zone", "until": None}
    state = lambda node, **kw: json.dumps(dict({"node": node, "ts": now - 2, "cpu": 93.5, "memory": 41.0,  # noqa: E731
                                                "temperature": 55.0, "slots": 4, "free_slots": 4,
                                                "instances": []}, **kw)).encode()
    fleet = Fleet.from_messages(c, {
        topics.agent_state(c, "n1"): state("n1", draining=True, free_slots=0, pins=[pin]),
        topics.agent_status(c, "n1"): b"online",
        topics.agent_state(c, "n2"): state("n2", ts=now - 600, pins=[pin, {"operator": 7}]),
        topics.agent_status(c, "n2"): b"offline",
        topics.agent_state(c, "n3"): state("n3", cpu=12.0),
        topics.agent_status(c, "n3"): b"online",
    })
    doc, text = views.status(fleet, now)
    nodes = {n["node"]: n for n in doc["nodes"]}
    assert nodes["n1"]["draining"] is True and nodes["n3"]["draining"] is False
    assert nodes["n2"]["status"] == "offline" and nodes["n2"]["cpu"] is None and nodes["n2"]["memory"] is None
    assert nodes["n1"]["cpu"] == 93.5 and nodes["n3"]["cpu"] == 12.0
    assert doc["pins"] == [{"operator": "in_zone", "pipeline": "taxi", "until": None, "nodes": ["n1", "n2"]}]
    rows = {line.split()[0]: line for line in text.splitlines()[1:4]}
    assert rows["n1"].split()[1:3] == ["online", "draining"]
    assert rows["n2"].split()[1:5] == ["offline", "-", "-", "-"] and "93.5" not in rows["n2"] and "10m ago" in rows["n2"]
    assert text.splitlines()[-1] == \
        "pinned by fogctl scale (the policy leaves their count alone): in_zone (taxi) until released"


# ---- data a fog/# subscriber can leave out ----------------------------------------------------------


@pytest.mark.broker
def test_mosquitto_sub_filters_the_data_out_of_everything(mosquitto) -> None:
    """The exact command docs/fogctl.md gives ("Watching the bus"), against the real broker."""
    import paho.mqtt.client as mqtt

    cluster = "i" + uuid.uuid4().hex[:8]
    cmd = ["mosquitto_sub", "-h", mosquitto.host, "-p", str(mosquitto.port), "-v", "-W", "3",
           "-t", "fog/#", "-T", "fog/+/inbox/#", "-T", "fog/+/spill/+/chunk", "-T", "fog/+/latency/+/+/+"]
    sub = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="inspect-pub-" + cluster)
    pub.connect(mosquitto.host, mosquitto.port)
    pub.loop_start()
    try:
        time.sleep(0.8)  # mosquitto_sub subscribed
        sent = {topics.inbox_at(cluster, "n2", "taxi.in_zone.0", "n1"): b"data", topics.spill_chunk(cluster, "n1"): b"chunk",
                topics.latency_ping(cluster, "n2", "n1"): b"ping", topics.events(cluster): b"event",
                topics.agent_state(cluster, "n1"): b"state", topics.latency(cluster, "n1"): b"row"}
        for t, p in sent.items():
            pub.publish(t, p, qos=1).wait_for_publish(5)
        out, _ = sub.communicate(timeout=10)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
        pub.loop_stop()
        pub.disconnect()
    mine = sorted(line for line in out.splitlines() if line.startswith(f"fog/{cluster}/"))
    assert mine == sorted([f"{topics.events(cluster)} event", f"{topics.agent_state(cluster, 'n1')} state",
                           f"{topics.latency(cluster, 'n1')} row"])


# ---- latency: the network, not the loop -------------------------------------------------------------


def test_the_peer_hold_is_subtracted_and_receipt_time_counts() -> None:
    a, b = LatencyCore("a", "c", period=5.0), LatencyCore("b", "c", period=5.0)
    a.set_neighbours(["b"])
    pings = dict(a.poll(100.0))
    # b's loop reads the ping 30 ms after its network thread received it (at 100.010)
    (topic, pong), = b.on_message(ping_topic("c", "b", "a"), pings[ping_topic("c", "b", "a")], 100.040, received=100.010)
    assert topic == pong_topic("c", "a", "b") and Probe.decode(pong).hold_ms == pytest.approx(30.0)
    # a's network thread got the pong at 100.050, its loop reads it at 100.090
    a.on_message(pong_topic("c", "a", "b"), pong, 100.090, received=100.050)
    assert a.rtt("b") == pytest.approx(20.0)  # 50 ms between send and receipt, 30 of them b's loop
    a.on_message(ping_topic("c", "a", "a"), pings[ping_topic("c", "a", "a")], 100.2, received=100.002)
    assert a.rtt(BROKER) == pytest.approx(2.0)
    # a hold larger than the round trip cannot make an RTT negative; a negative one is refused
    pings = dict(a.poll(106.0))
    liar = Probe("a", "b", Probe.decode(pings[ping_topic("c", "b", "a")]).nonce, 106.0, hold_ms=9999.0).encode()
    a.on_message(pong_topic("c", "a", "b"), liar, 106.010)
    assert a.row.last["b"] == 0.0
    with pytest.raises(ValueError):
        Probe.decode(json.dumps({"o": "a", "t": "b", "n": 1, "s": 1.0, "h": -5}).encode())


def test_receipt_time_comes_from_paho_only_on_its_clock() -> None:
    class Msg:
        timestamp = 0.0

    m = Msg()
    m.timestamp = time.monotonic() - 0.5
    now = time.monotonic()
    assert received_at(m, now, time.monotonic) == m.timestamp
    assert received_at(m, 42.0, lambda: 42.0) == 42.0  # a fake clock: paho's stamp means nothing to it
    m.timestamp = now + 10
    assert received_at(m, now, time.monotonic) == now


class BusyLoopAgent(MqttLatencyAgent):
    """An agent whose loop takes `busy` seconds before it handles each message (a worker to
    supervise, a state to publish): the time a probe waits for it is not the network's."""

    busy = 0.03

    def _handle(self, topic: str, payload: bytes, at: float) -> None:
        time.sleep(self.busy)
        super()._handle(topic, payload, at)


@pytest.mark.broker
def test_busy_loops_do_not_show_in_the_matrix_behind_the_delay_proxy(mosquitto) -> None:
    """Two pairs behind the same kind of proxies at the same time: a and c next to the broker, b and
    d behind 40 ms. The loops of a and b lose 30 ms per message, those of c and d none. The busy
    pair's RTTs must equal the idle pair's within a few ms (one loop's 30 ms would show without the
    receipt stamps and the hold). The idle pair is the baseline: on a loaded machine the proxy
    itself is late by several ms, and it is late for both pairs."""
    to_broker = {"a": 0.0, "b": 40.0, "c": 0.0, "d": 40.0}
    pairs = {"a": "b", "b": "a", "c": "d", "d": "c"}
    cluster = "i" + uuid.uuid4().hex[:8]
    samples: Dict[str, Dict[str, List[float]]] = {n: {} for n in to_broker}
    with ProxyBank((mosquitto.host, mosquitto.port), to_broker) as bank:
        agents = []
        try:
            for node in to_broker:
                core = LatencyCore(node, cluster, period=0.4, smoothing=0.3, timeout=3.0)
                core.set_neighbours([pairs[node]])
                record = core.record

                def spy(peer, rtt_ms, via="echo", node=node, record=record):
                    samples[node].setdefault(peer, []).append(rtt_ms)
                    record(peer, rtt_ms, via)

                core.record = spy
                kind = BusyLoopAgent if node in ("a", "b") else MqttLatencyAgent
                agents.append(kind(core, "127.0.0.1", bank.port(node), client_id=f"{cluster}-{node}").start())
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline and not all(
                    len(samples[x].get(y, ())) >= 9 for x in to_broker for y in (pairs[x], BROKER)):
                time.sleep(0.2)
        finally:
            for ag in agents:
                ag.stop()
    med = {x: {y: statistics.median(v) for y, v in row.items()} for x, row in samples.items()}
    for busy, idle in (("a", "c"), ("b", "d")):
        assert abs(med[busy][pairs[busy]] - med[idle][pairs[idle]]) <= 6, med
        assert abs(med[busy][BROKER] - med[idle][BROKER]) <= 6, med
    assert 40.0 - 2 <= med["d"]["c"] and 40.0 - 2 <= med["d"][BROKER] and med["c"][BROKER] <= 40.0 - 2, med


def _rtt_through_ms(host: str, port: int, count: int = 15) -> float:
    """The median round trip of a QoS 0 publish to our own topic through (host, port): the path a
    node behind the proxy has to the broker, as this machine runs it now (the proxy's own wake-ups
    included, which add 5-15 ms on a busy or idle-throttled machine)."""
    import paho.mqtt.client as mqtt

    got = threading.Event()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="rtt-" + uuid.uuid4().hex[:8])
    c.on_message = lambda *_: got.set()
    c.connect(host, port)
    c.loop_start()
    try:
        topic = "rtt/" + uuid.uuid4().hex[:8]
        c.subscribe(topic)
        time.sleep(0.5)
        rtts: List[float] = []
        for _ in range(count):
            got.clear()
            t0 = time.monotonic()
            c.publish(topic, b"x")
            if got.wait(5):
                rtts.append((time.monotonic() - t0) * 1000.0)
            time.sleep(0.1)
        return statistics.median(rtts)
    finally:
        c.loop_stop()
        c.disconnect()


@pytest.mark.broker
def test_real_agents_measure_the_proxy_and_status_shows_drain_and_offline(capsys, mosquitto, tmp_path) -> None:
    """Two real agents, r2 behind a 30 ms proxy: their rows read the proxied path's round trip
    (30 ms, or what a plain MQTT client measures through the proxy in the same run when the
    proxy's own wake-ups make it longer) within -2/+6 ms both ways;
    then r1 drains (status: draining) and r2 dies (status: offline, no machine figures)."""
    cluster = "i" + uuid.uuid4().hex[:8]
    proxy = DelayProxy((mosquitto.host, mosquitto.port), rtt_ms=30.0).start()
    procs = {}
    try:
        for node, port in (("r1", mosquitto.port), ("r2", proxy.port)):
            conf = tmp_path / f"{node}.toml"
            conf.write_text(
                f'[agent]\nnode = "{node}"\ncluster = "{cluster}"\nslots = 2\nstate_dir = "{tmp_path}/state-{node}"\n'
                f'state_period = 0.5\n[mqtt]\nhost = "{mosquitto.host}"\nport = {port}\n[metrics]\nport = 0\n'
                f"[latency]\nperiod = 0.3\n")
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            procs[node] = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(conf)],
                                           stdout=open(tmp_path / f"{node}.log", "w"), stderr=subprocess.STDOUT,
                                           env=env, cwd=str(ROOT))
        seen: List[Tuple[float, float]] = []
        refs: List[float] = []
        # The band is as wide as ever (-2/+6 ms) around the path the proxy really makes now: on a
        # machine whose idle processes wake late the 30 ms proxy takes 33-34 ms for a plain client
        # too. The deadline only ends a hang.
        deadline = time.monotonic() + 60
        ok = False
        while time.monotonic() < deadline and not ok:
            time.sleep(0.5)
            code, out, err = fogctl(capsys, mosquitto, cluster, "--json", "latency")
            m = json.loads(out)["measured_ms"] if code == 0 else {}
            try:
                row = (m["r1"]["r2"], m["r2"]["r1"])
            except KeyError:
                continue
            seen.append(row)
            ref = _rtt_through_ms(mosquitto.host, proxy.port)
            refs.append(ref)
            ok = len(seen) >= 4 and all(max(30.0, ref) - 2 <= v <= max(30.0, ref) + 6 for v in row)
        assert ok, (seen, refs, (tmp_path / "r1.log").read_text()[-2000:])
        code, out, err = fogctl(capsys, mosquitto, cluster, "drain", "r1")
        assert code == 0, err
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            code, out, _ = fogctl(capsys, mosquitto, cluster, "--json", "status")
            nodes = {n["node"]: n for n in json.loads(out)["nodes"]}
            if nodes.get("r1", {}).get("draining"):
                break
            time.sleep(0.3)
        assert nodes["r1"]["draining"] is True and nodes["r2"]["draining"] is False
        assert nodes["r2"]["cpu"] is not None  # online: its machine figures show
        procs["r2"].send_signal(signal.SIGKILL)  # its Last Will says offline
        procs["r2"].wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            code, out, _ = fogctl(capsys, mosquitto, cluster, "status")
            row = next((line for line in out.splitlines() if line.startswith("r2 ")), "")
            if row.split()[1:2] == ["offline"]:
                break
            time.sleep(0.5)
        assert row.split()[1:5] == ["offline", "-", "-", "-"], out
        assert next(line for line in out.splitlines() if line.startswith("r1 ")).split()[1:3] == ["online", "draining"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        proxy.stop()
