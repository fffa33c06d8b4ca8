"""Lock-guarded scaling (coordination = "fgme") in the real runtime: worker processes on the
session's Mosquitto, the test playing the agent (LocalRunner), then `fogctl locks` on real agents.

How "never an instance of operator s and one of s+1 in a round at once" is checked across
processes: every worker records its own round intervals (agent.instance.rounds: `enter` right
after the core call that started the round returns, `exit` right after the call that ended it,
before that call's outputs, among them the lock exit messages, are published), on
time.monotonic(), i.e. CLOCK_MONOTONIC, one clock shared by all processes of this host. With the
lock, a neighbour enters only after receiving our exit message, which we publish after our
`exit` stamp, so correct runs give disjoint intervals and any overlap is a real violation (no
tolerance needed, none used). The same check on the same scenario with coordination = "ack"
finds the overlap (the two rounds are started by the same simultaneous steering request and each
lasts at least a worker start-up), so the check is not vacuous.

"No send to a terminated instance": a test subscriber records every envelope published on the
inboxes; a terminated instance's last persisted channel positions (written at exit) say what it
delivered. An envelope to it numbered past those positions was never delivered: it was sent to a
terminated instance (lost). Exactly-once at the sink uses the existing verifier.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from foglab.tools.dataplane_bench import LocalRunner, pipeline_toml
from agent_process import ONLINE_BOUND
from tests.test_runtime_worker_broker import (RUNNERS, assert_exactly_once, expected_ids, start_pipeline, wait_for,
                                             wait_source_quiet)

pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]

NEIGHBOURS = ("validate", "in_zone")


def guarded_pipeline(coordination: str, rate: float, n: int) -> str:
    toml = pipeline_toml(
        "taxi",
        [
            {"name": "source", "kind": "source", "function": "agent.operators.taxi:source", "batch_size": 20,
             "linger_ms": 10.0, "params": {"seed": 3, "profile": "constant", "rate": rate, "max_records": n}},
            {"name": "validate", "function": "agent.operators.builtin:validate", "batch_size": 20, "linger_ms": 10.0},
            {"name": "in_zone", "function": "agent.operators.builtin:in_zone", "batch_size": 20, "linger_ms": 10.0},
            {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink",
             "batch_size": 20, "linger_ms": 10.0},
        ],
        scaling={"policy": "none"},  # only the steering requests below scale: same scenario twice
    )
    return toml.replace("[pipeline]\n", f'[pipeline]\ncoordination = "{coordination}"\n', 1)


class InboxTap:
    """Every envelope published on the cluster's inboxes: (dest, sender, epoch, seq, kind)."""

    def __init__(self, host: str, port: int, cluster: str) -> None:
        self.seen: List[Tuple[str, str, int, int, str]] = []
        self.ready = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"tap-{cluster}-{time.monotonic_ns()}")
        self.c.on_message = self._msg
        self.c.on_subscribe = lambda *a: self.ready.set()
        self.c.connect(host, port)
        self.c.subscribe(f"fog/{cluster}/inbox/+/+/+", qos=1)  # LocalRunner: per-node inboxes
        self.c.loop_start()
        assert self.ready.wait(10)

    def _msg(self, c: Any, u: Any, m: Any) -> None:
        try:
            v, sender, epoch, seq, kind, _ = json.loads(m.payload)
        except (ValueError, TypeError):
            return
        self.seen.append((m.topic.split("/")[4], sender, epoch, seq, kind))  # fog/c/inbox/<node>/<dest>/<writer>

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def overlaps(stats: List[Dict[str, Any]], lower: str, upper: str) -> List[Tuple[str, Dict[str, Any], str, Dict[str, Any]]]:
    """Pairs of rounds (instance of `lower`, instance of `upper`) whose intervals intersect."""
    inf = float("inf")
    rounds = {op: [(s["instance"], r) for s in stats if s.get("operator") == op for r in s.get("rounds") or []]
              for op in (lower, upper)}
    bad = []
    for a, ra in rounds[lower]:
        for b, rb in rounds[upper]:
            if ra["enter"] < (rb["exit"] if rb["exit"] is not None else inf) and \
                    rb["enter"] < (ra["exit"] if ra["exit"] is not None else inf):
                bad.append((a, ra, b, rb))
    return bad


def steer_together(runner: LocalRunner, instances: List[str], action: str) -> None:
    """The same steering request to several workers at once (as `fogctl scale` fans out)."""
    ws = [runner.workers[i] for i in instances]
    for w in ws:
        w.send("scale", action=action, count=1)


