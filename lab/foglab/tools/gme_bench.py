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
that no two CS intervals of different groups overlap. The nodes run in `procs` processes
(several nodes per process); the events carry CLOCK_MONOTONIC, which Linux shares between
processes, so the intervals compare on one clock either way. One process for 24 nodes is the
limit (docs/gme.md, "24 nodes on the broker"): every message costs the one GIL, and 2-FGME's
authorization churn grows with the delivery delay that this creates.

Diagnostics (docs/gme.md): messages sent per kind per second, the one-way delay (publish to
delivery to the core, queueing included) and the largest inbox backlog per second, and, when
the run times out, every node's core state, reorder buffer and inbox length. `--timeout` always
ends the run: the nodes stop at the deadline, their threads and clients get a bounded grace, and
the report says `timed_out`.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import resource
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.mqtt import client as mqttc
from agent.protocol.gme_base import Entered, GmeState, Send, message_from_dict
from agent.protocol.gme_fgme import DAMPING_DEFAULT
from foglab.sim.gme_check import make_nodes

__all__ = ["BenchConfig", "run_bench"]

_MODULE = {"2fgme": "gme_fgme", "ra1": "gme_ra1", "ra2": "gme_ra2"}
_GRACE_S = 5.0  # after the run: time for all node threads and clients of one process to stop


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
    procs: int = 1  # processes the nodes are spread over (round robin)
    bucket_s: float = 1.0  # width of the message-rate buckets
    damping: bool = DAMPING_DEFAULT  # 2-FGME's DEVIATIONS 4 and 5 (agent/protocol/gme_fgme.py)


def _client(client_id: str, cfg: BenchConfig) -> Any:
    """A connected MQTT 3.1.1 clean-session client. TCP_NODELAY is set (agent.mqtt.client): without
    it every small publish behind an unacknowledged one waits for the broker's delayed TCP ACK,
    tens of ms per message, which is the slow delivery 2-FGME's churn feeds on (docs/gme.md,
    "24 nodes on the broker")."""
    broker = mqttc.broker_from(cfg.host, cfg.port, keepalive=30)
    # max_inflight 100: order is restored by the per-link sequence numbers
    c = mqttc.make_client(broker, client_id, mqttc.CLEAN_311, max_inflight=100, max_queued=0)
    mqttc.connect(c, broker, mqttc.CLEAN_311)
    return c


