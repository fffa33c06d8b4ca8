"""Nothing from the bus kills or stalls an agent, and requests and replies stay in their own
namespaces (issue #20, docs/security.md).

Two levels: the daemon's message handling fed directly (an `Agent` that never connects, whose
publishes are recorded), to check each handler's refusal, counters and unchanged state exactly;
and real agent processes on the plain private Mosquitto, hit with the messages that used to end
them (100k-deep JSON on rpc and latency ping, a ping `{"o": ""}`, a `set` whose field is `event`,
a neighbour's 100k-deep retained state), which must still answer afterwards, plus
`fogctl status` on that state. The TLS broker with the role's ACL is tests/test_security_attacks.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import pytest
from agent.node.loopevents import MqttMessage
from agent_process import ONLINE_BOUND, AgentProcess

from agent import identity, topics
from agent.node.deploy import RpcClient, RpcError

ROOT = Path(__file__).resolve().parent.parent
DEEP = b"[" * 100_000
PIPELINE = """
[pipeline]
name = "p"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


# ---- topics: built and parsed in one place -------------------------------------------------------


def test_every_request_reply_and_probe_topic_names_its_sender_last() -> None:
    p = topics.parse
    assert topics.agent_rpc("c", "n1", "adm") == "fog/c/agents/n1/rpc/adm"
    assert p("c", topics.agent_rpc("c", "n1", "adm")) == ("rpc", "n1", "adm")
    assert topics.agent_peer("c", "n2", "n1") == "fog/c/agents/n2/peer/n1"
    assert p("c", topics.agent_peer("c", "n2", "n1")) == ("peer", "n2", "n1")
    assert topics.replies("c", "adm", "n1") == "fog/c/replies/adm/n1"
    assert p("c", topics.replies("c", "adm", "n1")) == ("reply", "adm", "n1")
    assert p("c", topics.latency_ping("c", "n2", "n1")) == ("ping", "n2", "n1")
    assert p("c", topics.latency_pong("c", "n1", "n2")) == ("pong", "n1", "n2")
    assert topics.latency_pong("c", "n1", "n2") == "fog/c/latency/n1/pong/n2"
    for build, kind in [(topics.agent_state, "state"), (topics.agent_status, "status"),
                        (topics.agent_hosted, "hosted"), (topics.agent_rehomed, "rehomed"),
                        (topics.latency, "latency"), (topics.pipeline, "pipeline"),
                        (topics.decisions, "decisions"),
                        (topics.spill_chunk, "spill_chunk"), (topics.spill_ack, "spill_ack")]:
        assert p("c", build("c", "x")) == (kind, "x", None)
    assert topics.inbox("c", "x", "n1") == "fog/c/inbox/x/n1"
    assert p("c", topics.inbox("c", "x", "n1")) == ("inbox", "x", "n1")  # the writing node, as the ACL proves
    assert topics.inbox_writer(topics.inbox_all("c", "x"), topics.inbox("c", "x", "n1")) == "n1"
    for other in ("fog/c/inbox/xy/n1", "fog/c/inbox/x", "fog/c/inbox/x/", "fog/c/inbox/x/n1/n2", "fog/d/inbox/x/n1"):
        assert topics.inbox_writer(topics.inbox_all("c", "x"), other) is None, other
    assert p("c", topics.events("c")).kind == "events" and p("c", topics.locks("c")).kind == "locks"
    # the subscriptions match exactly the topics above
    import paho.mqtt.client as mqtt

    assert mqtt.topic_matches_sub(topics.agent_rpc_inbox("c", "n1"), topics.agent_rpc("c", "n1", "a"))
    assert mqtt.topic_matches_sub(topics.inbox_all("c", "x"), topics.inbox("c", "x", "n1"))
    assert not mqtt.topic_matches_sub(topics.inbox_all("c", "x"), topics.inbox("c", "xy", "n1"))
    assert mqtt.topic_matches_sub(topics.agent_peer_inbox("c", "n1"), topics.agent_peer("c", "n1", "n2"))
    assert mqtt.topic_matches_sub(topics.replies_inbox("c", "a"), topics.replies("c", "a", "n1"))
    assert not mqtt.topic_matches_sub(topics.replies_inbox("c", "a"), topics.replies("c", "b", "n1"))
    assert mqtt.topic_matches_sub(topics.latency_pings("c", "n1"), topics.latency_ping("c", "n1", "n2"))
    assert mqtt.topic_matches_sub(topics.latency_pongs("c", "n1"), topics.latency_pong("c", "n1", "n2"))
    # what is not one of ours, or is malformed, parses to None (never raises)
    for bad in ["fog/c/agents/n1/rpc", "fog/c/agents/n1/rpc/a/b", "fog/other/agents/n1/state", "fog/c//state",
                "fog/c/agents/+/state", "fog/c/replies/a", "fog/c/rpc-reply/x", "", "fog/c", "x/c/events"]:
        assert p("c", bad) is None, bad
    with pytest.raises(ValueError):
        topics.agent_rpc("c", "n1", "a/b")
    assert topics.parse_any("fog/zz/agents/n3/status") == ("status", "n3", None)


