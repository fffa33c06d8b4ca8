"""Discrete-event simulator of the GME cores: think / request / CS / exit loops over timed links.

Why: the thesis compares 2-FGME, RA1 and RA2 on messages, concurrent occupancy and entry latency
(section 5.3). This driver runs the same sans-IO cores as the checker, with time in ms:
each node thinks P ms, requests, stays `cs_ms` in the CS, exits, `entries` times. Every ordered
pair of nodes is a FIFO link with a per-message delay drawn from `delay_ms * U(0.5, 1.5)`
(a message never overtakes an earlier one on the same link). The scheduler is a heap of
(time, seq, event), seeded, so a run repeats exactly (SimPy's design).

`send_ms` adds what a publisher on MQTT does and independent link delays do not: each node's
messages leave through ONE queue, one after another (a paho client's outgoing queue drained
through its in-flight window; on the bench, one GIL for all clients), each taking
`send_ms * U(0.5, 1.5)`. A node that multicasts 11 Ends at once then delays its own later
messages, including the Acks others wait for, by its own backlog, and the receivers act on what
it decided long ago. This is the delivery model under which 2-FGME's authorization churn feeds
itself at 24 nodes (docs/gme.md, "24 nodes on the broker"); `max_messages` bounds such a run.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from agent.protocol.gme_base import Entered, GmeState, Send
from foglab.sim.gme_check import make_nodes

__all__ = ["GmeSimConfig", "GmeSimResult", "simulate"]


@dataclass(frozen=True)
class GmeSimConfig:
    algorithm: str = "2fgme"
    nodes: int = 12
    entries: int = 10
    think_ms: float = 1000.0
    cs_ms: float = 1000.0
    delay_ms: float = 1.0
    seed: int = 0
    start_spread_ms: Optional[float] = None  # first request in U(0, spread); default think_ms
    max_time_ms: float = 1e9
    send_ms: float = 0.0  # per-message service time of each node's single outgoing queue
    max_messages: Optional[int] = None  # stop (requests unserved) after this many messages
    damping: bool = False  # 2-FGME's DEVIATIONS 4 and 5 (agent/protocol/gme_fgme.py)


@dataclass
class GmeSimResult:
    config: GmeSimConfig
    messages: int = 0
    by_kind: Dict[str, int] = field(default_factory=dict)
    entries: int = 0
    latencies_ms: List[float] = field(default_factory=list)
    safety_violations: int = 0
    unserved_requests: int = 0
    # per group: list of (time_ms, requesting_or_in_cs, in_cs)
    timeline: Dict[int, List[Tuple[float, int, int]]] = field(default_factory=dict)
    end_ms: float = 0.0
    # messages sent per simulated second, and the largest send-queue wait (ms) in that second
    sent_per_s: List[int] = field(default_factory=list)
    send_wait_ms_max: List[float] = field(default_factory=list)

    def occupancy(self, group: int) -> Dict[str, float]:
        """Max and time-weighted mean of in-CS / requesting while the group holds the CS."""
        tl = self.timeline.get(group, [])
        mx_cs = max((c for _, _, c in tl), default=0)
        mx_rq = max((r for _, r, _ in tl), default=0)
        busy = cs_area = rq_area = 0.0
        for (t0, r, c), (t1, _, _) in zip(tl, tl[1:]):
            if c > 0:
                busy += t1 - t0
                cs_area += c * (t1 - t0)
                rq_area += r * (t1 - t0)
        return {
            "max_in_cs": mx_cs,
            "max_requesting": mx_rq,
            "mean_in_cs": cs_area / busy if busy else 0.0,
            "mean_requesting": rq_area / busy if busy else 0.0,
        }

    def summary(self) -> Dict[str, object]:
        lat = sorted(self.latencies_ms)
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else 0.0
        return {
            "algorithm": self.config.algorithm,
            "damping": self.config.damping if self.config.algorithm == "2fgme" else None,
            "nodes": self.config.nodes,
            "entries_per_node": self.config.entries,
            "messages": self.messages,
            "messages_by_kind": dict(sorted(self.by_kind.items())),
            "messages_per_entry": round(self.messages / self.entries, 2) if self.entries else None,
            "cs_entries": self.entries,
            "latency_ms_mean": round(sum(lat) / len(lat), 3) if lat else None,
            "latency_ms_p95": round(p95, 3),
            "occupancy": {str(g): self.occupancy(g) for g in sorted(self.timeline)},
            "safety_violations": self.safety_violations,
            "unserved_requests": self.unserved_requests,
            "simulated_ms": round(self.end_ms, 3),
            "sent_per_s": self.sent_per_s,
            "send_wait_ms_max": [round(x, 1) for x in self.send_wait_ms_max],
        }


def simulate(cfg: GmeSimConfig) -> GmeSimResult:
    if cfg.nodes < 2:
        raise ValueError(f"need at least 2 nodes, got {cfg.nodes}")
    sizes = (cfg.nodes // 2, cfg.nodes - cfg.nodes // 2)
    nodes = make_nodes(cfg.algorithm, sizes)
    if cfg.damping:
        for n in nodes:
            n.damped = n.yield_once = True  # type: ignore[attr-defined]
    rng = random.Random(cfg.seed)
    res = GmeSimResult(cfg)
    heap: List[Tuple[float, int, str, int, object]] = []
    seq = 0
    link_free: Dict[Tuple[int, int], float] = {}
    send_free: Dict[int, float] = {}  # node -> when its outgoing queue is empty
    left = [cfg.entries] * len(nodes)
    asked_at: Dict[int, float] = {}
    kinds: Counter = Counter()
    groups = sorted({n.group for n in nodes})
    count = {g: [0, 0] for g in groups}  # group -> [requesting or in CS, in CS]
    res.timeline = {g: [(0.0, 0, 0)] for g in groups}

    def push(t: float, what: str, node: int, payload: object = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, what, node, payload))

    def mark(t: float, g: int) -> None:
        res.timeline[g].append((t, count[g][0], count[g][1]))

    def perform(t: float, src: int, outs: List[object]) -> None:
        for o in outs:
            if isinstance(o, Send):
                res.messages += 1
                kinds[o.message.kind] += 1
                sec = int(t // 1000.0)
                while len(res.sent_per_s) <= sec:
                    res.sent_per_s.append(0)
                    res.send_wait_ms_max.append(0.0)
                res.sent_per_s[sec] += 1
                leave = t
                if cfg.send_ms > 0:
                    leave = max(t, send_free.get(src, 0.0)) + cfg.send_ms * (0.5 + rng.random())
                    send_free[src] = leave
                    res.send_wait_ms_max[sec] = max(res.send_wait_ms_max[sec], leave - t)
                key = (src, o.to)
                at = max(leave + cfg.delay_ms * (0.5 + rng.random()), link_free.get(key, 0.0))
                link_free[key] = at
                push(at, "deliver", o.to, o.message)
            elif isinstance(o, Entered):
                g = nodes[src].group
                if any(count[h][1] for h in groups if h != g):
                    res.safety_violations += 1
                count[g][1] += 1
                mark(t, g)
                res.entries += 1
                res.latencies_ms.append(t - asked_at.pop(src))
                push(t + cfg.cs_ms, "exit", src)

    spread = cfg.think_ms if cfg.start_spread_ms is None else cfg.start_spread_ms
    for n in nodes:
        push(rng.uniform(0, spread), "request", n.id)
    t = 0.0
    while heap:
        t, _, what, i, payload = heapq.heappop(heap)
        if t > cfg.max_time_ms or (cfg.max_messages is not None and res.messages >= cfg.max_messages):
            break
        node = nodes[i]
        if what == "request":
            left[i] -= 1
            asked_at[i] = t
            count[node.group][0] += 1
            mark(t, node.group)
            perform(t, i, node.request())
        elif what == "exit":
            count[node.group][0] -= 1
            count[node.group][1] -= 1
            mark(t, node.group)
            perform(t, i, node.exit())
            if left[i] > 0:
                push(t + cfg.think_ms, "request", i)
        else:
            perform(t, i, node.receive(payload))  # type: ignore[arg-type]
    res.end_ms = t
    res.by_kind = dict(kinds)
    res.unserved_requests = sum(left) + sum(1 for n in nodes if n.state is not GmeState.IDLE)
    return res


def plot(result: GmeSimResult, path: str) -> None:
    """Thesis figure 5.2 style: group 0 above the axis, group 1 below; requesting vs in CS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    styles = {0: (1, "tab:green", "tab:red"), 1: (-1, "tab:blue", "tab:purple")}
    for g, tl in sorted(result.timeline.items()):
        sign, c_rq, c_cs = styles.get(g, (1, "gray", "black"))
        ts = [p[0] / 1000.0 for p in tl]
        ax.step(ts, [sign * p[1] for p in tl], where="post", color=c_rq, label=f"group {g} requesting or in CS")
        ax.step(ts, [sign * p[2] for p in tl], where="post", color=c_cs, label=f"group {g} in CS")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("nodes (group 1 below the axis)")
    c = result.config
    ax.set_title(f"{c.algorithm}: {c.nodes} nodes, P={c.think_ms:g} ms, inCS={c.cs_ms:g} ms")
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
