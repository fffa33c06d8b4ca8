"""Trust from authority (docs/security.md, "What a compromised node can still do"): a node with a
stolen key on the allow-list (here n3) against the rules that decide whom the agents believe.
Sans-IO: the agents are driven without a broker (tests/recording_client.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from agent import topics
from agent.config import SiteManagerSection, load_agent_config
from agent.node import rpc
from agent.node.site_driver import Hook, Publish, SiteDriver
from agent.node.site_manager import Lease
from recording_client import RecordingClient, message


def _agent(tmp_path: Path, node: str = "n1", extra_toml: str = "") -> Any:
    from agent.node.daemon import Agent

    conf = tmp_path / f"{node}.toml"
    conf.write_text(f'[agent]\nnode = "{node}"\ncluster = "c"\nstate_dir = "{tmp_path}/state-{node}"\n'
                    f'[mqtt]\nhost = "h"\nport = 1\n' + extra_toml)
    agent = Agent(load_agent_config(conf), warm_worker=False)
    agent.bus.client = RecordingClient()
    agent.bus.retained_in = True  # the sync marker is back: peer requests are handled at once
    return agent


def _deliver(agent: Any, topic: str, payload: Any, retain: bool = False) -> None:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    agent.core._on_message(message(topic, raw, retain), agent.clock())


def _replies(agent: Any, to: str) -> List[Dict[str, Any]]:
    return [json.loads(p) for p in agent.bus.client.on(topics.replies("c", to, agent.node))]


def _drain_from(agent: Any, sender: str) -> Dict[str, Any]:
    _deliver(agent, topics.agent_peer("c", agent.node, sender), rpc.encode({"op": "drain", "node": agent.node}))
    return _replies(agent, sender)[-1]


# ---- 2. the site manager's lease ------------------------------------------------------------------


def _records_in(agent: Any) -> None:
    """The sync marker comes back: the retained records of the agent's subscriptions are in."""
    agent.bus.marker = b"sync-marker"
    _deliver(agent, topics.replies("c", agent.node, agent.node), b"sync-marker")
    assert agent.bus.retained_in


def _claim(agent: Any, writer: str, node: str, until: float, **state: Any) -> None:
    """A record on `writer`'s own claim topic (the ACL lets only `writer` write it)."""
    _deliver(agent, topics.site_manager("c", writer), {"v": 1, "node": node, "until": until, "state": state}, True)


def test_a_forged_lease_far_ahead_is_refused_and_its_writer_cannot_drain(tmp_path: Path) -> None:
    """n3 writes {node: n3, until: now + 1e9} and drains n1 and n2 over the peer topic: both were
    `ok`. Now each reader refuses a lease further ahead of its own clock than its own lease plus
    three periods (at least 60 s), logs and counts it, and a drain is taken only from the leader
    the reader derives from the claims."""
    for node in ("n1", "n2"):
        agent = _agent(tmp_path, node)
        _deliver(agent, topics.agent_status("c", "n3"), b"online", True)
        _claim(agent, "n3", "n3", agent.wall() + 1e9)
        assert agent.core.counters["site_lease_refused"] == 1
        r = _drain_from(agent, "n3")
        assert r["ok"] is False and "not the site manager" in r["error"], r
        assert not agent.core.drain.draining


def test_a_claim_in_another_nodes_name_or_beside_a_running_lease_takes_nothing(tmp_path: Path) -> None:
    """A leader n2 holds a running lease. n3 writes, on its own topic, a record in n2's name
    (refused: a record counts only on its holder's topic), then its own plausible claim: the
    reader keeps following n2, and only n2 may drain it. n3 cannot clear or renew n2's record (the
    ACL: tests/test_security_tls_acl.py)."""
    agent = _agent(tmp_path)
    now = agent.wall()
    for n in ("n2", "n3"):
        _deliver(agent, topics.agent_status("c", n), b"online", True)
    _claim(agent, "n2", "n2", now + 15.0)
    assert _drain_from(agent, "n2")["ok"] is True and agent.core.drain.draining  # the reader follows n2 now
    agent.core.drain.draining = False
    _claim(agent, "n3", "n2", now + 15.0, released=["n1"])
    assert agent.core.counters["site_lease_refused"] == 1
    _claim(agent, "n3", "n3", now + 15.0)
    assert _drain_from(agent, "n3")["ok"] is False and not agent.core.drain.draining
    assert _drain_from(agent, "n2")["ok"] is True and agent.core.drain.draining


