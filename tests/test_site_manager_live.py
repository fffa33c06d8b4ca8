"""The site manager on three real agents and the test Mosquitto (docs/site-manager.md).

Low load: the leader drains the least useful node through the existing hand-over and, once it
hosts nothing, runs the release hook (a script that appends the node's name to a file). More
load (a second pipeline): spare capacity falls below the target, the acquire hook runs for the
released node and the node is undrained. Every record of the first pipeline reaches the sink
exactly once (foglab.tools.verify). Then the leader is killed: another agent takes the role once
the lease ran out, and the fleet keeps scaling meanwhile (the protocol never waits for it).

About 60 s: three agents, two pipelines and a lease expiry; it is the only end-to-end run of
the consolidation cycle.
"""

from __future__ import annotations

import json
import signal
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

import pytest
from agent_process import AgentProcess

import agent.node.daemon  # noqa: F401  (a broken daemon must fail here, not skip)
from agent import topics
from pipelines import taxi_in_zone

pytestmark = pytest.mark.broker

PERIOD = 0.5  # [site_manager].period
LEASE = 4.0  # [site_manager].lease


class Agent(AgentProcess):
    STOP_TIMEOUT = 8.0

    def __init__(self, tmp: Path, broker: Any, cluster: str, node: str, hooks: Path) -> None:
        self.node = node
        conf = tmp / f"{node}.toml"
        conf.write_text(
            f'[agent]\nnode = "{node}"\ncluster = "{cluster}"\nslots = 4\nstate_dir = "{tmp}/state-{node}"\nsink_dirs = ["{tmp}/sinks"]\n'
            f"state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 5.0\n"
            f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\nkeepalive = 2\n[metrics]\nport = 0\n'
            f"[site_manager]\nenabled = true\ntarget = 0.6\nmin_nodes = 2\nmax_nodes = 3\ncooldown = 2.0\n"
            f"timeout = 60.0\nperiod = {PERIOD}\nlease = {LEASE}\n"
            f'release_hook = ["{hooks / "hook.sh"}", "{hooks / "released"}"]\n'
            f'acquire_hook = ["{hooks / "hook.sh"}", "{hooks / "acquired"}"]\n'
        )
        super().__init__(conf, tmp / f"{node}.log")


class LeaderRecord:
    """The nodes' site-manager claims as a watcher sees them (its own MQTT client): `get` is the
    running claim of a node whose status says online, else the latest claim."""

    def __init__(self, broker: Any, cluster: str) -> None:
        import paho.mqtt.client as mqtt

        self.cluster = cluster
        self.claims: Dict[str, bytes] = {}
        self.online: Dict[str, bool] = {}
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"site-watch-{uuid.uuid4().hex[:8]}",
                        protocol=mqtt.MQTTv5)
        c.on_connect = lambda cl, *a: cl.subscribe([(topics.all_agents_status(cluster), 1),
                                                    (topics.all_site_managers(cluster), 1)])
        c.on_message = lambda cl, ud, msg: self._on(msg.topic, msg.payload)
        c.connect(broker.host, broker.port)
        c.loop_start()
        self.client = c

    def _on(self, topic: str, payload: bytes) -> None:
        p = topics.parse(self.cluster, topic)
        if p is not None and p.kind == "status":
            self.online[str(p.node)] = payload == b"online"
        elif p is not None and p.kind == "site_manager":
            self.claims[str(p.node)] = payload

    def get(self) -> Dict[str, Any]:
        docs = [json.loads(p) for p in list(self.claims.values()) if p]
        now = time.time()
        live = [d for d in docs if d["until"] > now and self.online.get(d["node"])]
        pick = live or docs
        return max(pick, key=lambda d: d["until"]) if pick else {}

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _lines(path: Path) -> List[str]:
    return path.read_text().split() if path.exists() else []