class _Node(threading.Thread):
    def __init__(self, core: Any, cfg: BenchConfig, prefix: str, start_evt: threading.Event) -> None:
        super().__init__(daemon=True, name=f"gme-node-{core.id}")
        self.core = core
        self.cfg = cfg
        self.prefix = prefix
        self.start_evt = start_evt
        self.t0 = 0.0  # set by the group before start_evt
        self.stop = False
        self.phase = "waiting"  # waiting -> requesting -> answering -> done
        self.left = cfg.entries
        self.lock = threading.Lock()  # held while the core changes (the dump reads under it)
        self.inbox: "queue.Queue[bytes]" = queue.Queue()
        self.subscribed = threading.Event()
        self.out_seq: Dict[int, int] = {}
        self.in_next: Dict[int, int] = {}
        self.held: Dict[int, Dict[int, Dict[str, Any]]] = {}
        self.sent = 0
        self.sent_by_bucket: Dict[int, Counter] = {}
        self.delay_by_bucket: Dict[int, List[float]] = {}  # bucket -> [sum ms, count, max backlog]
        self.latencies: List[float] = []
        self.errors: List[str] = []
        self.client = _client(f"{prefix}-n{core.id}", cfg)
        self.client.on_message = lambda c, u, m: self.inbox.put(m.payload)
        self.client.on_subscribe = lambda c, u, mid, rc, p: self.subscribed.set()
        self.client.subscribe(f"{prefix}/inbox/{core.id}", qos=1)
        self.client.loop_start()

    def _bucket(self, now: float) -> int:
        return int((now - self.t0) / self.cfg.bucket_s)

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
                now = time.monotonic()
                self.sent_by_bucket.setdefault(self._bucket(now), Counter())[o.message.kind] += 1
                self._publish(f"{self.prefix}/inbox/{o.to}",
                              {"src": self.core.id, "seq": seq, "ts": now, "m": o.message.to_dict()})
            elif isinstance(o, Entered):
                self.latencies.append((time.monotonic() - self.asked) * 1000.0)
                self._event("enter")
                self.cs_until = time.monotonic() + self.cfg.cs_ms / 1000.0

    def _event(self, what: str) -> None:
        self._publish(f"{self.prefix}/events", {"node": self.core.id, "group": self.core.group, "ev": what, "t": time.monotonic()})

    def _deliver(self, raw: bytes) -> None:
        d = json.loads(raw)
        src, seq = d["src"], d["seq"]
        now = time.monotonic()
        acc = self.delay_by_bucket.setdefault(self._bucket(now), [0.0, 0, 0])
        acc[0] += (now - d["ts"]) * 1000.0
        acc[1] += 1
        acc[2] = max(acc[2], self.inbox.qsize())
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
        try:
            self.start_evt.wait()
            self.phase = "requesting"
            wake = time.monotonic() + self.cfg.think_ms / 1000.0 * (self.core.id % 3) / 3.0
            self.cs_until = float("inf")
            while (self.left > 0 or self.core.state is not GmeState.IDLE) and not self.stop:
                now = time.monotonic()
                st = self.core.state
                if st is GmeState.IDLE and now >= wake and self.left > 0:
                    with self.lock:
                        self.left -= 1
                        self.asked = now
                        self._event("request")
                        self._perform(self.core.request())
                    continue
                if st is GmeState.IN_CS and now >= self.cs_until:
                    with self.lock:
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
                with self.lock:
                    self._deliver(raw)
            # keep answering the others until the run ends
            self.phase = "answering"
            while not self.stop:
                try:
                    raw = self.inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                with self.lock:
                    self._deliver(raw)
        except Exception as exc:  # reported, never swallowed
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.phase = "done" if self.phase == "answering" else self.phase + " (stopped)"

    def dump(self) -> Dict[str, Any]:
        """This node's state for the timeout report: the core, the reorder buffer, the queues."""
        got = self.lock.acquire(timeout=1.0)
        try:
            c = self.core
            core: Dict[str, Any] = {"state": c.state.value, "group": c.group, "entries": c.entries}
            for name in ("req_clock", "lc", "epoch", "competitors_authorized", "waiting_reqs",
                         "reqs_to_send", "acks_rcvd", "acks_to_ign"):
                if hasattr(c, name):
                    v = getattr(c, name)
                    if isinstance(v, float):
                        v = None if v == float("inf") else v
                    elif isinstance(v, dict):
                        v = {str(k): x for k, x in sorted(v.items())}
                    elif isinstance(v, (set, frozenset)):
                        v = sorted(v)
                    core[name] = v
            # "who it authorizes": published 2-FGME keeps no set, only competitors_authorized (the
            # whole other group) and the Reqs it holds back (waiting_reqs); reqs_to_send is its own
            # request on hold. Damped, it also keeps authorized_for (not in this list)
            held = {str(s): {"next": self.in_next.get(s, 1), "held": len(h), "lowest": min(h)}
                    for s, h in sorted(self.held.items()) if h}
        finally:
            if got:
                self.lock.release()
        return {
            "node": c.id, "phase": self.phase, "alive": self.is_alive(), "requests_left": self.left,
            "core": core, "reorder_held": held, "inbox_len": self.inbox.qsize(),
            "paho_out_len": len(getattr(self.client, "_out_messages", ())), "sent": self.sent,
            "locked": not got,
        }