def run_scenario(runner: LocalRunner, mosquitto: Any, tmp_path: Path, coordination: str,
                 scale_in: bool) -> Dict[str, Any]:
    """validate-0 and in_zone-0 are asked to duplicate at the same instant; (optionally) their
    two copies are then asked to terminate at the same instant. Returns what the checks need.

    The source runs until every round is over and the copies got records, then it is paused: the
    rounds always happen under load. (It stopped at a fixed 2,400 records before: at load ~30 the
    copies were active only after the last one, and waiting for their first record timed out.)"""
    cluster = f"g{coordination}"
    most = 30000  # a bound for a run that goes wrong; the source is paused long before
    tap = InboxTap(mosquitto.host, mosquitto.port, cluster)
    try:
        procs = start_pipeline(runner, mosquitto, tmp_path, guarded_pipeline(coordination, 300.0, most), cluster)
        wait_for(lambda: procs["sink"].stats.get("recorded", 0) > 50, 30, "records to flow")
        steer_together(runner, [f"{op}-0" for op in NEIGHBOURS], "duplicate")

        def copies() -> Dict[str, str]:
            return {op: i for op in NEIGHBOURS for i in runner.spawned if i.startswith(op + "-")}

        def copies_active() -> bool:
            c = copies()
            return len(c) == 2 and all(runner.workers[i].stats.get("state") == "active" for i in c.values()) \
                and all(runner.workers[f"{op}-0"].stats.get("state") == "active" for op in NEIGHBOURS)

        wait_for(copies_active, 40, "both copies to be active")
        new = copies()
        wait_for(lambda: all(runner.workers[i].stats.get("records_in", 0) > 0 for i in new.values()), 40,
                 "the copies to receive records")
        if scale_in:
            steer_together(runner, list(new.values()), "terminate")
            wait_for(lambda: all(i in runner.exited for i in new.values()), 40, "both copies to terminate")
        src = procs["source"]
        src.send("set", paused=True)
        wait_source_quiet(src)
        n = int(src.stats["generated"])
        assert 0 < n < most, n
        want = len(expected_ids(3, "source-0", n))
        wait_for(lambda: procs["sink"].stats.get("recorded") == want, 40, "the sink to record everything")
        codes = runner.stop_all()
        time.sleep(0.2)  # the tap's last messages
    finally:
        tap.close()
    assert all(c == 0 for c in codes.values()), codes
    assert_exactly_once(tmp_path, n)
    stats = [w.stats for w in runner.workers.values()]
    return {"stats": stats, "new": new, "tap": tap.seen, "state_dir": tmp_path / "state"}


def undelivered_to_terminated(result: Dict[str, Any]) -> List[Tuple[str, str, int, int, str]]:
    """Envelopes on a terminated instance's inbox past what it had delivered when it exited."""
    bad = []
    for inst in result["new"].values():
        pos = json.loads((result["state_dir"] / f"{inst}.state.json").read_text())["inbound"]
        for dest, sender, epoch, seq, kind in result["tap"]:
            if dest != inst:
                continue
            e, nxt = pos.get(sender, (None, 1))
            if e is None or epoch > e or (epoch == e and seq >= nxt):
                bad.append((dest, sender, epoch, seq, kind))
    return bad


def test_fgme_neighbours_never_scale_together_and_nothing_is_lost(mosquitto, tmp_path: Path) -> None:
    """validate and in_zone are driven to scale out and back in at the same instants: with the
    lock their rounds are serialized (and did want to overlap: the later decision was taken
    before the earlier round ended), every record reaches the sink exactly once, nothing is
    sent to a terminated instance or a non-successor, no protocol error."""
    runner = LocalRunner(tmp_path, ready_timeout=ONLINE_BOUND)
    RUNNERS[:] = [runner]
    try:
        t0 = time.monotonic()
        r = run_scenario(runner, mosquitto, tmp_path, "fgme", scale_in=True)
    finally:
        runner.stop_all(timeout=10)
    stats = r["stats"]
    assert sum(s.get("sends_to_non_successor", 0) for s in stats) == 0
    assert sum(s.get("protocol_errors", 0) for s in stats) == 0
    assert undelivered_to_terminated(r) == []
    ops = ["source", "validate", "in_zone", "sink"]
    for lower, upper in zip(ops, ops[1:]):
        assert overlaps(stats, lower, upper) == [], f"{lower}|{upper}: neighbours in a round at once"
    rounds = {op: [(s["instance"], x) for s in stats if s.get("operator") == op for x in s.get("rounds") or []]
              for op in NEIGHBOURS}
    # 2 duplications (validate-0, in_zone-0) + 2 terminations (the copies), all finished
    assert sorted(x["kind"] for op in NEIGHBOURS for _, x in rounds[op]) == ["deleting"] * 2 + ["duplicating"] * 2
    assert all(x["exit"] is not None for op in NEIGHBOURS for _, x in rounds[op])
    # Not vacuous: in each phase the later round's decision came before the earlier round ended.
    serialized = 0
    for kind in ("duplicating", "deleting"):
        (a,) = [x for _, x in rounds["validate"] if x["kind"] == kind]
        (b,) = [x for _, x in rounds["in_zone"] if x["kind"] == kind]
        first, second = sorted((a, b), key=lambda x: x["enter"])
        if second["enter"] - second["wait"] < first["exit"]:
            serialized += 1
    assert serialized >= 1, rounds
    # Lock state at the end: nobody holds or wants a lock; every message counted apart.
    for s in stats:
        assert s["coordination"] == "fgme" and s["lock"]["state"] == "idle", s.get("lock")
    lock_out = sum(s.get("lock_out", 0) for s in stats)
    proto_out = sum(s.get("protocol_out", 0) for s in stats)
    n_rounds = sum(len(v) for v in rounds.values())
    # Paper cost of the scaling messages, unchanged by the lock: 2 duplications of an instance
    # with 1 pred + 1 succ: 2*(1+1)+1 = 5 each; 2 deletions: 2*(1+1) = 4 each (neighbours at the
    # time of the round: the other operator's copy may be one more neighbour).
    assert 18 <= proto_out <= 24, proto_out
    waits = sorted(x["wait"] for op in NEIGHBOURS for _, x in rounds[op])
    print("ROUNDS", json.dumps(rounds))
    print(f"FGME rounds={n_rounds} lock_out={lock_out} ({lock_out / n_rounds:.1f}/round) "
          f"protocol_out={proto_out} decision->round waits={waits} elapsed={time.monotonic() - t0:.1f}s")


