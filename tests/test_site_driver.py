"""The site manager's driver (agent.node.site_driver): what a new leader sends, in which order."""

from __future__ import annotations

import json
from typing import Any, Dict

from agent.config import SiteManagerSection
from agent.node.site_driver import Emit, Publish, SiteDriver, Steer
from recording_client import RecordingClient, message


def docs(now: float) -> Dict[str, Dict[str, Any]]:
    """n1 (3 slots, full, loaded) can go: without it the spare stays above the target; n2 (12
    free slots) cannot."""
    busy = [{"id": f"p.op{i}.0", "operator": f"op{i}", "capacity": 500.0, "load": 100.0} for i in range(3)]
    return {"n1": {"time": now, "slots": 3, "free_slots": 0, "instances": busy},
            "n2": {"time": now, "slots": 12, "free_slots": 12, "instances": []}}


def test_a_new_leader_publishes_its_lease_before_it_steers_any_node() -> None:
    """The agents accept a drain only from the holder of the lease they have received (daemon
    `Gate.peer_may_steer`): a new leader's first period publishes its record and orders nothing; from
    the next period on the record still goes out before the period's requests. (The drain used
    to leave with the first record and arrive first: refused, and the manager then waited its
    whole `timeout` for a drain that never started.)"""
    section = SiteManagerSection(enabled=True, target=0.88, min_nodes=1, max_nodes=2, cooldown=1.0,
                                 timeout=60.0, period=0.5, lease=4.0)
    driver = SiteDriver(section, "n2", "c", stale_after=5.0)
    online = {"n1": True, "n2": True}
    first = driver.tick(1000.0, docs(1000.0), online)
    assert [type(e) for e in first] == [Publish], first
    record = json.loads(first[0].payload)
    assert record["node"] == "n2" and record["until"] == 1004.0 and first[0].retain
    assert first[0].topic == "fog/c/agents/n2/site_manager"
    driver.on_claim("n2", first[0].payload, 1000.0)  # the broker's retained copy comes back
    second = driver.tick(1000.5, docs(1000.5), online)
    assert [type(e) for e in second] == [Publish, Emit, Steer], second
    assert second[2].node == "n1" and second[2].body["op"] == "drain"