def test_identity_is_the_user_name_else_the_certificate_cn_else_the_client_id(tmp_path: Path) -> None:
    from tls_certs import make_ca, make_cert

    make_ca(tmp_path, "ca")
    cert, key = make_cert(tmp_path, "ca", "ops-admin")
    assert identity.certificate_cn(str(cert)) == "ops-admin"
    assert identity.identity("alice", str(cert), "cid") == "alice"
    assert identity.identity(None, str(cert), "cid") == "ops-admin"
    assert identity.identity(None, None, "cid") == "cid"
    with pytest.raises(identity.IdentityError):
        identity.identity("a/b", None, "cid")  # no topic level
    with pytest.raises(identity.IdentityError):
        identity.certificate_cn(str(tmp_path / "missing.crt"))
    # the tools take it from there: fogctl, `fog-agent deploy`'s RpcClient
    from agent.fogctl.client import Connection
    from agent.fogctl.config import FogctlConfig

    conn = Connection(FogctlConfig(broker="127.0.0.1:1", cluster="c", cert=str(cert), client_id="cid"))
    assert conn.identity == "ops-admin" and conn.reply_filter == "fog/c/replies/ops-admin/+"
    assert conn.reply_topic == topics.replies("c", "ops-admin", "ops-admin")  # its sync marker
    tool = RpcClient("127.0.0.1", 1, "c", client_id="cid", cert_file=str(cert), key_file=str(key),
                         ca_file=str(tmp_path / "ca-ca.crt"))
    assert tool.identity == "ops-admin" and tool.reply_filter == "fog/c/replies/ops-admin/+"
    assert RpcClient("127.0.0.1", 1, "c", client_id="cid", username="dep").identity == "dep"


# ---- the daemon's handlers, fed directly ----------------------------------------------------------


class _Info:
    rc = 0
    mid = 1


class _Recorder:
    """Stands in for the paho client: records what the agent publishes."""

    def __init__(self) -> None:
        self.published: List[Tuple[str, bytes, bool, Any]] = []

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Any = None) -> _Info:
        self.published.append((topic, payload, retain, properties))
        return _Info()


def _msg(topic: str, payload: bytes, retain: bool = False, correlation: Optional[bytes] = b"c-1",
         response_topic: Optional[str] = None) -> Any:
    props = SimpleNamespace(CorrelationData=correlation, ResponseTopic=response_topic)
    return SimpleNamespace(topic=topic, payload=payload, retain=retain, properties=props)


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nslots = 2\nstate_dir = "{tmp_path}/state"\n'
                    '[mqtt]\nhost = "127.0.0.1"\nport = 1\n[metrics]\nport = 0\n')
    a = Agent(load_agent_config(conf), warm_worker=False)
    a.bus.client = _Recorder()
    a.bus.connected = a.bus.retained_in = True  # connected, the retained records in (the sync marker came back)
    yield a
    a.supervisor.close_warm()


def _replies(agent: Any) -> List[Tuple[str, Dict[str, Any], Any]]:
    return [(t, json.loads(p), props) for t, p, _, props in agent.bus.client.published if "/replies/" in t]


