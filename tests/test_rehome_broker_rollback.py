"""The re-homing agent's retained record through a broker killed with SIGKILL: Mosquitto comes
back from its last autosave (`autosave_interval 5` in our config), so the copy of our
`agents/<n>/rehomed` record it hands back at our reconnect may lack what we re-homed in the last
seconds, or be missing. No broker: the client records what the agent sends, the broker's
messages are handed in, the clock is ours (as tests/test_rehome_retry.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Tuple

from agent import topics
from agent.instance.spec import InstanceSpec, request_spec
from agent.mqtt.settings import BrokerSpec
from agent.node.loopevents import Disconnected
from pipelines import with_work
from recording_client import RecordingClient, message as recorded, reconnect

PIPELINE = with_work("agent.operators.builtin:in_zone")


def test_a_rehome_our_record_lost_with_the_brokers_last_seconds_is_published_again(tmp_path: Path) -> None:
    """n1 re-homes n3's instance, then the broker is killed before its next autosave. Taking the
    older copy it handed back, n1 forgot the re-home for good: the record it publishes next is
    built on that copy, and n3, back, would re-adopt the instance even after its re-homed copy
    left (rehoming.taken_over), and a node fencing after a partition would not know which copy
    stays (rehoming.rehomed_here)."""
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "n1"\ncluster = "c"\nstate_dir = "{tmp_path}"\ndead_after = 6.0\n'
                    '[mqtt]\nhost = "h"\nport = 1\n')
    clock = [100.0]
    agent = Agent(load_agent_config(conf), warm_worker=False, clock=lambda: clock[0], wall=lambda: 5000.0)
    placed: List[str] = []
    agent.core.creating.create = lambda spec, reply, cause, now: placed.append(spec.instance)  # type: ignore
    client = agent.bus.client = RecordingClient()
    ours = topics.agent_rehomed("c", "n1")

    def message(topic: str, payload: bytes, retain: bool = False) -> None:
        agent.core._on_message(recorded(topic, payload, retain), clock[0])

    def connect(at: float, retained: List[Tuple[str, bytes]]) -> None:
        clock[0] = at
        reconnect(agent, client, at, retained)

    work = InstanceSpec("p.work.0", "work", "n3", "c", "p", PIPELINE, BrokerSpec("h", 1), keeper=True)
    hosted = (topics.agent_hosted("c", "n3"), json.dumps([request_spec(work)]).encode())
    before = (ours, json.dumps({"p.old.0": 4000.0}).encode())  # what the broker saved at its autosave
    connect(100.0, [(topics.agent_status("c", "n3"), b"online"), hosted, before])
    clock[0] = 101.0
    message(topics.agent_status("c", "n3"), b"offline")  # n3 lost
    clock[0] = 108.0
    agent._periodic(108.0)
    assert placed == ["p.work.0"]
    assert json.loads(client.on(ours)[-1]) == {"p.old.0": 4000.0, "p.work.0": 5000.0}

    # the broker killed 2 s later, back from its autosave of 5 s before: our record as it was
    clock[0] = 110.0
    agent._dispatch(Disconnected("connection lost"), 110.0)
    sent = len(client.on(ours))
    connect(112.0, [(topics.agent_status("c", "n3"), b"offline"), hosted, before])
    assert agent.core.view.rehomed_by_node["n1"] == {"p.old.0": 4000.0, "p.work.0": 5000.0}, "the re-home forgotten"
    assert client.on(ours)[sent:], "our record not published again: the broker keeps the older copy"
    assert json.loads(client.on(ours)[-1]) == {"p.old.0": 4000.0, "p.work.0": 5000.0}

    # lost altogether (no autosave since our first record): no copy comes back, ours goes again
    clock[0] = 115.0
    agent._dispatch(Disconnected("connection lost"), 115.0)
    sent = len(client.on(ours))
    connect(117.0, [(topics.agent_status("c", "n3"), b"offline"), hosted])
    assert [json.loads(p) for p in client.on(ours)[sent:]] == [{"p.old.0": 4000.0, "p.work.0": 5000.0}]
