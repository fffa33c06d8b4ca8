"""The GME cores running for real: one MQTT client (and one worker thread) per node, via Mosquitto.

Why: the simulator's message counts say nothing about what a broker does to ordering and
latency. Each node owns one paho client (CallbackAPIVersion.VERSION2, QoS 1) that subscribes to
its own inbox topic before anybody is told to start (docs/design.md invariant 2) and is the only
publisher of its messages. FIFO per link (invariant 1): every message carries a per-destination
sequence number and the receiver delivers in sequence order, dropping duplicates, whatever the
broker does on reconnect. The in-flight window is 100 (docs/design.md section 6: fastest measured); it was 1,
which serialized every publish behind a broker round trip and made 18 nodes take > 150 s.

paho callbacks only enqueue (aiomqtt style); the node's worker thread owns the core, the timers
(think / CS) and the publishing. A verifier client subscribes to the lock events topic and checks
that no two CS intervals of different groups overlap (all nodes run in this process, so they
share one monotonic clock).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from agent.protocol.gme_base import Entered, Send, message_from_dict
from agent.sim.gme_check import make_nodes

__all__ = ["BenchConfig", "run_bench"]

_MODULE = {"2fgme": "gme_fgme", "ra1": "gme_ra1", "ra2": "gme_ra2"}


@dataclass(frozen=True)
class BenchConfig:
    algorithm: str = "2fgme"
    nodes: int = 12
    entries: int = 25
    think_ms: float = 50.0
    cs_ms: float = 50.0
    host: str = "127.0.0.1"
    port: int = 1883
    timeout_s: float = 300.0


def _client(client_id: str):  # type: ignore[no-untyped-def]
    import paho.mqtt.client as mqtt

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True)
    c.max_inflight_messages_set(100)  # order is restored by the per-link sequence numbers
    c.max_queued_messages_set(0)
    return c


class _Node(threading.Thread):
    def __init__(self, core: Any, cfg: BenchConfig, prefix: str, start_evt: threading.Event) -> None:
        super().__init__(daemon=True, name=f"gme-node-{core.id}")
        self.core = core
        self.cfg = cfg
        self.prefix = prefix
        self.start_evt = start_evt
        self.inbox: "queue.Queue[bytes]" = queue.Queue()
        self.subscribed = threading.Event()
        self.out_seq: Dict[int, int] = {}
        self.in_next: Dict[int, int] = {}
        self.held: Dict[int, Dict[int, Dict[str, Any]]] = {}
        self.sent = 0
        self.latencies: List[float] = []
        self.errors: List[str] = []
        self.client = _client(f"{prefix}-n{core.id}")
        self.client.on_message = lambda c, u, m: self.inbox.put(m.payload)
        self.client.on_subscribe = lambda c, u, mid, rc, p: self.subscribed.set()
        self.client.connect(cfg.host, cfg.port, keepalive=30)
        self.client.subscribe(f"{prefix}/inbox/{core.id}", qos=1)
        self.client.loop_start()

    def _publish(self, topic: str, payload: Dict[str, Any]) -> None:
        info = self.client.publish(topic, json.dumps(payload, separators=(",", ":")), qos=1)
        if info.rc != 0:
            raise RuntimeError(f"node {self.core.id}: publish to {topic} failed with rc={info.rc}")

    def _perform(self, outs: List[Any]) -> None:
        for o in outs:
            if isinstance(o, Send):
                seq = self.out_seq.get(o.to, 0) + 1
                self.out_seq[o.to] = seq
                self.sent += 1
                self._publish(f"{self.prefix}/inbox/{o.to}", {"src": self.core.id, "seq": seq, "m": o.message.to_dict()})
            elif isinstance(o, Entered):
                self.latencies.append((time.monotonic() - self.asked) * 1000.0)
                self._event("enter")
                self.cs_until = time.monotonic() + self.cfg.cs_ms / 1000.0

    def _event(self, what: str) -> None:
        self._publish(f"{self.prefix}/events", {"node": self.core.id, "group": self.core.group, "ev": what, "t": time.monotonic()})

    def _deliver(self, raw: bytes) -> None:
        d = json.loads(raw)
        src, seq = d["src"], d["seq"]
        nxt = self.in_next.get(src, 1)
        if seq < nxt:
            return  # duplicate after a retransmission
        self.held.setdefault(src, {})[seq] = d["m"]
        held = self.held[src]
        while nxt in held:
            m = message_from_dict(held.pop(nxt), _MODULE[self.cfg.algorithm])
            nxt += 1
            self.in_next[src] = nxt
            self._perform(self.core.receive(m))

    def run(self) -> None:
        from agent.protocol.gme_base import GmeState

        try:
            self.start_evt.wait()
            left = self.cfg.entries
            wake = time.monotonic() + self.cfg.think_ms / 1000.0 * (self.core.id % 3) / 3.0
            self.cs_until = float("inf")
            while left > 0 or self.core.state is not GmeState.IDLE:
                now = time.monotonic()
                st = self.core.state
                if st is GmeState.IDLE and now >= wake and left > 0:
                    left -= 1
                    self.asked = now
                    self._event("request")
                    self._perform(self.core.request())
                    continue
                if st is GmeState.IN_CS and now >= self.cs_until:
                    self._event("exit")
                    self.cs_until = float("inf")
                    self._perform(self.core.exit())
                    wake = time.monotonic() + self.cfg.think_ms / 1000.0
                    continue
                deadline = wake if st is GmeState.IDLE else self.cs_until
                timeout = max(0.0, min(deadline - now, 0.5)) if deadline != float("inf") else 0.5
                try:
                    raw = self.inbox.get(timeout=timeout)
                except queue.Empty:
                    continue
                self._deliver(raw)
            # keep answering the others until the run ends
            while not self.stop:
                try:
                    self._deliver(self.inbox.get(timeout=0.1))
                except queue.Empty:
                    pass
        except Exception as exc:  # reported, never swallowed
            self.errors.append(f"{type(exc).__name__}: {exc}")

    stop = False


def run_bench(cfg: BenchConfig) -> Dict[str, Any]:
    prefix = f"fog/gme-bench/{uuid.uuid4().hex[:8]}"
    sizes = (cfg.nodes // 2, cfg.nodes - cfg.nodes // 2)
    cores = make_nodes(cfg.algorithm, sizes)
    events: List[Dict[str, Any]] = []
    lock = threading.Lock()
    ver = _client(prefix + "-verifier")
    got_sub = threading.Event()
    ver.on_message = lambda c, u, m: (lock.acquire(), events.append(json.loads(m.payload)), lock.release())
    ver.on_subscribe = lambda c, u, mid, rc, p: got_sub.set()
    ver.connect(cfg.host, cfg.port, keepalive=30)
    ver.subscribe(f"{prefix}/events", qos=1)
    ver.loop_start()
    start_evt = threading.Event()
    nodes = [_Node(c, cfg, prefix, start_evt) for c in cores]
    for n in nodes + [None]:  # subscribe before announce: wait for every SUBACK
        evt = got_sub if n is None else n.subscribed
        if not evt.wait(10):
            raise RuntimeError("a GME bench client did not get its SUBACK within 10 s")
    for n in nodes:
        n.start()
    t0 = time.monotonic()
    start_evt.set()
    deadline = t0 + cfg.timeout_s
    while time.monotonic() < deadline:
        with lock:
            exits = sum(1 for e in events if e["ev"] == "exit")
        if exits >= cfg.nodes * cfg.entries or any(n.errors for n in nodes):
            break
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    time.sleep(0.3)
    for n in nodes:
        n.stop = True
    for n in nodes:
        n.join(2)
        n.client.loop_stop()
        n.client.disconnect()
    ver.loop_stop()
    ver.disconnect()
    with lock:
        evs = list(events)
    # safety: overlap of CS intervals of different groups, on the shared monotonic clock
    open_at: Dict[int, Tuple[int, float]] = {}
    intervals: List[Tuple[float, float, int]] = []
    for e in sorted(evs, key=lambda e: e["t"]):
        if e["ev"] == "enter":
            open_at[e["node"]] = (e["group"], e["t"])
        elif e["ev"] == "exit" and e["node"] in open_at:
            g, t = open_at.pop(e["node"])
            intervals.append((t, e["t"], g))
    intervals.sort()
    violations = 0
    for i, (s1, e1, g1) in enumerate(intervals):
        for s2, e2, g2 in intervals[i + 1:]:
            if s2 >= e1:
                break
            if g2 != g1:
                violations += 1
    lat = sorted(x for n in nodes for x in n.latencies)
    served = sum(1 for e in evs if e["ev"] == "exit")
    msgs = sum(n.sent for n in nodes)
    return {
        "algorithm": cfg.algorithm,
        "nodes": cfg.nodes,
        "entries_per_node": cfg.entries,
        "think_ms": cfg.think_ms,
        "cs_ms": cfg.cs_ms,
        "messages": msgs,
        "messages_per_entry": round(msgs / served, 2) if served else None,
        "cs_entries": served,
        "latency_ms_mean": round(sum(lat) / len(lat), 2) if lat else None,
        "latency_ms_p95": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 2) if lat else None,
        "safety_violations": violations,
        "unserved_requests": cfg.nodes * cfg.entries - served,
        "errors": [e for n in nodes for e in n.errors],
        "wall_s": round(elapsed, 2),
    }
