"""`fog-agent bench move`: what moving a node's instances costs the data, with per-node inboxes
and with the shared inbox format of before, alternated in the same run (docs/security.md, "Who
may read an inbox").

A move: `drain` (the node's keepers hand over to other nodes with their identity) or `rehome`
(the node's agent and workers are SIGKILLed; after `dead_after` the survivors start its
instances elsewhere). Per-node inboxes drop at delivery what was queued or sent for the old
node's topic; the new incarnation's replay request brings it back once its predecessors' tables
name its new node. Measured, per moved instance, from the move (the drain request, the kill) to
the first envelope the new incarnation sends downstream: its first data batch (source, in_zone)
or its first ack (the sink acks only what it recorded). Seen on the bus by a tap on `inbox/#` (a
private broker without ACL). Then the source pauses and every record id is checked at the sink
(`foglab.tools.verify`) until none is missing (at most 60 s, `tail_s`): lost and duplicated must be 0.

A tool: runs agents and a private broker on this machine, never imported on a fog node.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["bench_move", "PIPELINE"]

KEEPERS = ("mv.source.0", "mv.in_zone.0", "mv.sink.0")


def pipeline(rate: float) -> str:
    from foglab.tools.dataplane_bench import pipeline_toml

    return pipeline_toml("mv", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:source", "batch_size": 20,
         "linger_ms": 50, "params": {"seed": 7, "profile": "constant", "rate": float(rate)}},
        {"name": "in_zone", "function": "agent.operators.builtin:in_zone", "batch_size": 20, "linger_ms": 50},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink"},
    ], scaling={"policy": "none"})


PIPELINE = pipeline(200.0)


class _Tap:
    """Every envelope on the cluster's inboxes (either format): (monotonic time, sender, epoch, kind)."""

    def __init__(self, host: str, port: int, cluster: str) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.lock = threading.Lock()
        self.seen: List[Tuple[float, str, int, str]] = []
        self.topics: Dict[Tuple[str, int], Dict[str, int]] = {}  # (sender, epoch) -> {topic: envelopes}
        ready = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"movetap-{cluster}")
        self.c.on_message = self._msg
        self.c.on_subscribe = lambda *a: ready.set()
        self.c.connect(host, port)
        self.c.subscribe(f"fog/{cluster}/inbox/#", qos=0)
        self.c.loop_start()
        if not ready.wait(10):
            raise RuntimeError("the inbox tap could not subscribe")

    def _msg(self, c: Any, u: Any, m: Any) -> None:
        try:
            msg = json.loads(m.payload)
            # a data batch may carry a 7th element, its floors (agent.dataplane.envelope)
            _, sender, epoch, _, kind, body = msg[:6] if isinstance(msg, list) and len(msg) == 7 else msg
        except (ValueError, TypeError):
            return
        if kind == "a" and (not isinstance(body, list) or len(body) != 2 or not body[1]):
            kind = "a0"  # an ack of nothing: a new incarnation's replay request, not a record through
        with self.lock:
            self.seen.append((time.monotonic(), str(sender), int(epoch), str(kind)))
            per = self.topics.setdefault((str(sender), int(epoch)), {})
            per[m.topic] = per.get(m.topic, 0) + 1

    def first_after(self, sender: str, epoch: int, kind: str, since: float) -> Optional[float]:
        with self.lock:
            ts = [t for t, s, e, k in self.seen if s == sender and e > epoch and k == kind and t >= since]
        return min(ts) - since if ts else None

    def epoch_of(self, sender: str) -> int:
        with self.lock:
            return max((e for _, s, e, _ in self.seen if s == sender), default=-1)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def _hosts(mon: Any) -> Dict[str, str]:
    with mon._lock:
        return {i["id"]: n for n, doc in mon.states.items() if mon.status.get(n) == "online"
                for i in doc.get("instances", []) if i.get("status") == "active"}