def _fingerprint(agent: Any) -> Any:
    return (json.dumps(agent.core.view.fleet, sort_keys=True), json.dumps(agent.core.view.hosted_by_node, sort_keys=True),
            json.dumps(agent.core.view.rehomed_by_node, sort_keys=True), dict(agent.core.view.online), json.dumps(agent.core.view.latency),
            sorted(agent.supervisor.workers), sorted(agent.core.view.deployed), agent.core.drain.draining)


def test_a_reply_goes_to_the_requesters_namespace_not_the_response_topic_it_names(agent: Any) -> None:
    victim = topics.agent_status("c", "n1")
    agent.core._on_message_safely(_msg(topics.agent_rpc("c", "me", "adm"), b'{"op": "ping"}',
                                  response_topic=victim), 0.0)
    ((topic, body, props),) = _replies(agent)
    assert topic == topics.replies("c", "adm", "me") and body["ok"] and body["node"] == "me"
    assert props.CorrelationData == b"c-1"  # echoed: the requester matches by it
    assert all(t != victim for t, *_ in agent.bus.client.published)


@pytest.mark.parametrize("payload, error", [
    (DEEP, "nested deeper"),
    (b"{" * 50 + b"}" * 50, "nested deeper"),
    (b'{"op": "ping", "x": "' + b"a" * 300_000 + b'"}', "bytes"),
    (b"\xff\xfe", "not UTF-8 JSON"),
    (b'{"op": "set", "instance": "i", "fields": {"event": "x"}}', "reserved"),
    (b'{"op": "exec"}', "op"),
])
def test_a_hostile_request_is_refused_counted_and_answered(agent: Any, payload: bytes, error: str) -> None:
    before = _fingerprint(agent)
    agent.core._on_message_safely(_msg(topics.agent_rpc("c", "me", "adm"), payload), 0.0)
    ((topic, body, _),) = _replies(agent)
    assert topic == topics.replies("c", "adm", "me") and body["ok"] is False and error in body["error"]
    assert agent.core.counters["bad_messages"] == 1
    assert _fingerprint(agent) == before


def test_a_set_naming_the_control_lines_own_key_never_reaches_the_worker(agent: Any) -> None:
    sent: List[Any] = []
    agent.supervisor.send = lambda *a, **k: sent.append((a, k)) or True  # type: ignore[method-assign]
    body = {"op": "set", "instance": "i", "fields": {"event": "x"}}
    agent.core._on_message_safely(_msg(topics.agent_rpc("c", "me", "adm"), json.dumps(body).encode()), 0.0)
    assert sent == [] and _replies(agent)[0][1]["ok"] is False
    ok = {"op": "set", "instance": "i", "fields": {"service_time_ms": 5.0}}
    agent.core._on_message_safely(_msg(topics.agent_rpc("c", "me", "adm"), json.dumps(ok).encode()), 0.0)
    assert sent == [(("i", "set"), {"service_time_ms": 5.0})]


def test_a_redelivered_request_is_applied_once(agent: Any) -> None:
    """QoS 1 may deliver a request twice (a site's bridge that resumes its session after the
    uplink broke): the same correlation and payload from the same admin is applied and answered
    once (docs/scale.md, "Sites")."""
    sent: List[Any] = []
    agent.supervisor.send = lambda *a, **k: sent.append((a, k)) or True  # type: ignore[method-assign]
    ok = json.dumps({"op": "set", "instance": "i", "fields": {"service_time_ms": 5.0}}).encode()
    for _ in range(2):
        agent.core._on_message_safely(_msg(topics.agent_rpc("c", "me", "adm"), ok), 0.0)
    assert sent == [(("i", "set"), {"service_time_ms": 5.0})] and len(_replies(agent)) == 1
    assert agent.core.counters["rpc_repeats"] == 1
    agent.core._on_message_safely(_msg(topics.agent_rpc("c", "me", "other-admin"), ok), 0.0)
    assert len(sent) == 2  # another requester's request with the same correlation is its own