def test_site_manager_consolidates_acquires_and_fails_over(capsys, mosquitto, tmp_path) -> None:
    from agent.config import load_pipeline_text
    from agent.node.deploy import deploy
    from foglab.tools.demo import Monitor, wait_online
    from foglab.tools.verify import verify_settled

    started = time.monotonic()
    cluster = "m" + uuid.uuid4().hex[:8]
    hook = tmp_path / "hook.sh"
    hook.write_text('#!/bin/sh\necho "$2" >> "$1"\n')
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    sink = tmp_path / "sinks" / "low"  # one directory per pipeline: the verifier reads them all
    sink.mkdir(parents=True)
    (tmp_path / "sinks" / "high").mkdir()
    mon = Monitor(mosquitto.host, mosquitto.port, cluster)
    record = LeaderRecord(mosquitto, cluster)
    agents: Dict[str, Agent] = {}
    low = taxi_in_zone("low", seed=1, rate=50.0)
    try:
        agents["n1"] = Agent(tmp_path, mosquitto, cluster, "n1", tmp_path)
        wait_online(mon, {"n1": agents["n1"].proc})
        deploy(low, mosquitto.host, mosquitto.port, cluster, extra={"sink_dir": str(sink)})
        for n in ("n2", "n3"):
            agents[n] = Agent(tmp_path, mosquitto, cluster, n, tmp_path)
        wait_online(mon, {n: a.proc for n, a in agents.items()})

        # Low load (150 records/s on 6000): one node drained and released, never below min_nodes.
        assert mon.wait(lambda m: len(_lines(tmp_path / "released")) >= 1, 40), mon.states
        released = _lines(tmp_path / "released")
        assert len(released) == 1, released
        gone = released[0]
        # (the leader may have drained itself: its own view is fresher than its retained state)
        assert mon.wait(lambda m: m.states[gone].get("instances") == [] and m.states[gone].get("draining") is True,
                        20), mon.states[gone]
        t_released = time.monotonic()
        time.sleep(3 * PERIOD)
        assert _lines(tmp_path / "released") == [gone]  # min_nodes = 2: no second release
        drains = [e for e in mon.events if e.get("type") == "site_action"]
        assert [e["detail"]["action"] for e in drains][:2] == ["drain", "release"], drains
        assert all(e["detail"]["node"] == gone and e["detail"]["reason"] for e in drains[:2])

        # More load: a second pipeline at 600 records/s: spare 0.51 < 0.6 on two nodes -> acquire
        # (0.68 on three: no drain after it).
        high = taxi_in_zone("high", seed=2, rate=600.0)
        deploy(high, mosquitto.host, mosquitto.port, cluster, extra={"sink_dir": str(tmp_path / "sinks" / "high")})
        assert mon.wait(lambda m: _lines(tmp_path / "acquired") == [gone], 40), mon.states
        node_minutes_saved = (time.monotonic() - t_released) / 60.0
        assert mon.wait(lambda m: not m.states.get(gone, {}).get("draining") and
                        m.states.get(gone, {}).get("free_slots", 0) > 0, 20), mon.states.get(gone)

        # fogctl site: the same record, with the reason of each action (table and --json)
        from agent.cli.fogctl import main

        assert main(["--broker", mosquitto.address, "--cluster", cluster, "--timeout", "5", "--json", "site"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["leader"] in agents and not shown["expired"] and shown["target"] == 0.6, shown
        assert [a["action"] for a in shown["actions"]][-4:] == ["drain", "release", "acquire", "undrain"], shown
        assert all(a["reason"] for a in shown["actions"]), shown
        assert main(["--broker", mosquitto.address, "--cluster", cluster, "--timeout", "5", "site"]) == 0
        table = capsys.readouterr().out
        assert f"release  {gone}" in table and "drained: hosts no instance" in table, table
        site = record.get()["state"]
        assert site["target"] == 0.6 and site["released"] == [], site
        assert [a["action"] for a in site["actions"]][-4:] == ["drain", "release", "acquire", "undrain"], site

        # The first pipeline's source stops and its records settle: exactly once, before a kill -9.
        from agent.node.deploy import RpcClient

        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            reply = client.call(mon.instance_node["low.source.0"],
                                {"op": "set", "instance": "low.source.0", "fields": {"paused": True}})
        assert reply["ok"], reply
        v = verify_settled(load_pipeline_text(low), sink, 60)  # the tail, however slow the machine

        # Kill the leader: another agent takes over once the dead one's lease is void (its Will
        # says offline) or has run out; the fleet keeps running.
        leader = record.get()["node"]
        agents[leader].proc.send_signal(signal.SIGKILL)
        agents[leader].proc.wait()
        killed_at = time.monotonic()
        last = record.get()  # the dead leader's last lease

        def new_leader(m: Any) -> Any:
            d = record.get()
            return d.get("node") not in (None, leader) and d

        assert mon.wait(new_leader, LEASE + 15), record.get()
        seen_at = time.time()
        got = record.get()
        took = time.monotonic() - killed_at
        # The second one waited for the dead one's lease to be void: its claim came after the
        # Will (status offline) or after the lease ran out (one clock).
        assert last["node"] == leader and (mon.status.get(leader) == "offline" or seen_at >= last["until"]), \
            (last, seen_at, mon.status.get(leader))
        assert got["until"] > time.time()
    finally:
        for a in agents.values():
            a.stop()
        mon.close()
        record.close()
    assert v.generated > 100, v
    assert v.ok, v
    print(f"site manager live: {time.monotonic() - started:.1f}s, node-minutes saved {node_minutes_saved:.3f}, "
          f"failover {took:.1f}s, {v}")


def test_a_peer_drain_is_accepted_from_the_lease_holder_only(mosquitto, tmp_path) -> None:
    """`drain` on an agent's peer topic: refused from a node that holds no lease, accepted from
    the holder of an unexpired one (the node then reports draining), refused again once the
    lease expired. One agent, no site manager of its own."""
    import queue

    import paho.mqtt.client as mqtt

    from agent.mqtt.requester import request_properties
    from agent.node import rpc
    from foglab.tools.demo import Monitor, wait_online

    cluster = "p" + uuid.uuid4().hex[:8]
    (tmp_path / "sinks").mkdir()
    conf = tmp_path / "n1.toml"
    conf.write_text(
        f'[agent]\nnode = "n1"\ncluster = "{cluster}"\nslots = 1\nstate_dir = "{tmp_path}/state-n1"\n'
        f"state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 3.0\n"
        f'[mqtt]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\n[metrics]\nport = 0\n')
    replies: "queue.Queue[Dict[str, Any]]" = queue.Queue()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"n9-{uuid.uuid4().hex[:6]}", protocol=mqtt.MQTTv5)
    c.on_connect = lambda cl, *a: cl.subscribe(topics.replies(cluster, "n9", "n1"), qos=1)
    c.on_message = lambda cl, ud, msg: replies.put(json.loads(msg.payload))
    c.connect(mosquitto.host, mosquitto.port)
    c.loop_start()
    mon = Monitor(mosquitto.host, mosquitto.port, cluster)
    agent = AgentProcess(conf, tmp_path / "n1.log")

    def ask(op: str) -> Dict[str, Any]:
        c.publish(topics.agent_peer(cluster, "n1", "n9"), rpc.encode({"op": op, "node": "n1", "v": 1}), qos=1,
                  properties=request_properties(uuid.uuid4().hex.encode())).wait_for_publish(5)
        return replies.get(timeout=10)

    def lease(until: float) -> None:
        c.publish(topics.agent_status(cluster, "n9"), b"online", qos=1, retain=True).wait_for_publish(5)
        c.publish(topics.site_manager(cluster, "n9"), json.dumps({"v": 1, "node": "n9", "until": until}), qos=1,
                  retain=True).wait_for_publish(5)
        time.sleep(0.5)

    try:
        wait_online(mon, {"n1": agent.proc})
        r = ask("drain")
        assert not r["ok"] and "not the site manager" in r["error"], r
        lease(time.time() + 30)
        r = ask("drain")
        assert r["ok"], r
        assert mon.wait(lambda m: m.states.get("n1", {}).get("draining") is True, 10), mon.states.get("n1")
        lease(time.time() - 1)
        r = ask("undrain")
        assert not r["ok"] and "not the site manager" in r["error"], r
        assert ask("spawn")["ok"] is False  # the other peer ops keep their own checks
    finally:
        agent.stop()
        mon.close()
        for t in (topics.site_manager(cluster, "n9"), topics.agent_status(cluster, "n9")):
            c.publish(t, b"", retain=True).wait_for_publish(5)
        c.loop_stop()
        c.disconnect()


# in_zone at 3x its capacity (the sink does not scale)
SCALING_PIPELINE = taxi_in_zone("free", seed=3, rate=300.0, policy="decentralized", capacity=100.0)


def test_the_fleet_scales_while_no_site_manager_leads(mosquitto, tmp_path) -> None:
    """docs/site-manager.md: the manager proposes and orders, it never blocks the protocol. Two
    agents with the site manager enabled, and the role held by a node that is not one of them (n9
    renews its retained lease for the whole test), so that none of them leads: a pipeline
    at 3x its operator's capacity still scales out, nobody drains or releases, and every record
    reaches the sink exactly once."""
    import paho.mqtt.client as mqtt

    from agent.config import load_pipeline_text
    from agent.node.deploy import deploy
    from agent.node.deploy import RpcClient
    from foglab.tools.demo import Monitor, wait_online
    from foglab.tools.verify import verify, verify_settled

    cluster = "f" + uuid.uuid4().hex[:8]
    hook = tmp_path / "hook.sh"
    hook.write_text('#!/bin/sh\necho "$2" >> "$1"\n')
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    sink = tmp_path / "sinks" / "free"
    sink.mkdir(parents=True)
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"n9-{uuid.uuid4().hex[:6]}", protocol=mqtt.MQTTv5)
    c.connect(mosquitto.host, mosquitto.port)
    c.loop_start()
    # n9 renews its lease as a leader does (every 5 s, 30 s ahead): a lease far ahead of the
    # agents' clocks would be refused (docs/site-manager.md, "Election")
    renewing = threading.Event()

    def renew() -> None:
        while not renewing.is_set():
            c.publish(topics.site_manager(cluster, "n9"), json.dumps({"v": 1, "node": "n9", "until": time.time() + 30}),
                      qos=1, retain=True).wait_for_publish(5)
            renewing.wait(5.0)

    c.publish(topics.agent_status(cluster, "n9"), b"online", qos=1, retain=True).wait_for_publish(5)
    c.publish(topics.site_manager(cluster, "n9"), json.dumps({"v": 1, "node": "n9", "until": time.time() + 30}), qos=1,
              retain=True).wait_for_publish(5)
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    mon = Monitor(mosquitto.host, mosquitto.port, cluster)
    record = LeaderRecord(mosquitto, cluster)
    agents: Dict[str, Agent] = {}
    try:
        for n in ("n1", "n2"):
            agents[n] = Agent(tmp_path, mosquitto, cluster, n, tmp_path)
        wait_online(mon, {n: a.proc for n, a in agents.items()})
        deploy(SCALING_PIPELINE, mosquitto.host, mosquitto.port, cluster, extra={"sink_dir": str(sink)})
        assert mon.wait(lambda m: any(e.get("type") == "scale_out" and e.get("operator") == "in_zone"
                                      for e in m.events), 30), mon.events[-20:]
        assert mon.wait(lambda m: m.instances_per_operator(include_terminating=False).get("in_zone", 0) >= 2, 10)
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            reply = client.call(mon.instance_node["free.source.0"],
                                {"op": "set", "instance": "free.source.0", "fields": {"paused": True}})
        assert reply["ok"], reply
        verify_settled(load_pipeline_text(SCALING_PIPELINE), sink, 60)  # the tail reaches the sink
        assert record.get()["node"] == "n9"  # nobody took the role meanwhile
        assert not [e for e in mon.events if e.get("type") == "site_action"], mon.events
        assert not (tmp_path / "released").exists()
    finally:
        for a in agents.values():
            a.stop()
        mon.close()
        record.close()
        renewing.set()
        renewer.join(10)
        for t in (topics.site_manager(cluster, "n9"), topics.agent_status(cluster, "n9")):
            c.publish(t, b"", retain=True).wait_for_publish(5)
        c.loop_stop()
        c.disconnect()
    v = verify(load_pipeline_text(SCALING_PIPELINE), sink)
    assert v.generated > 300 and v.ok, v