def test_a_leader_gone_offline_holds_nothing(tmp_path: Path) -> None:
    """The lease of a node whose retained status says offline is void (its Will; a revoked
    certificate cannot connect again): its drain is refused although its `until` runs, and the
    next claim is the lease. (The record alone decided before: a lease outlived its holder's
    certificate.)"""
    agent = _agent(tmp_path)
    now = agent.wall()
    _deliver(agent, topics.agent_status("c", "n3"), b"online", True)
    _claim(agent, "n3", "n3", now + 15.0)
    _deliver(agent, topics.agent_status("c", "n3"), b"offline", True)
    r = _drain_from(agent, "n3")
    assert r["ok"] is False and "not the site manager" in r["error"], r
    _deliver(agent, topics.agent_status("c", "n2"), b"online", True)
    _claim(agent, "n2", "n2", now + 15.0)
    assert _drain_from(agent, "n2")["ok"] is True and agent.core.drain.draining


def test_a_claim_beside_the_leaders_does_not_keep_a_restarted_agent_from_its_drains(tmp_path: Path) -> None:
    """n2 leads, n4 follows it; n3 claims beside n2. n1 just restarted: it saw two running claims
    and refused n2's drains ("none leads until one remains") until n3 stopped. Now n4's statement
    of whom it follows (on its own claim topic) is a vote: n1 follows n2, says so on its own
    topic, and refuses n3's drain. In three nodes (no n4) the votes tie: n1 follows none."""
    agent = _agent(tmp_path)
    agent.bus.retained_in = False  # the retained records of its subscriptions come in
    now = agent.wall()
    for n in ("n2", "n3", "n4"):
        _deliver(agent, topics.agent_status("c", n), b"online", True)
    _claim(agent, "n3", "n3", now + 15.0)
    _claim(agent, "n2", "n2", now + 15.0)
    _deliver(agent, topics.site_manager("c", "n4"), {"v": 1, "node": "n4", "until": 0, "follows": "n2"}, True)
    _records_in(agent)
    assert _drain_from(agent, "n3")["ok"] is False and not agent.core.drain.draining
    assert _drain_from(agent, "n2")["ok"] is True and agent.core.drain.draining
    stated = [json.loads(p) for p in agent.bus.client.on(topics.site_manager("c", "n1")) if p]
    assert stated and stated[-1] == {"v": 1, "node": "n1", "until": 0, "follows": "n2"}
    three = _agent(tmp_path, "n5")
    three.bus.retained_in = False
    for n in ("n2", "n3"):
        _deliver(three, topics.agent_status("c", n), b"online", True)
    _claim(three, "n2", "n2", now + 15.0)
    _claim(three, "n3", "n3", now + 15.0)
    _records_in(three)
    assert _drain_from(three, "n2")["ok"] is False and not three.core.drain.draining


def test_a_forged_lease_does_not_keep_a_candidate_from_the_role(tmp_path: Path) -> None:
    section = SiteManagerSection(enabled=True, period=5.0, lease=15.0)
    driver = SiteDriver(section, "n2", "c", stale_after=30.0)
    refused = driver.on_claim("n3", json.dumps({"v": 1, "node": "n3", "until": 1000.0 + 1e9}).encode(), 1000.0)
    assert refused and "ahead" in refused
    out = driver.tick(1000.0, {"n2": {"time": 1000.0, "slots": 2, "instances": []}}, {"n2": True, "n3": True})
    assert [type(e) for e in out] == [Publish] and json.loads(out[0].payload)["node"] == "n2"


def test_a_claim_beside_a_running_lease_does_not_make_the_leader_yield() -> None:
    """Two candidates that claim at once: the larger name yields within two periods and clears
    its record. n3 claiming (any name) beside a leader past that window: the leader keeps the
    role and decides on."""
    section = SiteManagerSection(enabled=True, period=5.0, lease=15.0)
    docs = {"n2": {"time": 1000.0, "slots": 2, "instances": []}}
    up = {"n1": True, "n2": True, "n3": True}
    raced = SiteDriver(section, "n2", "c", stale_after=30.0)
    assert json.loads(raced.tick(1000.0, docs, up)[0].payload)["node"] == "n2"
    raced.on_claim("n1", json.dumps({"v": 1, "node": "n1", "until": 1015.0}).encode(), 1000.0)
    out = raced.tick(1005.0, docs, up)
    assert out == [Publish("fog/c/agents/n2/site_manager", b"", True)] and not raced.leading
    assert raced.tick(1010.0, docs, up) == [] and raced.lease == Lease("n1", 1015.0)
    held = SiteDriver(section, "n2", "c", stale_after=30.0)
    for t in (1000.0, 1005.0, 1010.0):
        held.tick(t, docs, up)
    held.on_claim("n1", json.dumps({"v": 1, "node": "n1", "until": 1025.0}).encode(), 1011.0)
    out = held.tick(1015.0, docs, up)
    assert held.leading and json.loads(out[0].payload)["node"] == "n2"