class _Group:
    """The nodes of one process: built, subscribed, started, stopped, reported together."""

    def __init__(self, cfg: BenchConfig, prefix: str, ids: Sequence[int]) -> None:
        sizes = (cfg.nodes // 2, cfg.nodes - cfg.nodes // 2)
        cores = make_nodes(cfg.algorithm, sizes)
        if cfg.damping:
            for c in cores:
                c.damped = c.yield_once = True
        self.start_evt = threading.Event()
        self.nodes = [_Node(cores[i], cfg, prefix, self.start_evt) for i in ids]
        for n in self.nodes:  # subscribe before announce: wait for every SUBACK
            if not n.subscribed.wait(10):
                raise RuntimeError("a GME bench client did not get its SUBACK within 10 s")

    def start(self, t0: float) -> None:
        for n in self.nodes:
            n.t0 = t0
            n.start()
        self.start_evt.set()

    def errors(self) -> List[str]:
        return [e for n in self.nodes for e in n.errors]

    def finish(self, dump: bool) -> Dict[str, Any]:
        """Stop every node (bounded: `_GRACE_S` in all), then report; `dump` adds the states."""
        dumps = [n.dump() for n in self.nodes] if dump else []
        for n in self.nodes:
            n.stop = True
        end = time.monotonic() + _GRACE_S
        for n in self.nodes:
            n.join(max(0.0, end - time.monotonic()))
        stuck = [n.core.id for n in self.nodes if n.is_alive()]

        def close() -> None:
            for n in self.nodes:
                n.client.disconnect()
                n.client.loop_stop()

        closer = threading.Thread(target=close, daemon=True)  # paho's loop_stop joins unbounded
        closer.start()
        closer.join(max(1.0, end - time.monotonic()))
        sent: Dict[int, Counter] = {}
        delay: Dict[int, List[float]] = {}
        for n in self.nodes:
            for b, c in list(n.sent_by_bucket.items()):
                sent.setdefault(b, Counter()).update(c)
            for b, (s, k, m) in list(n.delay_by_bucket.items()):
                acc = delay.setdefault(b, [0.0, 0, 0])
                acc[0] += s
                acc[1] += k
                acc[2] = max(acc[2], m)
        return {
            "sent": sum(n.sent for n in self.nodes),
            "latencies": [x for n in self.nodes for x in n.latencies],
            "errors": self.errors(),
            "sent_by_bucket": {b: dict(c) for b, c in sent.items()},
            "delay_by_bucket": delay,
            "dumps": dumps,
            "stuck_threads": stuck,
            "clients_closed": not closer.is_alive(),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def _group_process(cfg_d: Dict[str, Any], prefix: str, ids: List[int], conn: Any) -> None:
    """One worker process: its nodes, driven by the parent over `conn` (ready / go / finish)."""
    try:
        group = _Group(BenchConfig(**cfg_d), prefix, ids)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    _, t0 = conn.recv()
    group.start(t0)
    while not conn.poll(0.1):
        if group.errors():
            conn.send(("error", "; ".join(group.errors())))
            break
    cmd, dump = conn.recv()
    conn.send(("report", group.finish(dump)))


class _Remote:
    """The parent's handle of a `_group_process`, with `_Group`'s interface."""

    def __init__(self, cfg: BenchConfig, prefix: str, ids: Sequence[int]) -> None:
        ctx = multiprocessing.get_context("spawn")  # no paho threads inherited half-way
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_group_process, args=(asdict(cfg), prefix, list(ids), child), daemon=True)
        self.proc.start()
        self._errors: List[str] = []

    def ready(self) -> None:
        if not self.conn.poll(60):
            raise RuntimeError("a GME bench process did not get ready within 60 s")
        kind, what = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"a GME bench process failed: {what}")

    def start(self, t0: float) -> None:
        self.conn.send(("go", t0))

    def errors(self) -> List[str]:
        while not self._errors and self.conn.poll():
            kind, what = self.conn.recv()
            if kind == "error":
                self._errors.append(what)
        return self._errors

    def finish(self, dump: bool) -> Dict[str, Any]:
        try:
            self.conn.send(("finish", dump))
            deadline = time.monotonic() + _GRACE_S + 5.0
            while time.monotonic() < deadline and self.conn.poll(max(0.0, deadline - time.monotonic())):
                kind, what = self.conn.recv()
                if kind == "report":
                    return what
                self._errors.append(what)
            raise TimeoutError("no report")
        except (OSError, EOFError, TimeoutError) as exc:
            return {"sent": 0, "latencies": [], "errors": self._errors + [f"process lost: {exc}"],
                    "sent_by_bucket": {}, "delay_by_bucket": {}, "dumps": [], "stuck_threads": [],
                    "clients_closed": False, "rss_mb": None}
        finally:
            self.proc.join(2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2.0)


