"""Chaining (docs/runtime.md, "Chaining"): consecutive instances in one worker process, batches
handed over in memory. First the sans-IO instances on their own (hand-off, credit, acks, replay),
then chain processes on the real broker: exactly once, kill -9 of the chain mid-stream, a
scale-out of a chained operator."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any, Deque, Dict, List, Tuple

import pytest

from agent import topics
from agent.config import load_pipeline_text
from agent.dataplane.envelope import Envelope, Kind, decode, encode_data
from agent.instance.commands import Handoff, Publish
from agent.instance.core import Instance
from agent.instance.events import EnvelopeHanded, EnvelopeReceived, PubAcked, PublishAccepted, Restarted, Started, Tick
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from foglab.sim.instance_check import BROKER, CLUSTER, WALL0, MemoryMap, MemorySink, pipeline_text
from foglab.tools.dataplane_bench import initial_specs

from test_runtime_worker_broker import (
    assert_exactly_once, expected_ids, step_load_pipeline, taxi_pipeline, wait_for, wait_source_quiet,
)
from test_runtime_worker_broker import runner  # noqa: F401 - the fixture (a LocalRunner, stopped after)

TOML = pipeline_text(batch=1, window=4)
PIPELINE = load_pipeline_text(TOML, "test pipeline")


# ---- sans-IO: two instances of one process -----------------------------------------------------------


def make(operator: str, local: Tuple[str, ...], store: List[Tuple[str, int]]) -> Instance:
    names = ["source", "op", "sink"]
    i = names.index(operator)
    spec = InstanceSpec(f"{operator}-0", operator, "n1", CLUSTER, "chk", TOML, BROKER,
                        succs=(f"{names[i + 1]}-0",) if i < 2 else (), preds=(f"{names[i - 1]}-0",) if i else (),
                        keeper=True, state_dir="/nonexistent", heartbeat_period=3600.0)
    op = MemorySink(store, set()) if operator == "sink" else MemoryMap()
    return Instance(spec, PIPELINE, op, local=frozenset(local))


class Shell:
    """Performs the commands of several instances as a chain does: publishes reach a list (the
    broker) and are PUBACKed at once; hand-offs are queued and delivered in order."""

    def __init__(self, *insts: Instance) -> None:
        self.by_id = {i.spec.instance: i for i in insts}
        self.broker: List[Tuple[str, bytes]] = []
        self.handed: Deque[Tuple[str, Envelope]] = deque()
        self.log: List[Tuple[str, Envelope]] = []  # every hand-off, delivered or not

    def run(self, inst: Instance, cmds: List[Any], now: float) -> None:
        for c in cmds:
            if isinstance(c, Publish):
                self.broker.append((c.topic, c.payload))
                n = len(self.broker)
                self.run(inst, inst.handle(PublishAccepted(c.token, n), now) + inst.handle(PubAcked(n), now), now)
            elif isinstance(c, Handoff):
                self.handed.append((c.dest, c.envelope))
                self.log.append((c.dest, c.envelope))

    def feed(self, inst: Instance, ev: Any, now: float) -> None:
        self.run(inst, inst.handle(ev, now), now)

    def deliver(self, now: float) -> None:
        while self.handed:
            dest, env = self.handed.popleft()
            self.feed(self.by_id[dest], EnvelopeHanded(env), now)


def started_pair(store: List[Tuple[str, int]]) -> Tuple[Instance, Instance, Shell]:
    """op-0 -> sink-0 in one process (each knows the other as local), both started."""
    op, sink = make("op", ("sink-0",), store), make("sink", ("op-0",), store)
    sh = Shell(op, sink)
    sh.feed(sink, Started(WALL0), 0.0)
    sh.feed(op, Started(WALL0), 0.0)
    return op, sink, sh


def test_a_chained_link_hands_batches_in_memory_with_credit_and_end_to_end_acks() -> None:
    store: List[Tuple[str, int]] = []
    op, sink, sh = started_pair(store)
    inbox = topics.inbox(CLUSTER, "op-0", "n1")
    for s in range(1, 11):
        sh.feed(op, EnvelopeReceived(inbox, encode_data("source-0", 0, s, [("src", s, {"v": s})])), 0.1)
    for t in range(10):
        sh.feed(op, Tick(WALL0), 0.1 + t * 0.001)
    # Credit: a window of 4 batches to the chained sink, none acked yet: the rest waits.
    data = [e for d, e in sh.handed if e.kind is Kind.DATA]
    assert len(data) == 4 and all(d == "sink-0" for d, _ in sh.handed)
    assert [e.seq for e in data] == [1, 2, 3, 4] and data[0].body == [("src", 1, {"v": 1})]
    assert not any(t.startswith(topics.inbox(CLUSTER, "sink-0", "")[:-1]) for t, _ in sh.broker)
    # ... and nothing is acked upstream: the records are only handed, not processed downstream.
    assert not [p for t, p in sh.broker if t == topics.inbox(CLUSTER, "source-0", "n1")]
    for t in range(20):  # deliver, let the sink record and ack in memory, and go on
        sh.deliver(0.2 + t * 0.01)
        sh.feed(sink, Tick(WALL0), 0.2 + t * 0.01 + 0.006)
        sh.deliver(0.2 + t * 0.01 + 0.006)
        sh.feed(op, Tick(WALL0), 0.2 + t * 0.01 + 0.007)
    assert sorted(store) == [("src", s) for s in range(1, 11)]  # each record once
    assert op.outputs.links["sink-0"].inflight == 0 and op.stats["handed_out"] == 10 and sink.stats["handed_in"] == 10
    acks = [decode(p) for t, p in sh.broker if t == topics.inbox(CLUSTER, "source-0", "n1")]
    assert acks and list(acks[-1].body) == [0, 10]  # end to end: acked once the sink recorded it
    assert [e.kind for d, e in sh.log if d == "op-0"] and all(e.kind is Kind.ACK for d, e in sh.log if d == "op-0")


def test_a_restarted_chained_successor_gets_the_unacked_batches_again_unchanged_by_its_operator() -> None:
    """A replay to a chained successor hands the batches again, renumbered in its new epoch, from
    our replay buffer: a successor that changed a record in place did not change those."""
    store: List[Tuple[str, int]] = []
    op, sink, sh = started_pair(store)
    inbox = topics.inbox(CLUSTER, "op-0", "n1")
    for s in (1, 2):
        sh.feed(op, EnvelopeReceived(inbox, encode_data("source-0", 0, s, [("src", s, {"v": s})])), 0.1)
    sh.feed(op, Tick(WALL0), 0.1)
    sh.feed(op, Tick(WALL0), 0.101)
    first = [e for _, e in sh.handed]
    assert [e.seq for e in first] == [1, 2]
    first[0].body[0][2]["v"] = "changed by the successor"  # what a careless operator might do
    sh.handed.clear()  # the sink died before it got them
    again = make("sink", ("op-0",), store)
    sh.by_id["sink-0"] = again
    state = {"epoch": 0, "inbound": {}}
    sh.feed(again, Restarted(WALL0, state), 1.0)  # acks [0, 0] to op in its new epoch, by hand-off
    sh.deliver(1.0)
    handed = [e for d, e in sh.log[len(first):] if d == "sink-0" and e.kind is Kind.DATA]
    assert [(e.seq, len(e.body)) for e in handed] == [(3, 0), (4, 1), (5, 1)]  # the replay marker, then the replay
    replayed = handed[1:]
    assert [e.epoch for e in replayed] == [0, 0]
    assert replayed[0].body == [("src", 1, {"v": 1})]  # the original record, not the changed one
    assert op.stats["replayed_batches"] == 2


def test_a_successor_that_keeps_its_records_is_handed_the_batch_itself_any_other_a_copy() -> None:
    """The hand-off copies the records only for a successor that may change them in place: one
    whose operator declares `keeps_records` (a `@passes_records` map, the null sink) gets the
    replay buffer's own batch; the others still get a copy (the test above)."""
    store: List[Tuple[str, int]] = []
    for keeps in (True, False):
        op, sink, sh = started_pair(store)
        op.outputs.local_keeps = frozenset({"sink-0"}) if keeps else frozenset()
        inbox = topics.inbox(CLUSTER, "op-0", "n1")
        sh.feed(op, EnvelopeReceived(inbox, encode_data("source-0", 0, 1, [("src", 1, {"v": 1})])), 0.1)
        sh.feed(op, Tick(WALL0), 0.1)
        handed = [e for _, e in sh.handed if e.kind is Kind.DATA]
        kept = op.outputs.links["sink-0"].unacked()[0].payload  # the replay buffer's envelope
        assert len(handed) == 1 and handed[0].body == kept.body == [("src", 1, {"v": 1})]
        assert (handed[0].body[0][2] is kept.body[0][2]) is keeps