def test_a_forced_scale_out_is_bounded_by_the_slots_of_the_fleet(agent: Any) -> None:
    body = {"v": 1, "op": "scale", "operator": "work", "delta": 3_000_000, "pipeline": "p"}
    agent.core._on_message_safely(_msg(topics.agent_rpc("c", "me", "adm"), json.dumps(body).encode()), 0.0)
    ((_, reply, _),) = _replies(agent)
    assert reply["ok"] is False and "+3000000 asks for more copies than the 2 slots" in reply["error"]
    # a neighbour's slots count too; within the bound the request goes on to the usual checks
    n2 = {"v": 1, "node": "n2", "ts": 1.0, "slots": 4, "free_slots": 4, "instances": []}
    agent.core._on_message_safely(_msg(topics.agent_state("c", "n2"), json.dumps(n2).encode(), retain=True), 0.0)
    agent.core._on_message_safely(_msg(topics.agent_status("c", "n2"), b"online", retain=True), 0.0)
    for delta, error in ((7, "more copies than the 6 slots"), (6, "no active instance of 'work'")):
        agent.bus.client.published.clear()
        body["delta"] = delta
        agent.core._on_message_safely(_msg(topics.agent_rpc("c", "me", "adm"), json.dumps(body).encode()), 0.0)
        assert error in _replies(agent)[0][1]["error"]


def test_retained_requests_replies_and_probes_are_ignored(agent: Any) -> None:
    for topic in (topics.agent_rpc("c", "me", "adm"), topics.agent_peer("c", "me", "n2"),
                  topics.replies("c", "me", "n2"), topics.latency_ping("c", "me", "n2"), topics.events("c")):
        agent.core._on_message_safely(_msg(topic, b'{"op": "stop", "instance": "x"}', retain=True), 0.0)
    assert agent.core.counters["retained_ignored"] == 5 and agent.bus.client.published == []
    assert agent.core.counters["rpc_requests"] == 0


def test_the_peer_topic_takes_only_spawns_of_pipelines_an_admin_deployed(
        agent: Any, caplog: Any) -> None:
    peer = topics.agent_peer("c", "me", "n2")
    spec = {"instance": "p.sink.0", "operator": "sink", "pipeline": "p", "pipeline_toml": PIPELINE}
    caplog.set_level(logging.WARNING)
    # control ops are for admins only
    for op in ({"op": "stop", "instance": "x"}, {"op": "ping"}, {"v": 1, "op": "drain", "node": "me"},
               {"op": "set", "instance": "x", "fields": {"a": 1}}):
        agent.core._on_message_safely(_msg(peer, json.dumps(op).encode()), 0.0)
    # a spawn of a pipeline n2 neither hosts nor re-homes, and nobody deployed
    agent.core._on_message_safely(_msg(peer, json.dumps({"op": "spawn", "spec": spec}).encode()), 0.0)
    replies = _replies(agent)
    assert len(replies) == 5 and all(t == topics.replies("c", "n2", "me") for t, _, _ in replies)
    assert all(not b["ok"] and b["error"].startswith("refused") for _, b, _ in replies)
    assert agent.core.counters["peer_refused"] == 5 and not agent.core.drain.draining and len(agent.supervisor) == 0
    assert sum("from node n2" in r.getMessage() for r in caplog.records) == 5  # the requester, named
    # n2's retained hosted record listing an instance of p proves nothing (n2 writes it itself):
    # its spawn is refused by the peer rule all the same
    agent.core.free_slots = lambda: 0  # a full node: what it answers then is the slot refusal
    hosted = json.dumps([dict(spec, instance="p.source.0", operator="source")]).encode()
    agent.core._on_message_safely(_msg(topics.agent_hosted("c", "n2"), hosted, retain=True), 0.0)
    agent.bus.client.published.clear()
    agent.core._on_message_safely(_msg(peer, json.dumps({"op": "spawn", "spec": spec}).encode()), 0.0)
    ((_, body, _),) = _replies(agent)
    assert not body["ok"] and body["error"].startswith("refused") and agent.core.counters["peer_refused"] == 6
    # a deployed pipeline: any node may ask (n3 hosts nothing)
    q_text = PIPELINE.replace('"p"', '"q"')
    agent.core._on_message_safely(_msg(topics.pipeline("c", "q"), q_text.encode(), retain=True), 0.0)
    agent.bus.client.published.clear()
    spec_q = dict(spec, pipeline="q", instance="q.sink.0", pipeline_toml=q_text)
    agent.core._on_message_safely(_msg(topics.agent_peer("c", "me", "n3"),
                                  json.dumps({"op": "spawn", "spec": spec_q}).encode()), 0.0)
    assert _replies(agent)[0][1] == {"ok": False, "error": "no free slot on me"}