def run_bench(cfg: BenchConfig) -> Dict[str, Any]:
    """Run the benchmark; never longer than `cfg.timeout_s` plus a bounded shutdown."""
    prefix = f"fog/gme-bench/{uuid.uuid4().hex[:8]}"
    events: List[Dict[str, Any]] = []
    lock = threading.Lock()
    dropped: List[int] = []
    ver = _client(prefix + "-verifier", cfg)
    got_sub = threading.Event()

    def on_message(c: Any, u: Any, m: Any) -> None:
        if m.topic.startswith("$SYS"):
            try:
                dropped.append(int(m.payload))
            except ValueError:
                pass
            return
        e = json.loads(m.payload)
        with lock:
            events.append(e)

    ver.on_message = on_message
    ver.on_subscribe = lambda c, u, mid, rc, p: got_sub.set()
    ver.subscribe([(f"{prefix}/events", 1), ("$SYS/broker/publish/messages/dropped", 0)])
    ver.loop_start()
    procs = max(1, min(cfg.procs, cfg.nodes))
    parts = [list(range(cfg.nodes))[p::procs] for p in range(procs)]
    groups: List[Any] = []
    try:
        if procs == 1:
            groups = [_Group(cfg, prefix, parts[0])]
        else:
            groups = [_Remote(cfg, prefix, ids) for ids in parts]
            for g in groups:
                g.ready()
        if not got_sub.wait(10):
            raise RuntimeError("the GME bench verifier did not get its SUBACK within 10 s")
    except BaseException:
        for g in groups:
            g.finish(False)
        ver.loop_stop()
        raise
    dropped_at_start = dropped[-1] if dropped else None
    t0 = time.monotonic()
    for g in groups:
        g.start(t0)
    deadline = t0 + cfg.timeout_s
    timed_out = True
    while time.monotonic() < deadline:
        with lock:
            exits = sum(1 for e in events if e["ev"] == "exit")
        if exits >= cfg.nodes * cfg.entries or any(g.errors() for g in groups):
            timed_out = False
            break
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    if not timed_out:
        time.sleep(0.3)  # the last events and the other nodes' last answers
    reports = [g.finish(timed_out) for g in groups]
    ver.disconnect()
    ver.loop_stop()
    with lock:
        evs = list(events)
    violations = _overlaps(evs)
    lat = sorted(x for r in reports for x in r["latencies"])
    served = sum(1 for e in evs if e["ev"] == "exit")
    msgs = sum(r["sent"] for r in reports)
    report: Dict[str, Any] = {
        "algorithm": cfg.algorithm,
        "damping": cfg.damping if cfg.algorithm == "2fgme" else None,  # RA1/RA2 have no variant
        "nodes": cfg.nodes,
        "entries_per_node": cfg.entries,
        "think_ms": cfg.think_ms,
        "cs_ms": cfg.cs_ms,
        "procs": procs,
        "messages": msgs,
        "messages_per_entry": round(msgs / served, 2) if served else None,
        "cs_entries": served,
        "latency_ms_mean": round(sum(lat) / len(lat), 2) if lat else None,
        "latency_ms_p95": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 2) if lat else None,
        "safety_violations": violations,
        "unserved_requests": cfg.nodes * cfg.entries - served,
        "errors": [e for r in reports for e in r["errors"]],
        "wall_s": round(elapsed, 2),
        "timed_out": timed_out,
        "broker_dropped": (dropped[-1] - dropped_at_start) if dropped and dropped_at_start is not None else None,
        "peak_rss_mb": max((r["rss_mb"] or 0) for r in reports),
        "timeline": _timeline(reports, cfg.bucket_s),
    }
    if timed_out:
        report["stuck_threads"] = sorted(i for r in reports for i in r["stuck_threads"])
        report["node_states"] = sorted((d for r in reports for d in r["dumps"]), key=lambda d: d["node"])
    return report


def _overlaps(evs: List[Dict[str, Any]]) -> int:
    """Pairs of CS intervals of different groups that overlap, on the shared monotonic clock."""
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
    return violations


def _timeline(reports: List[Dict[str, Any]], bucket_s: float) -> List[Dict[str, Any]]:
    """Per bucket: messages sent by kind, mean one-way delay (ms), largest inbox backlog."""
    sent: Dict[int, Counter] = {}
    delay: Dict[int, List[float]] = {}
    for r in reports:
        for b, c in r["sent_by_bucket"].items():
            sent.setdefault(int(b), Counter()).update(c)
        for b, (s, k, m) in r["delay_by_bucket"].items():
            acc = delay.setdefault(int(b), [0.0, 0, 0])
            acc[0] += s
            acc[1] += k
            acc[2] = max(acc[2], m)
    rows: List[Dict[str, Any]] = []
    for b in sorted(set(sent) | set(delay)):
        d: Optional[List[float]] = delay.get(b)
        rows.append({
            "t_s": round(b * bucket_s, 3),
            "sent": dict(sorted(sent.get(b, Counter()).items())),
            "delay_ms_mean": round(d[0] / d[1], 1) if d and d[1] else None,
            "inbox_max": int(d[2]) if d else 0,
        })
    return rows