def test_records_taken_without_rebuilding_reach_a_chained_successor_that_reads_them_as_dicts() -> None:
    """An identity map takes a compact batch as Rows (it reads no record); its chained successor
    reads records (this sink stores them): the hand-off rebuilds them; one in `local_ids_only`
    gets the Rows themselves."""
    from agent.dataplane.envelope import Row
    from agent.operators.builtin import MapOperator, identity

    for ids_only in (False, True):
        store: List[Tuple[str, int]] = []
        op, sink = make("op", ("sink-0",), store), make("sink", ("op-0",), store)
        op = Instance(op.spec, PIPELINE, MapOperator(identity), local=frozenset({"sink-0"}))
        sh = Shell(op, sink)
        sh.feed(sink, Started(WALL0), 0.0)
        sh.feed(op, Started(WALL0), 0.0)
        op.outputs.local_ids_only = frozenset({"sink-0"}) if ids_only else frozenset()
        batch = [("src", i, {"v": i, "w": -i}) for i in range(1, 4)]
        sh.feed(op, EnvelopeReceived(topics.inbox(CLUSTER, "op-0", "n1"), encode_data("source-0", 0, 1, batch)), 0.1)
        sh.feed(op, Tick(WALL0), 0.1)
        handed = [it for _, e in sh.handed if e.kind is Kind.DATA for it in e.body]
        assert [type(r) for _, _, r in handed] == [Row if ids_only else dict] * 3
        if not ids_only:
            assert handed == batch
            sh.deliver(0.2)
            sh.feed(sink, Tick(WALL0), 0.21)
            assert sorted(store) == [("src", i) for i in range(1, 4)]


