"""A fake fleet for fogctl tests and demos: agents that publish what the real daemon publishes.

Why ship it in the package (bytewax `testing.py` style): the fake documents the payloads fogctl
reads by example, and the daemon's own tests can compare their output with it. A `FakeAgent` is
a real MQTT client on a real broker: retained status with a Last Will "offline", retained state
JSON, latency, and an MQTT 5 rpc responder for `scale` / `drain` that changes its state the way
the protocol would (new instances start, then become active; leaving instances disappear).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import events, topics
from agent.control.rpc_schema import DrainRequest, PinRequest, Reply, RequestError, ScaleRequest, parse_request
from agent.mqtt import client as mqttc

__all__ = ["FakeInstance", "FakeAgent"]


@dataclass
class FakeInstance:
    id: str
    operator: str
    pipeline: str = "taxi"
    keeper: bool = False
    phase: str = "active"
    load: float = 100.0
    capacity: float = 500.0
    lock: Optional[Dict[str, str]] = None

    def to_dict(self) -> Dict[str, Any]:
        d = {"id": self.id, "operator": self.operator, "pipeline": self.pipeline, "keeper": self.keeper,
             "phase": self.phase, "load": self.load, "capacity": self.capacity}
        if self.lock is not None:
            d["lock"] = dict(self.lock)
        return d


class FakeAgent:
    """One fake node; `start()` connects, `stop()` disconnects cleanly, `kill()` drops the socket."""

    def __init__(self, host: str, port: int, cluster: str, node: str, *, slots: int = 4,
                 instances: Optional[List[FakeInstance]] = None, keepalive: int = 2,
                 cpu: float = 12.5, memory: float = 40.0, temperature: float = 51.0,
                 latency_ms: Optional[Dict[str, float]] = None, emulated_ms: Optional[Dict[str, float]] = None,
                 refuse: Optional[str] = None) -> None:
        self.host, self.port, self.cluster, self.node = host, port, cluster, node
        self.slots, self.keepalive = slots, keepalive
        self.instances: List[FakeInstance] = list(instances or [])
        self.cpu, self.memory, self.temperature = cpu, memory, temperature
        self.latency_ms, self.emulated_ms = latency_ms, emulated_ms
        self.refuse = refuse
        self.requests: List[Dict[str, Any]] = []
        self.pins: Dict[str, Dict[str, Any]] = {}  # "<pipeline>/<operator>" -> pin, as the daemon keeps them
        self._next = 100
        self._lock = threading.Lock()
        self._broker = mqttc.broker_from(host, port, keepalive=keepalive)
        c = mqttc.make_client(self._broker, f"fake-agent-{cluster}-{node}",
                              will=mqttc.Will(topics.agent_status(cluster, node), b"offline"))
        c.on_message = self._on_message
        self.client = c

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "FakeAgent":
        mqttc.connect_and_wait(self.client, self._broker, timeout=5)  # ConnectFailed names host:port
        self.client.subscribe(topics.agent_rpc_inbox(self.cluster, self.node), qos=1)
        self._pub(topics.agent_status(self.cluster, self.node), b"online")
        self.publish_state()
        if self.latency_ms is not None or self.emulated_ms is not None:
            body = {"node": self.node, "ts": time.time(), "rtt_ms": self.latency_ms or {},
                    "emulated_ms": self.emulated_ms or {}}
            self._pub(topics.latency(self.cluster, self.node), json.dumps(body).encode())
        return self

    def stop(self) -> None:
        self._pub(topics.agent_status(self.cluster, self.node), b"offline")
        self.client.disconnect()
        self.client.loop_stop()

    def kill(self) -> None:
        """Vanish without DISCONNECT (like SIGKILL): the broker sends the Last Will later."""
        self.client.loop_stop()
        sock = self.client.socket()
        if sock is not None:
            sock.close()

    def _pub(self, topic: str, payload: bytes, retain: bool = True, properties: Any = None) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain, properties=properties)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise RuntimeError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        info.wait_for_publish(5)

    # -- what the daemon publishes -----------------------------------------------------------------

    def state(self) -> Dict[str, Any]:
        with self._lock:
            insts = [i.to_dict() for i in self.instances]
            pins = sorted(self.pins.values(), key=lambda p: (p["pipeline"] or "", p["operator"]))
        for i in insts:
            if any(p["operator"] == i["operator"] and p["pipeline"] in (None, i["pipeline"]) for p in pins):
                i["pinned"] = True
        doc = {"v": 1, "node": self.node, "ts": time.time(), "cpu": self.cpu, "memory": self.memory,
               "temperature": self.temperature, "slots": self.slots,
               "free_slots": self.slots - len(insts), "capacity": 500.0, "instances": insts}
        if pins:
            doc["pins"] = pins
        return doc

    def publish_state(self) -> None:
        self._pub(topics.agent_state(self.cluster, self.node), json.dumps(self.state()).encode())

    def publish_event(self, event: events.Event) -> None:
        self._pub(topics.events(self.cluster), event.to_json().encode(), retain=False)

    def publish_history(self, instance: str, history: List[events.Event]) -> None:
        body = json.dumps([e.to_dict() for e in history]).encode()
        self._pub(topics.decisions(self.cluster, instance), body)

    # -- rpc responder -------------------------------------------------------------------------------

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        # Like the daemon: the reply goes to replies/<requester>/<me>, from the request's topic.
        parsed = topics.parse(self.cluster, msg.topic)
        if parsed is None or parsed.kind != "rpc" or msg.retain:
            return
        reply_to = topics.replies(self.cluster, str(parsed.sender), self.node)
        corr = getattr(msg.properties, "CorrelationData", None)
        try:
            body = json.loads(msg.payload)
            self.requests.append(body)
            op = body.get("op") if isinstance(body, dict) else None
            reply = self._agent_op(body) if op in ("spawn", "stop", "ping") else self._handle(parse_request(body)).to_dict()
        except (ValueError, RequestError) as exc:
            reply = Reply(False, {}, str(exc)).to_dict()
        if reply_to:
            out = Properties(PacketTypes.PUBLISH)
            if corr is not None:
                out.CorrelationData = corr
            # Not from the network thread's wait: publish without waiting for PUBACK here.
            client.publish(reply_to, json.dumps(reply).encode(), qos=1, properties=out)
        threading.Thread(target=self._settle, daemon=True).start()

    def _agent_op(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """The daemon's own rpc ops (agent.node.rpc): spawn a keeper, stop an instance."""
        with self._lock:
            if body["op"] == "spawn":
                spec = body.get("spec") or {}
                if len(self.instances) >= self.slots:
                    return {"ok": False, "error": f"no free slot on {self.node}"}
                self.instances.append(FakeInstance(spec["instance"], spec["operator"], spec.get("pipeline", "taxi"),
                                                   keeper=bool(spec.get("keeper")), phase="starting"))
                return {"ok": True, "instance": spec["instance"], "node": self.node}
            if body["op"] == "stop":
                for i in self.instances:
                    if i.id == body.get("instance"):
                        i.phase = "terminating"
                        return {"ok": True, "instance": i.id, "node": self.node}
                return {"ok": False, "error": f"no instance {body.get('instance')!r} on {self.node}"}
        return {"ok": True, "node": self.node}

    def _handle(self, req: Any) -> Reply:
        with self._lock:
            if isinstance(req, PinRequest):  # the pin is no steering: `refuse` leaves it alone
                if req.release:
                    self.pins = {k: p for k, p in self.pins.items() if not (
                        p["operator"] == req.operator and req.pipeline in (None, p["pipeline"]))}
                else:
                    until = None if req.seconds is None else time.time() + req.seconds
                    self.pins[f"{req.pipeline or ''}/{req.operator}"] = {
                        "pipeline": req.pipeline, "operator": req.operator, "until": until}
                return Reply(True, {"pinned": not req.release, "node": self.node})
        if self.refuse:
            return Reply(False, {}, self.refuse)
        with self._lock:
            if isinstance(req, ScaleRequest):
                if req.delta > 0:
                    new = []
                    for _ in range(req.delta):
                        self._next += 1
                        new.append(FakeInstance(f"{req.operator}-{self._next}", req.operator, phase="starting"))
                    self.instances += new
                    return Reply(True, {"instances": [i.id for i in new]})
                mine = {i.id: i for i in self.instances if i.operator == req.operator and not i.keeper}
                missing = [x for x in req.instances if x not in mine]
                if missing or len(req.instances) != -req.delta:
                    return Reply(False, {}, f"not non-keeper instances of {req.operator} on {self.node}: {missing}")
                leaving = [mine[x] for x in req.instances]
                for i in leaving:
                    i.phase = "terminating"
                return Reply(True, {"instances": [i.id for i in leaving]})
            if isinstance(req, DrainRequest):
                for i in self.instances:
                    i.phase = "terminating"
                return Reply(True, {"leaving": [i.id for i in self.instances]})
        return Reply(False, {}, "unsupported")

    def _settle(self) -> None:
        """What the protocol does after a request: starting -> active, terminating -> gone."""
        self.publish_state_async()
        time.sleep(0.2)
        with self._lock:
            self.instances = [i for i in self.instances if i.phase != "terminating"]
            for i in self.instances:
                if i.phase == "starting":
                    i.phase = "active"
        self.publish_state_async()

    def publish_state_async(self) -> None:
        self.client.publish(topics.agent_state(self.cluster, self.node), json.dumps(self.state()).encode(),
                            qos=1, retain=True)