def test_a_forged_released_list_never_reaches_the_power_hook(tmp_path: Path) -> None:
    """n3 leaves a record whose `released` list names argv for the acquire hook ("--force", a
    path, a name no node has) and lets it run out; the next leader n2 inherits the list and, spare
    below target, acquires: the hook gets only a node name this agent knows from an ACL-proven
    topic level (here none of those), never a payload's string."""
    section = SiteManagerSection(enabled=True, target=0.5, period=5.0, lease=15.0, cooldown=0.0,
                                 acquire_hook=("/usr/local/sbin/fog-node-power", "on"),
                                 release_hook=("/usr/local/sbin/fog-node-power", "off"))
    driver = SiteDriver(section, "n2", "c", stale_after=30.0)
    forged = {"v": 1, "node": "n3", "until": 1004.0,
              "state": {"released": ["--force", "/etc/passwd", "n9", "n1"]}}
    driver.on_claim("n3", json.dumps(forged).encode(), 1000.0)
    assert driver.board.current({"n3": True}, 1000.0) is not None  # n2 followed n3 while it led
    busy = [{"id": f"p.op{i}.0", "operator": f"op{i}", "capacity": 100.0, "load": 95.0} for i in range(2)]
    hooks: List[Any] = []
    for i in range(4):
        now = 1000.0 + 5.0 * i
        docs = {"n2": {"time": now, "slots": 2, "free_slots": 0, "instances": busy},
                "n1": {"time": now, "slots": 2, "free_slots": 0, "instances": busy}}
        hooks += [e for e in driver.tick(now, docs, {"n1": False, "n2": True}) if isinstance(e, Hook)]
    args = [h.argv[-1] for h in hooks]
    assert "--force" not in args and "/etc/passwd" not in args and "n9" not in args, args
    assert args == ["n1"], args  # n1: a node this agent knows (its state topic), released by the record


def test_a_released_list_comes_only_from_a_leaders_own_record(tmp_path: Path) -> None:
    """n3 writes a record naming the leader n1, with a `released` list naming n4, on its own topic
    (refused), and a claim of its own that n2 never follows (n1's lease runs, then n3 is offline
    too). n1 goes away; the next leader n2 inherits the list of n1's own record (empty), not n3's:
    no acquire hook for n4 (a later leader adopted a forged list before)."""
    section = SiteManagerSection(enabled=True, target=0.5, period=5.0, lease=15.0, cooldown=0.0,
                                 acquire_hook=("/usr/local/sbin/fog-node-power", "on"))
    driver = SiteDriver(section, "n2", "c", stale_after=30.0)
    up = {"n1": True, "n2": True, "n3": True, "n4": False}
    driver.on_claim("n1", json.dumps({"v": 1, "node": "n1", "until": 1014.0, "state": {"released": []}}).encode(), 1000.0)
    assert driver.tick(1000.0, {}, up) == [] and driver.lease is not None and driver.lease.node == "n1"
    assert driver.on_claim("n3", json.dumps({"v": 1, "node": "n1", "until": 1014.0,
                                             "state": {"released": ["n4"]}}).encode(), 1001.0)
    driver.on_claim("n3", json.dumps({"v": 1, "node": "n3", "until": 1030.0, "state": {"released": ["n4"]}}).encode(), 1001.0)
    busy = [{"id": f"p.op{i}.0", "operator": f"op{i}", "capacity": 100.0, "load": 95.0} for i in range(2)]
    hooks: List[Any] = []
    for i in range(1, 5):
        now = 1010.0 + 5.0 * i
        docs = {n: {"time": now, "slots": 2, "free_slots": 0, "instances": busy} for n in ("n2", "n4")}
        hooks += [e for e in driver.tick(now, docs, dict(up, n1=False, n3=False)) if isinstance(e, Hook)]
    assert driver.leading and driver.state.released == () and hooks == [], (driver.state, hooks)


# ---- 3. confused deputy: peer spawns run what an admin deployed -----------------------------------

SAFE = """
[pipeline]
name = "taxi"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def _spy(topic: str, name: str = "spy", first: str = "source") -> str:
    """n3's pipeline: read n2's admin requests, hand them on where n3 reads."""
    return f"""