def test_same_check_finds_neighbours_in_a_round_together_without_the_lock(mosquitto, tmp_path: Path) -> None:
    """coordination = "ack", the same simultaneous scale-out: the paper's protocol lets both
    neighbours run their rounds at once (it is safe for the data, not exclusive), and the
    interval check of the test above reports it."""
    runner = LocalRunner(tmp_path, ready_timeout=ONLINE_BOUND)
    RUNNERS[:] = [runner]
    try:
        r = run_scenario(runner, mosquitto, tmp_path, "ack", scale_in=False)
    finally:
        runner.stop_all(timeout=10)
    assert overlaps(r["stats"], *NEIGHBOURS), [s.get("rounds") for s in r["stats"]]
    assert all("lock" not in s and s.get("lock_out", 0) == 0 for s in r["stats"])


LOCK_PIPELINE = """
[pipeline]
name = "locks"
coordination = "fgme"
[scaling]
policy = "none"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
params = { seed = 3, profile = "constant", rate = 40.0 }
linger_ms = 5.0
[[operator]]
name = "validate"
function = "agent.operators.builtin:validate"
linger_ms = 5.0
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
linger_ms = 5.0
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


class EventTap:
    """Every event published on fog/<cluster>/events (what `fogctl watch` reads)."""

    def __init__(self, host: str, port: int, cluster: str) -> None:
        self.events: List[Dict[str, Any]] = []
        ready = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"evtap-{cluster}")
        self.c.on_message = lambda c, u, m: self.events.append(json.loads(m.payload))
        self.c.on_subscribe = lambda *a: ready.set()
        self.c.connect(host, port)
        self.c.subscribe(f"fog/{cluster}/events", qos=1)
        self.c.loop_start()
        assert ready.wait(10)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def own_lock_states(tmp: Path) -> Dict[Tuple[str, str], str]:
    """(instance, "a|b") -> 2-FGME state, from each worker's own persisted core (the agents'
    state dirs; written after every lock message), independent of MQTT and of the agent."""
    ops = ["source", "validate", "in_zone", "sink"]
    out: Dict[Tuple[str, str], str] = {}
    for f in tmp.glob("state-*/**/*.state.json"):
        try:
            core = json.loads(f.read_text()).get("scaling") or {}
        except (OSError, ValueError):
            continue  # being replaced right now: the caller retries
        for b, node in ((core.get("fgme") or {}).get("locks") or {}).items():
            if 0 <= int(b) < len(ops) - 1:
                out[(core["instance_id"], f"{ops[int(b)]}|{ops[int(b) + 1]}")] = node["state"]
    return out


def test_fogctl_locks_on_real_agents_shows_who_requests_and_who_is_in_the_cs(capsys, mosquitto, tmp_path) -> None:
    """Three real agents, a coordination = "fgme" pipeline. The sink is slowed down so that
    in_zone's duplication round (it waits for the sink's ack, FIFO behind the sink's backlog)
    holds the CS of validate|in_zone for seconds; validate, asked to duplicate meanwhile, requests
    that lock. `fogctl locks` (table and --json) must show exactly that, and the same states as
    the workers' own persisted lock nodes; the lock events reach the events topic."""
    import uuid

    from agent.events import parse
    from agent.fogctl.views import event_line
    from agent.node.deploy import RpcClient
    from tests.test_fogctl_agents import Agent, fogctl
    from tests.test_fogctl_agents import wait_for as poll

    cluster = "l" + uuid.uuid4().hex[:8]
    agents = [Agent(tmp_path, mosquitto, cluster, n) for n in ("l1", "l2", "l3")]
    tap = EventTap(mosquitto.host, mosquitto.port, cluster)
    try:
        assert poll(lambda: [n["status"] for n in fogctl(capsys, mosquitto, cluster, "--json", "status")["nodes"]]
                    == ["online"] * 3, ONLINE_BOUND)
        p = tmp_path / "locks.toml"
        p.write_text(LOCK_PIPELINE)
        fogctl(capsys, mosquitto, cluster, "--json", "deploy", str(p))
        names = ["source|validate", "validate|in_zone", "in_zone|sink"]

        def all_idle() -> Any:
            doc = fogctl(capsys, mosquitto, cluster, "--json", "locks")
            bs = doc["boundaries"]
            ok = [b["boundary"] for b in bs] == names and all(len(b["idle"]) == 2 and not b["in_cs"] for b in bs)
            return doc if ok else None

        assert poll(all_idle, 40), fogctl(capsys, mosquitto, cluster, "--json", "locks")
        topo = fogctl(capsys, mosquitto, cluster, "--json", "topology", "locks")
        where = {i["id"]: i["node"] for o in topo["pipelines"][0]["operators"] for i in o["instances"]}
        vk, zk, sk = "locks.validate.0", "locks.in_zone.0", "locks.sink.0"
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as rpc:
            assert rpc.call(where[sk], {"op": "set", "instance": sk, "fields": {"service_time_ms": 400.0}})["ok"]
            time.sleep(1.5)  # a backlog builds up in front of the sink (flow control bounds it)
            assert "accepted" in fogctl(capsys, mosquitto, cluster, "scale", "in_zone", "+1")
            time.sleep(0.3)
            assert "accepted" in fogctl(capsys, mosquitto, cluster, "scale", "validate", "+1")

            def contended() -> Any:
                doc = fogctl(capsys, mosquitto, cluster, "--json", "locks")
                b = {x["boundary"]: x for x in doc["boundaries"]}.get("validate|in_zone")
                if not b or b["in_cs"] != [zk] or b["requesting"] != [vk]:
                    return None
                own = own_lock_states(tmp_path)
                shown = {(i, x["boundary"]): st for x in doc["boundaries"]
                         for st in ("in_cs", "requesting", "idle") for i in x[st]}
                return (doc, own) if shown == own else None

            got = poll(contended, 30, step=0.1)
            assert got, (fogctl(capsys, mosquitto, cluster, "--json", "locks"), own_lock_states(tmp_path))
            doc, own = got
            b = {x["boundary"]: x for x in doc["boundaries"]}
            assert b["validate|in_zone"]["groups_in_cs"] == ["in_zone"]
            assert b["validate|in_zone"]["groups_requesting"] == ["validate"]
            # in_zone took its locks in boundary order: it holds validate|in_zone and holds or
            # still requests in_zone|sink (the sink answers its Req behind the same backlog).
            assert zk in b["in_zone|sink"]["in_cs"] + b["in_zone|sink"]["requesting"]
            assert b["source|validate"]["in_cs"] == [vk]  # validate holds the lower one, wants the next
            text = fogctl(capsys, mosquitto, cluster, "locks")
            row = next(line.split() for line in text.splitlines() if line.startswith("validate|in_zone"))
            assert row[:4] == ["validate|in_zone", "in_zone", zk, vk]
            # Let the sink catch up: both rounds run (one after the other), every lock is free again.
            assert rpc.call(where[sk], {"op": "set", "instance": sk, "fields": {"service_time_ms": 0.0}})["ok"]

        def done() -> Any:
            doc = fogctl(capsys, mosquitto, cluster, "--json", "locks")
            bs = doc["boundaries"]
            return all(not b["in_cs"] and not b["requesting"] for b in bs) and \
                len({i for b in bs for i in b["idle"]}) == 6
        assert poll(done, 40), fogctl(capsys, mosquitto, cluster, "--json", "locks")
        evs = [parse(e) for e in tap.events if str(e.get("type", "")).startswith("lock_")]
        mine = [(e.instance, e.type.value) for e in evs if e.detail.get("boundary") == "validate|in_zone"]
        for inst in (zk, vk):
            assert [t for i, t in mine if i == inst][:3] == ["lock_request", "lock_enter", "lock_exit"], mine
        line = event_line(next(e for e in evs if e.instance == vk and e.type.value == "lock_enter"
                              and e.detail.get("boundary") == "validate|in_zone"))
        assert f"{vk} lock_enter" in line and "boundary=validate|in_zone" in line
    finally:
        tap.close()
        for a in agents:
            a.stop()