def move_once(workdir: Path, per_node: bool, kind: str, rate: float = 200.0, dead_after: float = 3.0,
              timeout: float = 60.0) -> Dict[str, Any]:
    """One fleet (m1 alone at deploy time, so it hosts the three keepers; then m2, m3), one move
    of m1's instances, the verdict. Seconds from the move to each keeper's first envelope
    downstream in its new incarnation."""
    import psutil

    from agent.config import load_pipeline_text
    from agent.node.deploy import RpcClient
    from foglab.tools.demo import Fleet, Monitor
    from foglab.tools.verify import verify

    cluster = "mv" + uuid.uuid4().hex[:6]
    fleet = Fleet(workdir, nodes=("m1",), slots=4, cluster=cluster, state_period=0.5, heartbeat_period=0.2,
                  shutdown_timeout=8.0, dead_after=dead_after if kind == "rehome" else 0.0, inbox_per_node=per_node)
    fleet.start()
    mon = Monitor(fleet.host, fleet.port, cluster)
    tap = _Tap(fleet.host, fleet.port, cluster)
    text = pipeline(rate)
    out: Dict[str, Any] = {"per_node": per_node, "kind": kind}
    try:
        if not mon.wait(lambda m: m.status.get("m1") == "online", 30):
            raise RuntimeError("m1 did not come up")
        fleet.deploy(text)
        if not mon.wait(lambda m: all(_hosts(m).get(k) == "m1" for k in KEEPERS), 30):
            raise RuntimeError(f"keepers not on m1: {_hosts(mon)}")
        fleet.nodes = ("m1", "m2", "m3")
        for node in ("m2", "m3"):
            fleet.start_agent(node)
        if not mon.wait(lambda m: all(m.status.get(n) == "online" for n in fleet.nodes), 30):
            raise RuntimeError("m2/m3 did not come up")
        time.sleep(2.0)  # records flow, every agent has every hosted record
        epochs = {k: tap.epoch_of(k) for k in KEEPERS}
        start = time.monotonic()
        if kind == "drain":
            with RpcClient(fleet.host, fleet.port, cluster) as client:
                reply = client.call("m1", {"op": "drain", "node": "m1"}, timeout=10)
            if not reply.get("ok"):
                raise RuntimeError(f"drain refused: {reply}")
        else:
            agent = psutil.Process(fleet.procs["m1"].pid)
            for p in [agent] + agent.children(recursive=True):
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            fleet.procs["m1"].wait()
        firsts: Dict[str, Optional[float]] = {}
        deadline = start + timeout
        while time.monotonic() < deadline:
            firsts = {k: tap.first_after(k, epochs[k], "a" if k.endswith("sink.0") else "d", start) for k in KEEPERS}
            if all(v is not None for v in firsts.values()):
                break
            time.sleep(0.1)
        out["first_downstream_s"] = {k.split(".")[1]: (round(v, 3) if v is not None else None) for k, v in firsts.items()}
        # The source is paused where it runs now: wait until the state records show every keeper
        # active on its new node (a fast move beats them; not paused, the source would keep
        # producing while the fleet stops, and what was in flight would count as lost).
        mon.wait(lambda m: all(_hosts(m).get(k) not in (None, "m1") for k in KEEPERS), max(5.0, deadline - time.monotonic()))
        out["moved_to"] = {k.split(".")[1]: _hosts(mon).get(k) for k in KEEPERS}
        # where each new incarnation wrote, and what it kept back (diagnostics of a slow or lossy move)
        out["new_topics"] = {k.split(".")[1]: {t.split("/", 3)[3]: n for (s, e), ts in tap.topics.items()
                                               if s == k and e > epochs[k] for t, n in ts.items()} for k in KEEPERS}
        out["kept"] = {k.split(".")[1]: {x: mon.stats_of(k).get(x) for x in
                                         ("unrouted", "held", "foreign_inbox", "refused_nodes", "unrouted_dropped",
                                          "silent_links_replayed", "moved_resent", "replays_asked_again")}
                       for k in KEEPERS}
        src_node = _hosts(mon).get(KEEPERS[0])
        if not src_node:
            raise RuntimeError(f"the source's node is unknown after the move: {_hosts(mon)}")
        with RpcClient(fleet.host, fleet.port, cluster) as client:
            client.call(src_node, {"op": "set", "instance": KEEPERS[0], "fields": {"paused": True}}, timeout=10)
        # The tail: until every generated record is at the sink (the verdict itself), at most 60 s;
        # a loaded machine can hold a replay back for a while, which is slow, not lost.
        paused = time.monotonic()
        v = verify(load_pipeline_text(text), fleet.sink_dir)
        while time.monotonic() - paused < 60 and (v.lost or v.generated == 0):
            time.sleep(1.0)
            v = verify(load_pipeline_text(text), fleet.sink_dir)
        out["tail_s"] = round(time.monotonic() - paused, 1)
    finally:
        tap.close()
        mon.close()
        fleet.stop()
    v = verify(load_pipeline_text(text), fleet.sink_dir)
    out.update(generated=v.generated, lost=v.lost, duplicated=v.duplicated, unexpected=v.unexpected)
    return out


def bench_move(runs: int = 2, kinds: Tuple[str, ...] = ("drain", "rehome"), rate: float = 200.0,
               workdir: Optional[Path] = None) -> Dict[str, Any]:
    """`runs` moves of each kind in each inbox format, alternated (shared, per-node, shared, ...)
    so that both see the same machine; medians per kind and format."""
    base = workdir or Path(tempfile.mkdtemp(prefix="fog-move-"))
    results: List[Dict[str, Any]] = []
    for i in range(runs):
        for kind in kinds:
            for per_node in (False, True):
                r = move_once(base / f"{kind}-{'node' if per_node else 'shared'}-{i}", per_node, kind, rate)
                results.append(r)
    summary: Dict[str, Any] = {}
    for kind in kinds:
        for per_node in (False, True):
            rs = [r for r in results if r["kind"] == kind and r["per_node"] == per_node]
            worst = [max((v for v in r["first_downstream_s"].values() if v is not None), default=None) for r in rs]
            got = [w for w in worst if w is not None]
            summary[f"{kind}/{'per_node' if per_node else 'shared'}"] = {
                "all_moved_s_median": round(statistics.median(got), 3) if got else None,
                "all_moved_s": worst,
                "lost": sum(r["lost"] for r in rs), "duplicated": sum(r["duplicated"] for r in rs)}
    return {"runs": results, "summary": summary, "workdir": str(base)}