def test_a_reply_counts_only_from_the_node_the_call_went_to(agent: Any) -> None:
    from agent.instance.spec import InstanceSpec
    from agent.mqtt.settings import BrokerSpec
    from agent.node import spawns

    got: List[Dict[str, Any]] = []
    spec = InstanceSpec("i", "sink", "me", "c", "p", PIPELINE, BrokerSpec("h", 1))
    agent.core.creating.handle(spawns.CreateNode(spec, got.append, "spawn", ("n2",), {}), 0.0)
    (corr,) = agent.core.spawns.calls  # asked of n2
    ok = json.dumps({"ok": True, "instance": "i", "node": "n2"}).encode()
    agent.core._on_message_safely(_msg(topics.replies("c", "me", "n3"), ok, correlation=corr.encode()), 0.0)
    assert got == [] and len(agent.core.spawns.calls) == 1  # n3 guessed the correlation: ignored
    agent.core._on_message_safely(_msg(topics.replies("c", "me", "n2"), ok, correlation=corr.encode()), 0.0)
    assert got == [{"ok": True, "instance": "i", "node": "n2"}] and len(agent.core.spawns.calls) == 0


def test_hostile_neighbour_records_are_counted_and_leave_the_state_unchanged(agent: Any) -> None:
    good = {"v": 1, "node": "n2", "ts": 1.0, "slots": 2, "free_slots": 1, "instances": []}
    agent.core._on_message_safely(_msg(topics.agent_state("c", "n2"), json.dumps(good).encode(), retain=True), 0.0)
    before = _fingerprint(agent)
    hostile = [
        (topics.agent_state("c", "n2"), DEEP),
        (topics.agent_state("c", "n2"), json.dumps(dict(good, node="n1")).encode()),  # names another node
        (topics.agent_state("c", "n2"), json.dumps(dict(good, slots="2")).encode()),
        (topics.agent_hosted("c", "n2"), DEEP),
        (topics.agent_hosted("c", "n2"), b'[{"instance": 1}]'),
        (topics.agent_rehomed("c", "n2"), DEEP),
        (topics.agent_rehomed("c", "n2"), b'{"i": [1]}'),
        (topics.latency_ping("c", "me", "n2"), DEEP),
        (topics.latency_ping("c", "me", "n2"), b'{"o": ""}'),
        (topics.latency_ping("c", "me", "n2"), b'{"o": "n9", "t": "me", "n": 1, "s": 0}'),  # not the sender
        (topics.latency_pong("c", "me", "n2"), b"[]"),
    ]
    for topic, payload in hostile:
        agent.core._on_message_safely(_msg(topic, payload, retain=topics.parse("c", topic).kind not in ("ping", "pong")), 0.0)
    assert agent.core.counters["bad_messages"] == len(hostile)
    assert _fingerprint(agent) == before and agent.bus.client.published == []
    agent.core._on_message_safely(_msg(topics.latency("c", "n2"), DEEP, retain=True), 0.0)  # lenient: unmeasured
    assert agent.core.view.latency["n2"] == {}


