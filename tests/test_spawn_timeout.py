"""createNode() across nodes when the asked node answers late (CHANGELOG.md, "A timed-out spawn was
asked of the next node under the same identity"). docs/design.md invariant 7: one identity runs on
one node. No broker: the agent's publish is recorded, time is passed in; except where paho's own
queue is the point (a spawn taken while the connection is down), with a real Mosquitto."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Tuple

from agent import topics
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
    from agent.node.daemon import Agent
    from agent.node.spawns import RPC_TIMEOUT

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "n1"\ncluster = "c"\nstate_dir = "{tmp_path}"\n[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    sent: List[Tuple[str, Dict[str, Any]]] = []

    def publish(topic: str, payload: bytes, retain: bool = False, qos: int = 1, correlation: Any = None) -> bool:
        if "/peer/" in topic:
            sent.append((topic, rpc.decode_request(payload)))
        return True

    agent.core._publish = publish  # type: ignore[assignment]
    agent.bus.connected = True
    spec = InstanceSpec("work-c458fdf7d48d", "work", "n1", "c", "p", PIPELINE, BrokerSpec("h", 1),
                        preds=("p.source.0",), succs=("p.sink.0",))
    replies: List[Dict[str, Any]] = []
    agent.core.creating.handle(spawns.CreateNode(spec, replies.append, "spawn", ("n2", "n3"), {}), 100.0)
    assert [t.split("/peer/")[0].rsplit("/", 1)[-1] for t, _ in sent] == ["n2"]  # asked n2 first

    agent._periodic(100.0 + RPC_TIMEOUT + 1.0)  # n2's answer has not come (it is on its way)
    again = [(t, b) for t, b in sent[1:] if b.get("op") == "spawn"]
    assert not any(b["spec"]["instance"] == spec.instance for _, b in again), (
        f"the same identity asked of another node while n2 may run it: {[t for t, _ in again]}")
    assert [r["ok"] for r in replies] == [False], replies  # the creator hears of it and decides again


def test_a_spawn_paho_took_while_the_connection_was_down_is_asked_of_no_other_node(tmp_path: Path, mosquitto: Any) -> None:
    """n1's agent places the copies of a duplication round while the broker is being killed,
    before its loop has heard of the lost connection. paho answers each spawn request with
    MQTT_ERR_NO_CONN and keeps it, to send at the reconnect; taken for "not queued", the next
    node would be asked for the same identity, and at the reconnect paho would send both: the
    copies would run on two nodes at once, each pair taking the session from the other, both
    nodes would then stop theirs, and the copies' key groups would go with them (CHANGELOG.md,
    "A spawn asked of two nodes while the broker was away"). A request paho took is on its way:
    the agent waits for its answer."""
    from agent.config import load_agent_config
    from agent.mqtt import client as mqttc
    from agent.node import spawns
    from agent.node.bus import SESSION
    from agent.node.daemon import Agent

    cluster = f"c{uuid.uuid4().hex[:8]}"
    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "n1"\ncluster = "{cluster}"\nstate_dir = "{tmp_path}"\n'
                    f'[mqtt]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    # the agent's own client while its broker is away: paho answers a publish with NO_CONN
    agent.bus.client = mqttc.make_client(agent.bus.broker, agent.bus.client_id, SESSION)
    agent.bus.connected = True  # its loop has not heard of the loss yet

    asked: List[str] = []
    subscribed = threading.Event()
    watcher = mqttc.make_client(agent.bus.broker, f"watch-{cluster}")
    watcher.on_message = lambda c, u, m: asked.append(m.topic.split("/agents/")[1].split("/")[0]) if (
        rpc.decode_request(m.payload).get("op") == "spawn") else None
    watcher.on_subscribe = lambda *a: subscribed.set()
    mqttc.connect_and_wait(watcher, agent.bus.broker)
    watcher.subscribe(f"{topics.base(cluster)}/agents/+/peer/n1", qos=1)
    assert subscribed.wait(10.0)
    try:
        spec = InstanceSpec("work-5eedf43f0646", "work", "n1", cluster, "p", PIPELINE, agent.bus.broker,
                            preds=("p.source.0",), succs=("p.sink.0",))
        replies: List[Dict[str, Any]] = []
        agent.core.creating.handle(spawns.CreateNode(spec, replies.append, "spawn", ("n2", "n3"), {"n2": True, "n3": True}), 100.0)
        assert replies == [], replies  # not failed: n2's answer is awaited
        assert [c.node for c in agent.core.spawns.calls.values()] == ["n2"], agent.core.spawns.calls

        mqttc.connect_and_wait(agent.bus.client, agent.bus.broker, SESSION)  # the broker is back
        deadline = time.monotonic() + 5.0
        while not asked and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a second request would follow the first at once
        assert asked == ["n2"], f"spawn of one identity delivered to {asked}"
    finally:
        for c in (agent.bus.client, watcher):
            c.loop_stop()
            c.disconnect()


def test_publish_taken_follows_paho_which_keeps_a_qos1_message_while_disconnected() -> None:
    """The rule `mqttc.publish_taken` states, against paho itself: a QoS 1 publish on a client
    that is not connected answers NO_CONN and is kept (sent at the reconnect); one past the
    client's queue limit is refused."""
    import paho.mqtt.client as mqtt

    from agent.mqtt import client as mqttc

    c = mqttc.make_client(BrokerSpec("localhost", 1), "taken", max_queued=1)
    first = c.publish("t/a", b"x", qos=1)
    assert first.rc == mqtt.MQTT_ERR_NO_CONN and mqttc.publish_taken(first.rc, 1)
    second = c.publish("t/b", b"y", qos=1)
    assert second.rc == mqtt.MQTT_ERR_QUEUE_SIZE and not mqttc.publish_taken(second.rc, 1)
    assert not mqttc.publish_taken(mqtt.MQTT_ERR_PROTOCOL, 0) and mqttc.publish_taken(mqtt.MQTT_ERR_NO_CONN, 0)