def test_a_chain_tells_each_member_which_chained_successors_keep_their_records(tmp_path: Path) -> None:
    """`Operator.keeps_records`, read by the chain from its members' operators: the identity
    (`@passes_records`) and the null sink keep them, a function that may change a record does not."""
    import io

    from agent.instance.chain import Chain
    from foglab.tools.dataplane_bench import pipeline_toml

    for fn, map_keeps in (("agent.operators.builtin:identity", True), ("agent.operators.builtin:in_zone", False)):
        toml = pipeline_toml("keeps", [
            {"name": "source", "kind": "source", "function": "agent.operators.taxi:source", "batch_size": 10},
            {"name": "map", "function": fn, "batch_size": 10},
            {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:null_sink", "batch_size": 10},
        ], scaling={"policy": "none"})
        specs = initial_specs(toml, BrokerSpec("127.0.0.1", 1), str(tmp_path / fn / "state"), cluster="keeps",
                              extra={"sink_dir": str(tmp_path / fn / "sink")})
        chain = Chain(specs, io.StringIO())  # built, not started: no connection
        keeps = {w.spec.instance: w.core.outputs.local_keeps for w in chain.members}
        assert keeps == {"source-0": frozenset({"sink-0", "map-0"} if map_keeps else {"sink-0"}),
                         "map-0": frozenset({"sink-0"}), "sink-0": frozenset({"map-0"} if map_keeps else set())}
        # ... and which read no records (the identity and the null sink): handed Rows as they are
        ids_only = {w.spec.instance: w.core.outputs.local_ids_only for w in chain.members}
        assert ids_only == {"source-0": frozenset({"sink-0", "map-0"} if map_keeps else {"sink-0"}),
                            "map-0": frozenset({"sink-0"}), "sink-0": frozenset({"map-0"} if map_keeps else set())}


# ---- chain processes on the broker ----------------------------------------------------------------


def specs_for(mosquitto: Any, tmp_path: Path, toml: str, cluster: str) -> Dict[str, InstanceSpec]:
    specs = initial_specs(toml, BrokerSpec(mosquitto.host, mosquitto.port), str(tmp_path / "state"),
                          cluster=cluster, extra={"sink_dir": str(tmp_path / "sink"), "seed": 11})
    return {s.operator: s for s in specs}


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_a_whole_pipeline_in_one_chain_delivers_every_record_once_without_the_broker(runner, mosquitto,
                                                                                        tmp_path: Path) -> None:
    n = 6000
    s = specs_for(mosquitto, tmp_path, taxi_pipeline(3000.0, n), "chain1")
    members = {m.spec.operator: m for m in runner.start_chain([s["source"], s["validate"], s["in_zone"], s["sink"]])}
    assert len({m.pid for m in members.values()}) == 1  # one process hosts the four instances
    wait_for(lambda: members["source"].stats.get("generated") == n, 30, "the source to finish")
    want = len(expected_ids(3, "source-0", n))
    wait_for(lambda: members["sink"].stats.get("recorded") == want, 30, "the sink to record everything")
    st = {k: dict(m.stats) for k, m in members.items()}
    codes = runner.stop_all()
    assert set(codes.values()) == {0}, codes
    assert_exactly_once(tmp_path, n)
    for name in ("validate", "in_zone", "sink"):
        assert st[name].get("mqtt_in", 0) == 0, f"{name} received over MQTT: {st[name]}"  # all in memory
        assert st[name]["handed_in"] == st[name]["batches_in"] > 0
    for name in ("validate", "in_zone"):
        assert st[name]["records_in"] == st[name]["records_out"] + st[name]["filtered"]
    assert st["validate"]["records_in"] == n


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_a_chain_stopped_mid_stream_drains_upstream_first_and_delivers_everything_it_generated(
        runner, mosquitto, tmp_path: Path) -> None:
    """"stop" while records flow: the members stop one after the other, upstream first, so each
    drains into a live successor; every member exits 0 and every record generated is recorded."""
    s = specs_for(mosquitto, tmp_path, taxi_pipeline(4000.0, 10 ** 6), "chain4")
    members = {m.spec.operator: m for m in runner.start_chain([s["source"], s["validate"], s["in_zone"], s["sink"]])}
    wait_for(lambda: members["sink"].stats.get("recorded", 0) > 2000, 30, "records to flow")
    codes = runner.stop_all(timeout=20)
    assert set(codes.values()) == {0}, codes
    assert [m.exit_info["code"] for m in members.values()] == [0, 0, 0, 0]
    generated = json.loads((tmp_path / "sink" / "source-0.source.json").read_text())["generated"]
    assert generated < 10 ** 6
    assert_exactly_once(tmp_path, generated)


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_kill_9_of_a_chain_mid_stream_loses_and_duplicates_nothing(runner, mosquitto, tmp_path: Path) -> None:
    """source -> [validate, in_zone] -> sink: the chain in the middle, MQTT on both sides. kill -9
    of the chain; restarted (every member with restart = true, one process again), each member
    takes a new epoch, the source replays what validate had not acked, the sink drops copies."""
    n = 8000
    # in_zone at 0.6 ms per record: batches wait in its queue, handed over but not processed yet
    # (validate must not have acked them upstream: they die with the chain).
    s = specs_for(mosquitto, tmp_path, taxi_pipeline(1500.0, n, in_zone_extra={"service_time_ms": 0.6}), "chain2")
    sink = runner.start(s["sink"])
    chain = {m.spec.operator: m for m in runner.start_chain([s["validate"], s["in_zone"]])}
    source = runner.start(s["source"])
    wait_for(lambda: sink.stats.get("recorded", 0) > 800, 20, "records to flow")
    assert chain["in_zone"].stats.get("handed_in", 0) > 0
    chain["validate"].proc.send_signal(signal.SIGKILL)
    chain["validate"].proc.wait(timeout=10)
    time.sleep(0.5)  # the source keeps sending into validate's persistent session meanwhile
    new = runner.restart("validate-0")
    wait_for(lambda: source.stats.get("generated") == n, 40, "the source to finish")
    want = len(expected_ids(3, "source-0", n))
    wait_for(lambda: sink.stats.get("recorded") == want, 40, "the sink to record everything")
    again = runner.workers["in_zone-0"]
    assert again.pid == new.pid != chain["validate"].pid  # restarted as one chain again
    assert again.stats.get("handed_in", 0) > 0
    runner.stop_all()
    assert_exactly_once(tmp_path, n)
    for inst in ("validate-0", "in_zone-0"):
        assert json.loads((tmp_path / "state" / f"{inst}.state.json").read_text())["epoch"] == 1


@pytest.mark.broker
@pytest.mark.timeout(150)
def test_a_chained_operator_scales_out_to_a_copy_in_its_own_process(runner, mosquitto, tmp_path: Path) -> None:
    """[source, validate, in_zone] -> sink; in_zone (chained behind validate, 5 ms per record,
    C = 150/s) gets 450 records/s: its copies are separate processes that validate reaches over
    MQTT while its chained keeper keeps getting batches in memory. Every record exactly once."""
    n = 100000
    toml = step_load_pipeline(n, [[0, 80.0], [2, 450.0], [9, 30.0], [16, 0.0]], {})
    s = specs_for(mosquitto, tmp_path, toml, "chain3")
    sink = runner.start(s["sink"])
    chain = {m.spec.operator: m for m in runner.start_chain([s["source"], s["validate"], s["in_zone"]])}
    t0 = time.monotonic()
    copies = lambda: [w for w in runner.alive() if w.spec.operator == "in_zone" and w.instance != "in_zone-0"]  # noqa: E731
    wait_for(lambda: len(copies()) >= 1, 14, "in_zone to scale out")
    copy = copies()[0]
    assert copy.pid != chain["in_zone"].pid  # a copy is a process of its own
    wait_for(lambda: copy.stats.get("records_in", 0) > 0, 10, "the copy to get records")
    assert copy.stats.get("mqtt_in", 0) > 0 and copy.stats.get("handed_in", 0) == 0  # over the broker
    wait_for(lambda: time.monotonic() - t0 > 17.0, 30, "the end of the load profile")
    wait_source_quiet(chain["source"])
    generated = chain["source"].stats["generated"]
    want = len(expected_ids(3, "source-0", generated))
    wait_for(lambda: sink.stats.get("recorded") == want, 30, "the sink to record everything")
    assert chain["in_zone"].stats.get("handed_in", 0) > 0
    stats = [w.stats for w in runner.workers.values()]
    assert sum(x.get("sends_to_non_successor", 0) for x in stats) == 0
    assert sum(x.get("protocol_errors", 0) for x in stats) == 0
    codes = runner.stop_all()
    assert set(codes.values()) <= {0}, codes
    assert_exactly_once(tmp_path, generated)


# ---- the agent's side, pure (agent.node.chains) ----------------------------------------------------


def keepers(n_ops: int = 4) -> List[InstanceSpec]:
    from agent.node.deploy import keeper_specs

    toml = taxi_pipeline(100.0, 10)
    cfg = load_pipeline_text(toml)
    return keeper_specs(cfg, toml, "c", BrokerSpec("127.0.0.1", 1))[:n_ops]


def test_deploy_plans_consecutive_keepers_onto_one_node_where_it_has_the_slots() -> None:
    from agent.node.chains import plan_chains
    from agent.node.placement import NodeView, get_policy

    specs = keepers()
    policy = get_policy("free-slots-then-latency")
    roomy = [NodeView("n1", 6, 6), NodeView("n2", 6, 2)]
    plan = plan_chains(specs, roomy, policy)
    assert [(n, [s.operator for s in g]) for n, g in plan] == [("n1", ["source", "validate", "in_zone", "sink"])]
    tight = [NodeView("n1", 3, 3), NodeView("n2", 2, 2)]  # no node takes all four: sink first, as far as it fits
    plan = plan_chains(specs, tight, policy)
    assert [(n, [s.operator for s in g]) for n, g in plan] == [("n1", ["validate", "in_zone", "sink"]),
                                                               ("n2", ["source"])]


def test_a_chain_request_must_be_consecutive_keepers_wired_to_each_other() -> None:
    from agent.node.chains import chain_problem

    s = keepers()
    assert chain_problem(s[1:3]) is None
    assert "consecutive" in str(chain_problem([s[0], s[2]]))
    assert "consecutive" in str(chain_problem([s[2], s[1]]))
    assert "keepers" in str(chain_problem([s[1], dataclasses.replace(s[2], keeper=False)]))
    assert "only neighbours" in str(chain_problem([s[1], dataclasses.replace(s[2], preds=("x",))]))
    assert "2 to" in str(chain_problem(s[:1]))


def test_restarts_of_a_chains_members_are_grouped_into_one_process_again() -> None:
    from agent.node.chains import chain_of, group_chains, with_chain

    s = with_chain(keepers()[1:4])  # validate, in_zone, sink chained
    lone = keepers()[0]
    groups = group_chains([s[2], lone, s[0], s[1]])
    assert [[g.instance for g in grp] for grp in groups] == [[lone.instance], [x.instance for x in s]]
    assert all(chain_of(g) == tuple(x.instance for x in s) for g in groups[1])
    partial = group_chains([s[2]])  # a member left alone runs alone, without its chain
    assert len(partial) == 1 and chain_of(partial[0][0]) == ()


# ---- the real daemon: deploy with chain = true, kill -9 of the chain --------------------------------


@pytest.mark.broker
@pytest.mark.timeout(150)
def test_an_agent_hosts_a_chained_deploy_in_one_process_and_restarts_it_as_one_after_kill_9(
        mosquitto, tmp_path: Path) -> None:
    """`fog-agent deploy` of a `chain = true` pipeline on one agent: the four keepers in one worker
    process (one pid in the agent's state); kill -9 of it mid-stream: the agent restarts the four
    as one chain again (`restart = true` each), and every record arrives exactly once. Then a stop
    of the head: the three others, stopped with it, are started again as a chain of 3."""
    import os
    import subprocess
    import sys
    import uuid

    from agent.node.nodestate import parse_node_state
    from agent.node.deploy import RpcClient
    from agent.operators.builtin import read_sink_ids
    from agent_process import ROOT, AgentProcess, wait_until_answers, write_agent_conf

    cluster = "chain" + uuid.uuid4().hex[:6]
    n = 12000
    state = tmp_path / "n1"
    sink_dir = state / "sink"
    pipe = tmp_path / "taxi.toml"
    pipe.write_text(taxi_pipeline(1500.0, n).replace('name = "taxi"', 'name = "taxi"\nchain = true', 1))
    conf = write_agent_conf(tmp_path / "n1.toml", "n1", cluster, state, mosquitto, slots=6, state_period=0.3,
                            heartbeat_period=0.3, shutdown_timeout=6.0)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FOG_AGENT_CONFIG", None)
    agent = AgentProcess(conf)
    try:
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            wait_until_answers(client, "n1", agent.alive)

            def pids() -> Dict[str, int]:
                msgs = client.snapshot([topics.agent_state(cluster, "n1")], timeout=5.0)
                doc = parse_node_state(next(iter(msgs.values())).payload) if msgs else {"instances": []}
                return {str(i["id"]): int(i.get("pid") or 0) for i in doc["instances"] if i.get("status") == "active"}

            d = subprocess.run([sys.executable, "-m", "agent", "deploy", str(pipe), "--host", mosquitto.host,
                                "--port", str(mosquitto.port), "--cluster", cluster, "--set", f"sink_dir={sink_dir}"],
                               capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
            assert d.returncode == 0, d.stdout + d.stderr
            names = [f"taxi.{op}.0" for op in ("source", "validate", "in_zone", "sink")]
            wait_for(lambda: set(names) <= set(pids()), 20, "the four keepers to be active")
            first = pids()
            assert len({first[i] for i in names}) == 1, first  # one process hosts the four

            def recorded() -> int:
                ids, _ = read_sink_ids(sink_dir)
                return len(ids.get("taxi.source.0", set()))

            wait_for(lambda: recorded() > 1500, 30, "records to flow")
            os.kill(first[names[0]], signal.SIGKILL)
            def restarted() -> bool:
                now = pids()
                return set(names) <= set(now) and now[names[0]] != first[names[0]]

            wait_for(restarted, 30, "the chain to be restarted")
            again = pids()
            assert len({again[i] for i in names}) == 1, again  # one process again
            want = expected_ids(3, "taxi.source.0", n)
            wait_for(lambda: recorded() >= len(want), 60, "every record at the sink")
            # A stop of one member stops the chain (upstream first); the members nobody asked to
            # stop are still in their neighbours' tables: the agent starts them again, as a chain.
            assert client.call("n1", {"op": "stop", "instance": names[0]}, timeout=10.0)["ok"]

            def rest_restarted() -> bool:
                now = pids()
                return names[0] not in now and set(names[1:]) <= set(now) and now[names[1]] != again[names[1]]

            wait_for(rest_restarted, 30, "the other three members to be started again")
            assert len({pids()[i] for i in names[1:]}) == 1
            time.sleep(0.5)
    finally:
        agent.stop()
    ids, dup = read_sink_ids(sink_dir)
    got = ids.get("taxi.source.0", set())
    assert dup == 0 and got == want, (dup, len(want - got), len(got - want))
    assert "as a chain of 4" in agent.text() and "as a chain of 3" in agent.text()