class Connected:
    """An agent (agent.node.daemon.Agent) connected to no broker (tests/recording_client.py);
    `marker` is the sync marker it published after subscribing."""

    def __init__(self, tmp_path: Any, extra_toml: str = "") -> None:
        from agent import topics
        from agent.config import load_agent_config
        from agent.node import loopevents
        from agent.node.daemon import Agent

        conf = tmp_path / "a.toml"
        conf.write_text(f'[agent]\nnode = "n1"\ncluster = "c"\nstate_dir = "{tmp_path}"\n[mqtt]\nhost = "h"\nport = 1\n'
                        + extra_toml)
        self.agent = Agent(load_agent_config(conf), warm_worker=False)
        self.client = self.agent.bus.client = RecordingClient()
        self.agent._on_connack(loopevents.Connected(True, "Success", False), 0.0)  # as paho's CONNACK
        markers = self.client.on(topics.replies("c", "n1", "n1"))
        assert len(markers) == 1, self.client.sent
        self.marker = markers[0]
        self.on = self.client.on

    def deliver(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.agent.core._on_message(message(topic, payload, retain), self.agent.clock())


def test_an_agent_claims_the_role_only_once_the_retained_lease_could_have_arrived(tmp_path) -> None:
    """The daemon runs the site manager's period only after the broker echoed the sync marker it
    published after subscribing: the broker sends the retained lease before that echo. (Ticking
    at connect, before the lease arrived, let an agent take the role from a live leader; CI saw
    n1 replace an unexpired lease of n9.)"""
    from agent import topics

    c = Connected(tmp_path, "[site_manager]\nenabled = true\nperiod = 0.5\nlease = 4.0\n")
    agent, lease_topic = c.agent, topics.site_manager("c", "n1")
    agent._periodic(agent.clock())
    assert not c.on(lease_topic), "claimed the role before the retained lease could arrive"
    n9 = {"v": 1, "node": "n9", "until": agent.wall() + 30.0}
    c.deliver(topics.agent_status("c", "n9"), b"online", True)
    c.deliver(topics.site_manager("c", "n9"), json.dumps(n9).encode(), True)
    c.deliver(topics.replies("c", "n1", "n1"), c.marker)
    agent._periodic(agent.clock())
    # what n1 writes there now is its statement that it follows n9 (docs/site-manager.md), no claim
    assert not [p for p in c.on(lease_topic) if "follows" not in json.loads(p)], "took an unexpired lease of n9"
    assert json.loads(c.on(lease_topic)[-1])["follows"] == "n9"
    # n9 lets go: its own record, run out (only n9 can write it: the ACL)
    c.deliver(topics.site_manager("c", "n9"), json.dumps(dict(n9, until=agent.wall() - 1.0)).encode(), True)
    agent.site.last_tick -= 1.0  # a period (0.5 s, on the wall clock) has passed
    agent._periodic(agent.clock())
    claims = [json.loads(p) for p in c.on(lease_topic) if "follows" not in json.loads(p)]
    assert [c["node"] for c in claims] == ["n1"], claims


def test_a_drain_queued_while_the_agent_was_away_waits_for_the_retained_lease(tmp_path) -> None:
    """A persistent session hands the agent what was queued for it while it was away at connect,
    before the retained records of its subscriptions. A drain from the site manager n9 that comes
    before n9's retained lease is checked once the sync marker is back, against that lease:
    accepted. (Checked at arrival it was refused: "n9 is not the site manager".) A drain from a node
    that holds no lease is still refused."""
    from agent import topics
    from agent.node import rpc

    c = Connected(tmp_path)

    def replies_to(node: str) -> list:
        return [json.loads(p) for p in c.on(topics.replies("c", node, "n1"))]

    drain = rpc.encode({"op": "drain", "node": "n1"})
    c.deliver(topics.agent_peer("c", "n1", "n9"), drain)  # queued while n1 was away
    c.deliver(topics.agent_peer("c", "n1", "n7"), drain)
    assert replies_to("n9") == [] and not c.agent.core.drain.draining, "checked before the retained lease could arrive"
    lease = {"v": 1, "node": "n9", "until": c.agent.wall() + 30.0}
    c.deliver(topics.agent_status("c", "n9"), b"online", True)
    c.deliver(topics.site_manager("c", "n9"), json.dumps(lease).encode(), True)
    c.deliver(topics.replies("c", "n1", "n1"), c.marker)
    assert [r["ok"] for r in replies_to("n9")] == [True] and c.agent.core.drain.draining, replies_to("n9")
    assert [r["ok"] for r in replies_to("n7")] == [False] and "not the site manager" in replies_to("n7")[0]["error"]


def test_a_held_request_that_fails_strands_none_behind_it(tmp_path) -> None:
    """Held peer requests are handled one by one when the sync marker comes back, each as a
    message of its own: one whose handling fails is counted and logged, and the next is still
    answered (handled inside the marker's own message, the failure ended the replay and left the
    rest held with nothing left to release them)."""
    from agent import topics
    from agent.node import rpc

    c = Connected(tmp_path)
    steer = c.agent.core.gate.peer_may_steer
    calls = []

    def failing_once(now: float, requester: str, facts: Any) -> Any:
        calls.append(requester)
        if len(calls) == 1:
            raise RuntimeError("a failure no handler foresaw")
        return steer(now, requester, facts)

    c.agent.core.gate.peer_may_steer = failing_once  # type: ignore[method-assign]
    drain = rpc.encode({"op": "drain", "node": "n1"})
    c.deliver(topics.agent_peer("c", "n1", "n9"), drain)
    c.deliver(topics.agent_peer("c", "n1", "n9"), drain)
    lease = {"v": 1, "node": "n9", "until": c.agent.wall() + 30.0}
    c.deliver(topics.agent_status("c", "n9"), b"online", True)
    c.deliver(topics.site_manager("c", "n9"), json.dumps(lease).encode(), True)
    c.agent.core._on_message_safely(message(topics.replies("c", "n1", "n1"), c.marker), c.agent.clock())
    assert calls == ["n9", "n9"] and c.agent.core.counters["bad_messages"] == 1
    assert [json.loads(p)["ok"] for p in c.on(topics.replies("c", "n9", "n1"))] == [True] and c.agent.core.drain.draining


def test_a_leader_that_lost_its_connection_or_restarted_clears_its_claim_for_the_new_leader() -> None:
    """Its Will said offline, which voided its lease for every reader, and n1 took the role
    (a kill -9 closes the socket: the Will comes at once). Back online, its running record would
    stand beside n1's (a reader that starts then follows neither), and a leader that kept
    leading would be a second one: it stops, clears its record, and follows n1."""
    section = SiteManagerSection(enabled=True, period=0.5, lease=4.0)
    up = {"n1": True, "n2": True}
    n1 = json.dumps({"v": 1, "node": "n1", "until": 1010.0}).encode()
    driver = SiteDriver(section, "n2", "c", stale_after=5.0)
    own = driver.tick(1000.0, docs(1000.0), up)[0]
    assert driver.leading and driver.on_reconnect() == [Publish(own.topic, b"", True)] and not driver.leading
    driver.on_claim("n2", own.payload, 1001.0)  # its retained record comes back first
    driver.on_claim("n1", n1, 1001.0)
    assert driver.tick(1001.0, docs(1001.0), up) == [Publish(own.topic, b"", True)]
    assert driver.tick(1002.0, docs(1002.0), up) == [] and driver.lease is not None and driver.lease.node == "n1"
    restarted = SiteDriver(section, "n2", "c", stale_after=5.0)  # a new process: its last term's record
    restarted.on_claim("n2", own.payload, 1001.0)
    restarted.on_claim("n1", n1, 1001.0)
    assert restarted.tick(1001.0, docs(1001.0), up) == [Publish(own.topic, b"", True)] and not restarted.leading
    alone = SiteDriver(section, "n2", "c", stale_after=5.0)  # nobody else claimed: it goes on
    alone.on_claim("n2", own.payload, 1001.0)
    assert json.loads(alone.tick(1001.0, docs(1001.0), up)[0].payload)["node"] == "n2"