def test_an_unforeseen_failure_in_a_handler_is_one_log_line_not_the_end_of_the_loop(
        agent: Any, caplog: Any, monkeypatch: Any) -> None:
    from agent.node import nodestate

    def boom(payload: bytes) -> Dict[str, float]:
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(nodestate, "parse_latency", boom)
    caplog.set_level(logging.WARNING)
    agent._dispatch(MqttMessage(_msg(topics.latency("c", "n7"), b"{}", retain=True)), 0.0)
    assert agent.core.counters["bad_messages"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert topics.latency("c", "n7") in line and "from n7" in line and "RuntimeError" in line
    agent._dispatch(MqttMessage(_msg(topics.agent_rpc("c", "me", "adm"), b'{"op": "ping"}')), 0.0)
    assert _replies(agent)[0][1]["ok"]  # the next message is handled


# ---- real agents on the private broker ------------------------------------------------------------


class _AgentProc(AgentProcess):
    STOP_TIMEOUT = 8.0

    def __init__(self, tmp_path: Path, broker: Any, node: str, cluster: str) -> None:
        self.node = node
        conf = tmp_path / f"{node}.toml"
        conf.write_text(
            f'[agent]\nnode = "{node}"\ncluster = "{cluster}"\nslots = 1\nstate_dir = "{tmp_path}/state-{node}"\n'
            "state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 2.0\n"
            f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n[metrics]\nport = 0\n'
            "[latency]\nperiod = 0.5\n"
        )
        super().__init__(conf, tmp_path / f"{node}.log")


def _wait(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def _ping(client: RpcClient, node: str) -> bool:
    try:
        return client.call(node, {"op": "ping"}, timeout=3)["ok"] is True
    except RpcError:
        return False


@pytest.mark.broker
def test_the_messages_that_killed_agents_are_survived_by_real_agents(tmp_path: Path, mosquitto: Any,
                                                                     capsys: Any) -> None:
    """100k-deep JSON on rpc and latency ping, a ping {"o": ""}, a set {"event": "x"}, a forced
    scale of 3,000,000, and a neighbour's 100k-deep retained state (which once killed every agent
    that started after it): the agents answer afterwards, and fogctl status shows a row."""
    from agent.cli.fogctl import main as fogctl

    cluster = f"surv{os.getpid()}"
    admin = RpcClient(mosquitto.host, mosquitto.port, cluster, identity="adm").connect()
    a1 = _AgentProc(tmp_path, mosquitto, "n1", cluster)
    a2: Optional[_AgentProc] = None
    try:
        assert _wait(lambda: _ping(admin, "n1"), ONLINE_BOUND), a1.text()
        # the retained hostile state of a (fake) neighbour n9, before n2 starts
        admin.publish(topics.agent_state(cluster, "n9"), DEEP, retain=True)
        admin.publish(topics.agent_status(cluster, "n9"), b"online", retain=True)
        admin.publish(topics.agent_rpc(cluster, "n1", "adm"), DEEP)
        admin.publish(topics.latency_ping(cluster, "n1", "adm"), DEEP, qos=0)
        admin.publish(topics.latency_ping(cluster, "n1", "adm"), b'{"o": ""}', qos=0)
        # a retained request waits for n2's subscription (delivered with the retain flag)
        admin.publish(topics.agent_rpc(cluster, "n2", "adm"), b'{"op": "stop", "instance": "x"}', retain=True)
        reply = admin.call("n1", {"op": "set", "instance": "x", "fields": {"event": "x"}}, timeout=5)
        assert reply["ok"] is False and "reserved" in reply["error"]
        reply = admin.call("n1", {"v": 1, "op": "scale", "operator": "work", "delta": 3_000_000}, timeout=5)
        assert reply["ok"] is False and "more copies than the 1 slots" in reply["error"]
        a2 = _AgentProc(tmp_path, mosquitto, "n2", cluster)
        assert _wait(lambda: _ping(admin, "n2"), ONLINE_BOUND), a2.text()
        time.sleep(1.0)  # a latency round and a state period with the hostile records in
        assert _ping(admin, "n1") and _ping(admin, "n2")
        assert a1.proc.poll() is None and a2.proc.poll() is None
        log1 = a1.text()
        assert "ignoring state from n9" in log1 and "nested deeper" in log1
        assert "ignoring rpc request from adm" in log1 and "ignoring latency ping from adm" in log1
        assert "Traceback" not in log1
        log2 = a2.text()
        assert "ignoring state from n9" in log2 and "Traceback" not in log2
        assert f"ignoring a retained message on {topics.agent_rpc(cluster, 'n2', 'adm')}" in log2
        # fogctl status: n9 is a readable row saying its state is bad, not a traceback
        code = fogctl(["--broker", mosquitto.address, "--cluster", cluster, "--timeout", "5", "status"])
        out, err = capsys.readouterr()
        assert code == 0, err
        row = [line for line in out.splitlines() if line.split()[:1] == ["n9"]]
        assert row and "bad state" in row[0] and "nested deeper" in row[0], out
        assert "Traceback" not in out + err
    finally:
        admin.publish(topics.agent_state(cluster, "n9"), b"", retain=True)
        admin.publish(topics.agent_status(cluster, "n9"), b"", retain=True)
        admin.publish(topics.agent_rpc(cluster, "n2", "adm"), b"", retain=True)
        admin.close()
        codes = [a.stop() for a in (a1, a2) if a is not None]
    assert codes == [0, 0]


@pytest.mark.broker
def test_a_node_cannot_steer_another_through_its_peer_topic(tmp_path: Path, mosquitto: Any) -> None:
    """On the peer topic a real agent answers `stop`, `ping` and a spawn of a pipeline no admin
    deployed with a refusal on replies/<requester>/<me>, and starts nothing."""
    cluster = f"peer{os.getpid()}"
    admin = RpcClient(mosquitto.host, mosquitto.port, cluster, identity="adm").connect()
    intruder = RpcClient(mosquitto.host, mosquitto.port, cluster, identity="n3").connect()
    a1 = _AgentProc(tmp_path, mosquitto, "n1", cluster)
    try:
        assert _wait(lambda: _ping(admin, "n1"), ONLINE_BOUND), a1.text()
        spec = {"instance": "p.sink.0", "operator": "sink", "pipeline": "p", "pipeline_toml": PIPELINE}
        got: Dict[str, Dict[str, Any]] = {}
        for body in ({"op": "ping"}, {"op": "stop", "instance": "p.sink.0"}, {"op": "spawn", "spec": spec}):
            # what RpcClient.call does, on the peer topic instead of rpc (a reply counts only
            # with our correlation and from n1: agent.mqtt.requester)
            got[body["op"]] = intruder.request(topics.agent_peer(cluster, "n1", "n3"), body, timeout=10)
        assert len(got) == 3
        assert all(not r["ok"] and r["error"].startswith("refused") for r in got.values()), got
        assert admin.call("n1", {"op": "ping"}, timeout=5)["instances"] == []
        assert a1.text().count("from node n3") == 3
    finally:
        intruder.close()
        admin.close()
        code = a1.stop()
    assert code == 0


@pytest.mark.broker
def test_fogctl_views_read_hostile_retained_records_without_a_traceback(mosquitto: Any, capsys: Any) -> None:
    """status, topology, latency, locks, pipelines and why on a fleet whose retained records are
    100k deep, not JSON, or JSON of the wrong shape: a table (with the bad row marked) or one
    line, never a traceback."""
    from agent.cli.fogctl import main as fogctl

    cluster = f"views{os.getpid()}"
    records = {
        topics.agent_state(cluster, "n1"): json.dumps({"node": "n1", "slots": 2, "free_slots": 1, "instances": [
            {"id": "p.a.0", "operator": "a", "keeper": True, "status": "active", "lock": {"state": [1]},
             "stats": {"decisions": [{"at": "x"}, 5]}}]}).encode(),
        topics.agent_status(cluster, "n1"): b"online",
        topics.agent_state(cluster, "n9"): DEEP,
        topics.agent_status(cluster, "n9"): b'{"status": ' + b"[" * 1000,
        topics.latency(cluster, "n9"): b"{" * 100_000,
        topics.latency(cluster, "n1"): b'{"rtt_ms": {"n9": "fast"}, "emulated_ms": []}',
        topics.pipeline(cluster, "p"): b"operator = 5",
        topics.pipeline(cluster, "q"): b"a = " + b"[" * 100_000,
        topics.decisions(cluster, "p.a.0"): DEEP,
    }
    with RpcClient(mosquitto.host, mosquitto.port, cluster, identity="adm") as admin:
        for topic, payload in records.items():
            admin.publish(topic, payload, retain=True)
        try:
            base = ["--broker", mosquitto.address, "--cluster", cluster, "--timeout", "5"]
            for argv in (["status"], ["topology"], ["latency"], ["locks"], ["pipelines"], ["--json", "status"]):
                code = fogctl(base + argv)
                out, err = capsys.readouterr()
                assert code == 0 and "Traceback" not in out + err, (argv, out, err)
            code = fogctl(base + ["status"])
            out, _ = capsys.readouterr()
            assert "bad state" in next(line for line in out.splitlines() if line.startswith("n9"))
            code = fogctl(base + ["why", "p.a.0"])
            out, err = capsys.readouterr()
            assert code == 1 and len(err.strip().splitlines()) == 1 and "nested deeper" in err, err
        finally:
            for topic in records:
                admin.publish(topic, b"", retain=True)
