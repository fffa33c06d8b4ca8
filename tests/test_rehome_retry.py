"""Re-homing when the placement fails and the dead node comes back meanwhile: session 12's chaos
seed 12026 (docs/reliability.md, "Numbers (session 12)"). No broker: the agent's messages are
fed to its handler, its publishes accepted, time passed in."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Tuple

import pytest

from agent import topics
from agent.instance.spec import InstanceSpec, request_spec
from agent.mqtt.settings import BrokerSpec
from pipelines import with_work

PIPELINE = with_work("agent.operators.builtin:in_zone")


def test_a_rehome_that_fails_after_the_node_came_back_is_placed_again(tmp_path: Path) -> None:
    """In the run, n1's agent was killed and came back after 14 s (load ~48); n2 had re-homed n1's
    keepers after 6 s. The re-homed source was not ready 20 s after its start, on n2 and then on
    n3, so its createNode() failed. n1 was back by then: n2 tries a failed re-home again only
    while the node is offline, and n1, seeing n2's re-homed record at its reconnect, had
    forgotten the instance (`_reconcile`: it runs elsewhere now). No node ran the source again,
    its last records never left, and no source record would ever again reach the sink."""
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "n2"\ncluster = "c"\nstate_dir = "{tmp_path}"\ndead_after = 6.0\n'
                    '[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    agent._publish = lambda *a, **k: True  # type: ignore[assignment]
    placed: List[Tuple[str, Callable[[Dict[str, Any]], None]]] = []
    agent._create_node = lambda spec, reply, cause, now: placed.append((spec.instance, reply))  # type: ignore
    agent.connected = True

    def message(topic: str, payload: bytes) -> None:
        agent._on_message(SimpleNamespace(topic=topic, payload=payload, retain=False, properties=None), now)

    source = InstanceSpec("p.source.0", "source", "n1", "c", "p", PIPELINE, BrokerSpec("h", 1), keeper=True,
                          succs=("p.work.0",))
    agent.hosted_by_node["n1"] = [request_spec(source)]
    now = 100.0
    for node in ("n1", "n3"):
        message(topics.agent_status("c", node), b"online")
    now = 101.0
    message(topics.agent_status("c", "n1"), b"offline")  # the Will of the killed agent
    now = 108.0
    agent._maybe_rehome(now)
    assert [i for i, _ in placed] == ["p.source.0"]  # re-homed after dead_after

    now = 115.0
    message(topics.agent_status("c", "n1"), b"online")  # n1's agent is back (and forgets the source)
    now = 135.0
    placed[0][1]({"ok": False, "error": "n3: worker exited before ready (not ready 20.0s after start)"})
    for now in (136.0, 140.0, 160.0):
        agent._maybe_rehome(now)
    assert [i for i, _ in placed].count("p.source.0") >= 2, "the source runs nowhere and nobody places it again"
