"""Re-homing when the placement fails and the dead node comes back meanwhile (CHANGELOG.md, "A
re-home that failed while the dead node came back left the identity nowhere"). No broker: the
agent's messages are
fed to its handler, its publishes accepted, time passed in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from agent.node.loopevents import Disconnected
from agent import topics
from agent.instance.spec import InstanceSpec, request_spec
from agent.mqtt.settings import BrokerSpec
from pipelines import with_work
from recording_client import RecordingClient, message as recorded, reconnect

PIPELINE = with_work("agent.operators.builtin:in_zone")


def test_a_rehome_that_fails_after_the_node_came_back_is_placed_again(tmp_path: Path) -> None:
    """In the run, n1's agent was killed and came back after 14 s (load ~48); n2 had re-homed n1's
    keepers after 6 s. The re-homed source was not ready 20 s after its start, on n2 and then on
    n3, so its createNode() failed. n1 was back by then: n2 tries a failed re-home again only
    while the node is offline, and n1, seeing n2's re-homed record at its reconnect, had
    forgotten the instance (`Reconciler.reconcile`: it runs elsewhere now). No node ran the source again,
    its last records never left, and no source record would ever again reach the sink."""
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "n2"\ncluster = "c"\nstate_dir = "{tmp_path}"\ndead_after = 6.0\n'
                    '[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    agent.core._publish = lambda *a, **k: True  # type: ignore[assignment]
    placed: List[Tuple[str, Callable[[Dict[str, Any]], None]]] = []
    agent.core.creating.create = lambda spec, reply, cause, now: placed.append((spec.instance, reply))  # type: ignore
    agent.bus.connected = agent.bus.retained_in = True  # connected, the retained records in (sync marker)

    def message(topic: str, payload: bytes) -> None:
        agent.core._on_message(recorded(topic, payload), now)

    source = InstanceSpec("p.source.0", "source", "n1", "c", "p", PIPELINE, BrokerSpec("h", 1), keeper=True,
                          succs=("p.work.0",))
    agent.core.view.hosted_by_node["n1"] = [request_spec(source)]
    now = 100.0
    for node in ("n1", "n3"):
        message(topics.agent_status("c", node), b"online")
    now = 101.0
    message(topics.agent_status("c", "n1"), b"offline")  # the Will of the killed agent
    now = 108.0
    agent.core.rehomer.tick(now, agent.wall())
    assert [i for i, _ in placed] == ["p.source.0"]  # re-homed after dead_after

    now = 115.0
    message(topics.agent_status("c", "n1"), b"online")  # n1's agent is back (and forgets the source)
    now = 135.0
    placed[0][1]({"ok": False, "error": "n3: worker exited before ready (not ready 20.0s after start)"})
    for now in (136.0, 140.0, 160.0):
        agent.core.rehomer.tick(now, agent.wall())
    assert [i for i, _ in placed].count("p.source.0") >= 2, "the source runs nowhere and nobody places it again"


def test_a_node_that_came_back_while_we_were_away_is_not_rehomed_at_our_reconnect(tmp_path: Path) -> None:
    """n3 went offline, then our own connection dropped; n3 came back while we were away. At our
    reconnect the loop ran before the broker had sent n3's retained "online": n3 still read as
    offline since before the cut, longer than dead_after, and we re-homed the instances it runs
    (one identity in two processes). The planner now waits for the echo of the sync marker
    published after subscribing: the retained statuses come before it. No broker: the client
    records what the agent sends, the broker's messages are handed in, the clock is ours."""
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "n1"\ncluster = "c"\nstate_dir = "{tmp_path}"\ndead_after = 6.0\n'
                    '[mqtt]\nhost = "h"\nport = 1\n')
    clock = [100.0]
    agent = Agent(load_agent_config(conf), warm_worker=False, clock=lambda: clock[0])
    placed: List[str] = []
    agent.core.creating.create = lambda spec, reply, cause, now: placed.append(spec.instance)  # type: ignore
    client = agent.bus.client = RecordingClient()

    def connect(at: float, retained: List[Tuple[str, bytes]]) -> None:
        clock[0] = at
        reconnect(agent, client, at, retained)

    def message(topic: str, payload: bytes, retain: bool = False) -> None:
        agent.core._on_message(recorded(topic, payload, retain), clock[0])

    work = InstanceSpec("p.work.0", "work", "n3", "c", "p", PIPELINE, BrokerSpec("h", 1), keeper=True)
    hosted = (topics.agent_hosted("c", "n3"), json.dumps([request_spec(work)]).encode())
    connect(100.0, [(topics.agent_status("c", "n3"), b"online"), hosted])
    clock[0] = 101.0
    message(topics.agent_status("c", "n3"), b"offline")  # n3's Will
    clock[0] = 103.0
    agent._dispatch(Disconnected("keepalive timeout"), 103.0)  # our cut: n3 is back at 105
    connect(120.0, [(topics.agent_status("c", "n3"), b"online"), hosted])
    assert placed == [], "re-homed the instances of a node that is online"
    # the planner itself works: n3 lost again, for longer than dead_after
    clock[0] = 121.0
    message(topics.agent_status("c", "n3"), b"offline")
    clock[0] = 128.0
    agent._periodic(128.0)
    assert placed == ["p.work.0"]