[pipeline]
name = "{name}"
[[operator]]
name = "{first}"
kind = "source"
function = "agent.operators.taxi:mqtt_source"
params = {{ topic = "{topic}" }}
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:mqtt_sink"
params = {{ topic = "fog/c/events" }}
"""


def _spawn_spec(pipeline: str, text: str, operator: str = "source", instance: str = "x-1") -> Dict[str, Any]:
    return {"instance": instance, "operator": operator, "pipeline": pipeline, "pipeline_toml": text,
            "succs": [], "preds": [], "keeper": False, "active": True, "restart": False, "extra": {}}


def _n2_knowing_n3_and_a_deploy(tmp_path: Path) -> Any:
    from agent.control.records import stamp

    agent = _agent(tmp_path, "n2")
    started: List[Any] = []
    agent.supervisor.start = lambda spec, now: started.append(spec)  # type: ignore[method-assign]
    agent.started = started
    _deliver(agent, topics.pipeline("c", "taxi"), stamp(SAFE, "g1").encode(), True)
    hosted = [dict(_spawn_spec("spy", _spy("fog/c/agents/n2/rpc/+")), node="n3", cluster="c")]
    _deliver(agent, topics.agent_hosted("c", "n3"), hosted, True)
    _deliver(agent, topics.agent_status("c", "n3"), b"online", True)
    return agent


def _peer_spawn(agent: Any, sender: str, spec: Dict[str, Any]) -> Dict[str, Any]:
    _deliver(agent, topics.agent_peer("c", agent.node, sender), rpc.encode({"op": "spawn", "spec": spec}))
    return _replies(agent, sender)[-1] if _replies(agent, sender) else {}


def test_a_peer_spawn_of_a_pipeline_only_the_requester_hosts_is_refused(tmp_path: Path) -> None:
    """n3 lists its own pipeline (mqtt_source on n2's rpc topic -> mqtt_sink on events) in its
    hosted record and asks n2 to run it: accepted before (the requester "hosts" it), so n3 read
    the admins' requests to n2. Only a pipeline an admin deployed is accepted now."""
    agent = _n2_knowing_n3_and_a_deploy(tmp_path)
    r = _peer_spawn(agent, "n3", _spawn_spec("spy", _spy("fog/c/agents/n2/rpc/+")))
    assert r.get("ok") is False and "not deployed" in r["error"], r
    assert agent.started == [] and agent.core.counters["peer_refused"] == 1


def test_a_peer_spawn_runs_the_admins_text_never_the_requesters(tmp_path: Path) -> None:
    """n3 names the deployed pipeline `taxi` but sends its own text for it (its operator
    `source` an mqtt_source on a topic of its choosing): refused, nothing started (it started
    with n3's text before). A spec without a text gets the admin's."""
    agent = _n2_knowing_n3_and_a_deploy(tmp_path)
    r = _peer_spawn(agent, "n3", _spawn_spec("taxi", _spy("lab/in", name="taxi"), instance="source-x"))
    assert r.get("ok") is False and "not the one an admin deployed" in r["error"], r
    assert agent.started == []
    without = {k: v for k, v in _spawn_spec("taxi", "", instance="source-y").items() if k != "pipeline_toml"}
    _peer_spawn(agent, "n3", without)
    assert [s.pipeline_toml for s in agent.started] == [SAFE], [s.pipeline_toml for s in agent.started]


def test_mqtt_operators_on_the_fleets_own_topics_are_refused_at_admission(tmp_path: Path) -> None:
    """Even an admin's spawn: an mqtt_source or mqtt_sink whose topic reaches fog/..., agents/...,
    $SYS or starts with a wildcard is refused, naming the param; a site topic passes."""
    agent = _n2_knowing_n3_and_a_deploy(tmp_path)
    for topic in ("fog/c/agents/n2/rpc/+", "agents/n2/rpc/+", "$SYS/#", "#", "+/c/events"):
        _deliver(agent, topics.agent_rpc("c", "n2", "adm"),
                 rpc.encode({"op": "spawn", "spec": _spawn_spec("spy", _spy(topic, name="spy"))}))
        r = _replies(agent, "adm")[-1]
        assert r["ok"] is False and "params.topic" in r["error"], (topic, r)
    sink_only = _spy("lab/in").replace("fog/c/events", "fog/c/agents/n2/state")
    _deliver(agent, topics.agent_rpc("c", "n2", "adm"),
             rpc.encode({"op": "spawn", "spec": _spawn_spec("spy", sink_only, operator="sink", instance="sink-1")}))
    assert _replies(agent, "adm")[-1]["ok"] is False and agent.started == []
    _deliver(agent, topics.agent_rpc("c", "n2", "adm"),
             rpc.encode({"op": "spawn", "spec": _spawn_spec("lab", _spy("lab/sensors/+", name="lab").replace(
                 "fog/c/events", "lab/out"))}))
    assert [s.pipeline for s in agent.started] == ["lab"]


# ---- 4. bindings and epochs -----------------------------------------------------------------------


def test_a_fresh_agent_does_not_bind_an_instance_to_a_claimer_with_a_later_rehomed_entry() -> None:
    """r hosts w; h lists it too and writes a re-homed entry later than anybody's. An agent that
    just started bound w to h (the latest re-homed entry won); now a claim binds nothing while
    another claims too, and a statement of another node (here the one that moved it) decides."""
    from agent.node.hostmap import HostMap

    m = HostMap("me")
    hosted = {"r": [("w", "p")], "h": [("w", "p")]}
    m.update({}, hosted, {"r": True, "h": True}, {"h": {"w": 9e9}})
    assert m.bound("w") != "h"
    assert m.bound("w") is None and m.pending("w") == ("h", "r")
    m.update({}, hosted, {"r": True, "h": True, "a": True}, {"h": {"w": 9e9}}, {"a": {"w": "r"}, "h": {"w": "h"}})
    assert m.bound("w") == "r"


def test_a_binding_taken_without_a_word_goes_where_the_rehomer_says_once_it_does() -> None:
    """a hosts w and dies; h, the only online node listing w, gets the binding without a
    statement (a claim); the re-homer c then places w on d and says so: the binding goes to d
    (it stayed with h before: h still listed it and was online), and while it was h's it was
    marked unproven for the workers."""
    from agent.node.hostmap import HostMap

    m = HostMap("me")
    up = {"a": True, "c": True, "d": True, "h": True}
    m.update({}, {"a": [("w", "p")]}, up)
    down = dict(up, a=False)
    m.update({}, {"a": [("w", "p")], "h": [("w", "p")]}, down, {"h": {"w": 9e9}})  # its own entry: a claim
    assert m.bound("w") == "h" and m.table("p").get("unproven") == ["w"]
    m.update({}, {"a": [("w", "p")], "h": [("w", "p")], "d": [("w", "p")]}, down, None, {"c": {"w": "d"}})
    assert m.bound("w") == "d" and "unproven" not in m.table("p")
    # a re-home: the re-homer's statement proves it (kept over its restart: the daemon test below)
    m2 = HostMap("me")
    m2.update({}, {"a": [("w", "p")]}, up)
    m2.update({}, {"a": [("w", "p")], "d": [("w", "p")]}, down, {"c": {"w": 5.0}}, {"c": {"w": "d"}})
    assert m2.bound("w") == "d" and "unproven" not in m2.table("p")


def test_the_only_claimer_of_a_dead_nodes_instance_stays_unproven_beside_an_earlier_rehomed_entry() -> None:
    """c re-homed w onto a once (its retained re-homed record still names w); a dies and h, the
    only online node listing w, claims it before c re-homes it again. h got a proven binding
    (another node's re-homed entry), sticky: c's statement that w went to d moved nothing, and h
    read and wrote w's channel. Now only a statement naming h would prove it: h is unproven,
    and the binding goes to d once c says so; a fresh agent binds h unproven too."""
    from agent.node.hostmap import HostMap

    up = {"a": True, "c": True, "d": True, "h": True}
    down = dict(up, a=False)
    earlier = {"c": {"w": 5.0}}  # c re-homed w onto a, long ago
    m = HostMap("me")
    m.update({}, {"a": [("w", "p")]}, up, earlier, {"c": {"w": "a"}})
    assert m.bound("w") == "a" and m.proven("w")
    m.update({}, {"a": [("w", "p")], "h": [("w", "p")]}, down, earlier, {"c": {"w": "a"}})
    assert m.bound("w") == "h" and not m.proven("w")
    m.update({}, {"a": [("w", "p")], "h": [("w", "p")], "d": [("w", "p")]}, down, earlier, {"c": {"w": "d"}})
    assert m.bound("w") == "d" and m.proven("w") and m.pending("w") == ("a", "h")
    fresh = HostMap("me")
    fresh.update({}, {"a": [("w", "p")], "h": [("w", "p")]}, down, earlier)
    assert fresh.bound("w") == "h" and not fresh.proven("w")


def test_the_rehomers_statements_are_kept_over_its_restart(tmp_path: Path) -> None:
    """A re-homer that restarted forgot where it had moved instances: the one claimer it placed
    an instance on was proven only by its re-homed record, which proves nothing now. Its
    statements live in its state directory and come back with it."""
    a = _agent(tmp_path, "c")
    a.core._stated_move("w", "d")
    again = _agent(tmp_path, "c")
    assert again.core.hosts.moved_statements(again.supervisor) == {"w": "d"}
    assert again.core.state_doc().get("moved") == {"w": "d"}


def test_an_epoch_past_the_receivers_clock_is_refused_whatever_the_known_one() -> None:
    """A forged epoch of the wall clock + 500 s passed (both bounds had to be exceeded: 1000 above
    the known one and 600 s past the clock), was persisted, and the real sender was "old" for
    good once the forger stopped."""
    from agent.dataplane.inbound import MAX_CLOCK_AHEAD, numbering_fault

    wall = 1_795_000_000.0
    real = (int(wall) - 30, 40, False)  # the real sender, re-homed 30 s ago
    assert numbering_fault(real, False, int(wall + 500), 1, wall, 8) == "epoch"
    assert numbering_fault(None, False, int(wall + 500), 1, wall, 8) == "epoch"
    assert MAX_CLOCK_AHEAD <= 60
    assert numbering_fault(real, False, int(wall + MAX_CLOCK_AHEAD), 1, wall, 8) is None
    assert numbering_fault(real, False, real[0] + 1, 1, wall, 8) is None  # a restart
    # a receiver whose clock is behind the sender's (booted without a real-time clock): restarts
    assert numbering_fault(real, False, real[0] + 3, 1, wall - 3600, 8) is None


def test_a_sender_bound_without_proof_does_not_set_its_epoch(tmp_path: Path) -> None:
    """The sink's agent bound work-0 to h without a statement (h the only online claimer); h
    writes in work-0's name with a new epoch. Taken, that epoch was persisted and work-0's real
    batches (node n1, its binding back) were dropped as old for good. Now it waits, unproven, is
    refused, and the real stream goes on."""
    from agent.instance.admission import WRITER_HOLD_TTL
    from test_security_dataplane import _records, _run
    from test_security_sender import _sink
    from agent.dataplane.envelope import encode_data
    from agent.instance.events import Control
    from agent.mqtt.transport import Received

    clock = [100.0]
    w, wire = _sink(tmp_path, clock)
    real, forged_by = topics.inbox("c", "sink-0", "n1"), topics.inbox("c", "sink-0", "h")
    w.feed(Control({"event": "hosts", "bound": {"work-0": "n1", "sink-0": "n2"}}), clock[0])
    wire.events.append(Received(real, encode_data("work-0", 0, 1, _records(0, 4))))
    _run(w, clock, 0.3)
    assert w.core.stats["records_in"] == 4
    w.feed(Control({"event": "hosts", "bound": {"work-0": "h", "sink-0": "n2"}, "unproven": ["work-0"]}), clock[0])
    wire.events.append(Received(forged_by, encode_data("work-0", 5, 1, _records(100, 4))))
    _run(w, clock, 0.3)
    assert w.core.inbound.position("work-0")[0] == 0 and w.core.stats["records_in"] == 4
    w.feed(Control({"event": "hosts", "bound": {"work-0": "n1", "sink-0": "n2"}}), clock[0])  # h withdrew
    wire.events.append(Received(real, encode_data("work-0", 0, 2, _records(4, 4))))
    _run(w, clock, WRITER_HOLD_TTL + 1.0, step=0.5)
    assert w.core.stats["records_in"] == 8 and w.core.inbound.position("work-0")[0] == 0
    assert w.core.stats["refused_nodes"] == 1
    state = json.loads((tmp_path / "state" / "sink-0.state.json").read_text())
    assert '"epoch": 5' not in json.dumps(state)


# ---- what an agent keeps over its restart ---------------------------------------------------------


def test_a_restarted_agent_keeps_a_never_moved_instance_bound_to_its_node_beside_a_claimer() -> None:
    """r hosts w (never moved: no statement names anybody); h lists it too. An agent that
    restarted saw two equal claimers and bound w to nobody for as long as h listed it (w's
    envelopes waited, then were refused: a stall). Its proven bindings now come back with it."""
    from agent.node.hostmap import HostMap

    before = HostMap("me")
    before.update({}, {"r": [("w", "p", "g1")]}, {"r": True})
    assert before.bound("w") == "r"
    saved = json.loads(json.dumps(before.saved()))  # through the file
    hosted = {"r": [("w", "p", "g1")], "h": [("w", "p", "g1")]}
    fresh = HostMap("me")
    fresh.update({}, hosted, {"r": True, "h": True})
    assert fresh.bound("w") is None  # a brand-new agent: still no binding (docs/security.md)
    again = HostMap("me")
    assert again.restore(saved) == 1
    again.update({}, hosted, {"r": True, "h": True})
    assert again.bound("w") == "r" and again.proven("w") and again.pending("w") == ("h",)
    # the instance moved while the agent was away: who moved it says where, as for a running agent
    again.update({}, {"h": [("w", "p", "g1")], "d": [("w", "p", "g1")]}, {"r": True, "h": True, "d": True},
                 None, {"r": {"w": "d"}})
    assert again.bound("w") == "d"


def test_only_proven_bindings_to_other_nodes_are_kept() -> None:
    from agent.node.hostmap import HostMap

    m = HostMap("me")
    up = {"a": True, "h": True}
    m.update({"mine": "p"}, {"a": [("w", "p"), ("v", "p")]}, up)
    m.update({"mine": "p"}, {"a": [("v", "p")], "h": [("w", "p")]}, up)  # w: one claimer, no word
    assert m.bound("w") == "h" and not m.proven("w")
    assert m.saved() == {"v": 1, "bound": [["v", "a", "p", ""]]}
    for bad in (None, [], {"v": 2, "bound": [["x", "a", "p", ""]]}, {"v": 1, "bound": [["x", "me", "p", ""], ["y"], [1, 2, 3, 4]]}):
        assert HostMap("me").restore(bad) == 0


def test_the_agent_keeps_its_bindings_and_the_leader_it_follows_in_its_state_dir(tmp_path: Path) -> None:
    """n1 follows n2 in a fleet of three and knows w runs on r. It restarts; n3 then claims the
    site manager beside n2 and lists w. Before, the restarted n1 followed nobody (n2 and n3
    tied: n2's drains refused) and bound w to nobody; now it follows n2 and keeps w on r."""
    agent = _agent(tmp_path)
    agent.bus.retained_in = False
    now = agent.wall()
    for n in ("n2", "n3", "r"):
        _deliver(agent, topics.agent_status("c", n), b"online", True)
    _claim(agent, "n2", "n2", now + 15.0)
    _records_in(agent)
    assert agent.core.site_leases.held == "n2"
    agent.core.hosts.hostmap.update({}, {"r": [("w", "p", "g1")]}, agent.core.view.online)
    agent.core._save_bindings()

    again = _agent(tmp_path)
    again.bus.retained_in = False
    for n in ("n2", "n3", "r"):
        _deliver(again, topics.agent_status("c", n), b"online", True)
    _claim(again, "n3", "n3", now + 15.0)
    _claim(again, "n2", "n2", now + 15.0)
    _records_in(again)
    assert _drain_from(again, "n3")["ok"] is False and not again.core.drain.draining
    again.core.hosts.hostmap.update({}, {"r": [("w", "p", "g1")], "n3": [("w", "p", "g1")]}, again.core.view.online)
    assert again.core.hosts.hostmap.bound("w") == "r"
    assert _drain_from(again, "n2")["ok"] is True and again.core.drain.draining


def test_a_peer_spawn_of_an_instance_running_on_another_online_node_is_refused(tmp_path: Path) -> None:
    """n3 asks n2 to start `source-0` of the deployed pipeline, which runs on r (online, listing
    it): a clone, the same identity on two nodes (it started before). r itself may move it (a
    hand-over), and once r is offline a re-home may start it; a new identity (a copy) starts."""
    agent = _n2_knowing_n3_and_a_deploy(tmp_path)
    _deliver(agent, topics.agent_status("c", "r"), b"online", True)
    _deliver(agent, topics.agent_hosted("c", "r"), [dict(_spawn_spec("taxi", SAFE, instance="source-0"),
                                                         node="r", cluster="c")], True)
    agent.core._sync_hosts()
    assert agent.core.hosts.hostmap.bound("source-0") == "r"
    r = _peer_spawn(agent, "n3", _spawn_spec("taxi", SAFE, instance="source-0"))
    assert r.get("ok") is False and "runs on r (online)" in r["error"], r
    assert agent.started == []
    _peer_spawn(agent, "n3", _spawn_spec("taxi", SAFE, instance="source-0.1"))
    _peer_spawn(agent, "r", _spawn_spec("taxi", SAFE, instance="source-0"))
    assert [s.instance for s in agent.started] == ["source-0.1", "source-0"]
    _deliver(agent, topics.agent_status("c", "r"), b"offline", True)
    _peer_spawn(agent, "n3", _spawn_spec("taxi", SAFE, instance="source-0"))
    assert [s.instance for s in agent.started][-1] == "source-0"


# ---- placement bounded by what the admin gave each node ------------------------------------------


def _liar_state(node: str = "n3") -> Dict[str, Any]:
    return {"version": 1, "node": node, "time": 1.0, "cpu": 0.0, "memory": 0.0, "slots": 1000,
            "free_slots": 1000, "instances": [{"id": "x-1"}]}


def test_a_node_claiming_more_free_slots_than_the_admin_gave_it_is_not_every_placements_first_choice(
        tmp_path: Path) -> None:
    """n3 says it has 1,000 free slots: every createNode() (and a deploy's keepers) went to it
    first. With [security] node_slots each agent takes at most what the admin gave it, less the
    instances it lists: n3 (2 slots, 1 listed) offers 1, n2 (4, none) 4, so n2 ranks first."""
    agent = _agent(tmp_path, "n1", '[security]\nnode_slots = { n2 = 4, n3 = 2 }\n')
    for node, doc in (("n3", _liar_state()), ("n2", dict(_liar_state("n2"), slots=4, free_slots=4, instances=[]))):
        _deliver(agent, topics.agent_state("c", node), doc, True)
        _deliver(agent, topics.agent_status("c", node), b"online", True)
    views = {v.node: v for v in agent.core.creating.views()}
    assert (views["n3"].slots, views["n3"].free_slots) == (2, 1) and views["n2"].free_slots == 4
    assert agent.core.creating.fleet_slots() == 2 + 4 + agent.cfg.agent.slots
    unbounded = _agent(tmp_path, "n4")
    for node, doc in (("n3", _liar_state()),):
        _deliver(unbounded, topics.agent_state("c", node), doc, True)
        _deliver(unbounded, topics.agent_status("c", node), b"online", True)
    assert {v.node: v.free_slots for v in unbounded.core.creating.views()}["n3"] == 1000  # not listed: its word


def test_a_deploy_offers_a_node_no_more_than_its_slots_in_the_table() -> None:
    from agent.node.deploy import fleet_from_snapshot

    states = {topics.agent_state("c", "n3"): json.dumps(_liar_state()).encode()}
    statuses = {topics.agent_status("c", "n3"): b"online"}
    assert [v.free_slots for v in fleet_from_snapshot(states, statuses)] == [1000]
    assert [(v.slots, v.free_slots) for v in fleet_from_snapshot(states, statuses, {"n3": 1})] == [(1, 0)]


def test_node_slots_must_be_whole_numbers(tmp_path: Path) -> None:
    import pytest

    from agent.schema import ConfigError

    for bad in ('{ n2 = -1 }', '{ n2 = "4" }', '{ n2 = true }', '[4]'):
        conf = tmp_path / "bad.toml"
        conf.write_text(f'[agent]\nnode = "n1"\n[security]\nnode_slots = {bad}\n')
        with pytest.raises(ConfigError) as err:
            load_agent_config(conf)
        assert "bad.toml" in str(err.value) and "node_slots" in str(err.value), str(err.value)


def test_fogctl_deploys_with_the_node_slots_of_its_settings_or_of_an_agent_toml(tmp_path: Path) -> None:
    from agent.fogctl.config import load_config

    conf = tmp_path / "n1.toml"
    conf.write_text('[agent]\nnode = "n1"\n[security]\nnode_slots = { n3 = 2 }\n')
    assert load_config(agent_config=conf, env={}).node_slots == {"n3": 2}
    own = tmp_path / "fogctl.toml"
    own.write_text('node_slots = { n3 = 1 }\n')
    assert load_config(env={}, path=own).node_slots == {"n3": 1}


def test_a_node_back_after_its_instances_were_rehomed_binds_them_where_the_rehomer_of_its_absence_says() -> None:
    """n1 (in_zone's node) is lost, n2 (the lowest online node then) re-homes in_zone onto itself
    and says so. n1 comes back: its fresh agent binds in_zone to n1 from its own stale record, then,
    once it forgets in_zone, to n2; n2 is no longer the lowest online node, and were its statement
    no longer to count, that binding would stay unproven for good and the copies n1 then starts
    would hold and refuse in_zone's envelopes ("not bound to node n2 within 20s"; CHANGELOG.md, "A
    node lost while key groups moved left its re-homed keyed window stalled"). The lowest online
    node besides the instance's old node (the one that re-homed it) vouches; a statement of any
    other node still does not."""
    from agent.node.hostmap import HostMap

    up = {"n1": True, "n2": True, "n3": True}
    m = HostMap("n1")
    m.update({}, {"n1": [("in_zone", "p")]}, {})  # n1's own stale record, nothing else known yet
    assert m.bound("in_zone") == "n1"
    m.update({}, {"n1": [("in_zone", "p")], "n2": [("in_zone", "p")]}, up, None, {"n2": {"in_zone": "n2"}})
    m.update({}, {"n1": [], "n2": [("in_zone", "p")]}, up, None, {"n2": {"in_zone": "n2"}})
    assert m.bound("in_zone") == "n2" and m.proven("in_zone") and "unproven" not in m.table("p")
    # n3 is not the lowest online node besides n1: its word proves nothing
    h = HostMap("n1")
    h.update({}, {"n1": [("in_zone", "p")]}, {})
    h.update({}, {"n1": [], "n3": [("in_zone", "p")]}, up, None, {"n3": {"in_zone": "n3"}})
    assert h.bound("in_zone") == "n3" and not h.proven("in_zone")
