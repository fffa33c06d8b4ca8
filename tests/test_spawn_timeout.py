"""createNode() across nodes when the asked node answers late: chaos seed 12013 of the 9cfb017 campaign
(docs/results.md, R2). docs/design.md invariant 7: one identity runs on
one node. No broker: the agent's publish is recorded, time is passed in."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import rpc
from pipelines import with_work

PIPELINE = with_work("agent.operators.builtin:in_zone")


def test_a_spawn_that_times_out_is_not_placed_again_under_the_same_identity(tmp_path: Path) -> None:
    """In the run, n1 (hosting the creator) asked n2 to start copy `work-...`; n2 took 18 s to
    start it (load ~45) and n1 was cut off the broker meanwhile, so n2's answer waited in the
    broker. After RPC_TIMEOUT n1 asked n3 for the same spec; at the heal both requests had been
    served: one copy id ran on n2 and n3, the two processes took the session from each other every
    half second, the copy never started and its predecessor's credit to it ran out (567 records).
    A request that timed out may have been served: placing the same identity elsewhere needs the
    first node to be known not to run it."""
    from agent.config import load_agent_config
    from agent.node import spawns
    from agent.node.daemon import RPC_TIMEOUT, Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "n1"\ncluster = "c"\nstate_dir = "{tmp_path}"\n[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    sent: List[Tuple[str, Dict[str, Any]]] = []

    def publish(topic: str, payload: bytes, retain: bool = False, qos: int = 1, properties: Any = None) -> bool:
        if "/peer/" in topic:
            sent.append((topic, rpc.decode_request(payload)))
        return True

    agent._publish = publish  # type: ignore[assignment]
    agent.bus.connected = True
    spec = InstanceSpec("work-c458fdf7d48d", "work", "n1", "c", "p", PIPELINE, BrokerSpec("h", 1),
                        preds=("p.source.0",), succs=("p.sink.0",))
    replies: List[Dict[str, Any]] = []
    agent._spawn(spawns.CreateNode(spec, replies.append, "spawn", ("n2", "n3"), {}), 100.0)
    assert [t.split("/peer/")[0].rsplit("/", 1)[-1] for t, _ in sent] == ["n2"]  # asked n2 first

    agent._periodic(100.0 + RPC_TIMEOUT + 1.0)  # n2's answer has not come (it is on its way)
    again = [(t, b) for t, b in sent[1:] if b.get("op") == "spawn"]
    assert not any(b["spec"]["instance"] == spec.instance for _, b in again), (
        f"the same identity asked of another node while n2 may run it: {[t for t, _ in again]}")
    assert [r["ok"] for r in replies] == [False], replies  # the creator hears of it and decides again
