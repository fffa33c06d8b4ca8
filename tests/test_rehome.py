"""The re-homing planner (agent.node.rehome): who re-homes, which instances, with which tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest

from agent.node.rehome import decode_hosted, encode_hosted, plan_rehome, responsible

PIPE = """
[pipeline]
name = "p"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "mid"
function = "agent.operators.builtin:identity"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def spec(instance: str, operator: str, keeper: bool = False, **extra: Any) -> Dict[str, Any]:
    return {"instance": instance, "operator": operator, "pipeline": "p", "pipeline_toml": PIPE,
            "node": "x", "cluster": "c", "keeper": keeper, "succs": ["stale"], "preds": ["stale"],
            "extra": dict(extra)}


def fleet() -> Dict[str, List[Dict[str, Any]]]:
    return {
        "n1": [spec("p.source.0", "source", True), spec("mid-a", "mid")],
        "n2": [spec("p.mid.0", "mid", True), spec("mid-b", "mid", sink_dir="/s")],
        "n3": [spec("p.sink.0", "sink", True)],
    }


def test_the_lowest_online_node_is_responsible() -> None:
    assert responsible("n1", {"n1", "n3"})
    assert not responsible("n3", {"n1", "n3"})
    assert responsible("n3", {"n4"})  # itself counts even when its own status is not seen yet


def test_dead_node_instances_get_fresh_tables_same_identity_and_a_higher_epoch() -> None:
    plan = plan_rehome("n2", fleet(), online={"n1", "n3"}, listed_online={"p.source.0", "mid-a", "p.sink.0"},
                       min_epoch=1_800_000_000)
    assert [s["instance"] for s in plan] == ["mid-b", "p.mid.0"]
    keeper = plan[1]
    assert keeper["keeper"] is True and keeper["restart"] is True and keeper["active"] is True
    # tables from the retained records of the live nodes plus the dead node, not the stale spec
    assert keeper["preds"] == ["p.source.0"] and keeper["succs"] == ["p.sink.0"]
    assert keeper["extra"]["min_epoch"] == 1_800_000_000
    assert plan[0]["extra"] == {"sink_dir": "/s", "min_epoch": 1_800_000_000}


def test_siblings_and_neighbours_of_other_dead_nodes_are_not_in_the_tables() -> None:
    hosted = fleet()
    hosted["n4"] = [spec("source-ghost", "source")]  # an offline node that is not the one re-homed
    plan = plan_rehome("n2", hosted, online={"n1", "n3"}, listed_online=set(), min_epoch=5)
    assert all(s["preds"] == ["p.source.0"] for s in plan)


def test_a_departing_successor_is_left_out_of_a_rehomed_predecessors_table() -> None:
    """A copy past the predecessor phase of its deletion (its dead predecessor had acked it) must
    not be in the re-homed predecessor's successors, which would route records to it until the end
    (CHANGELOG.md, "A re-homed predecessor routed to a successor that was leaving"). A departing
    instance of the previous operator stays a predecessor (it still sends its last records and its
    Deletion)."""
    fl = {**fleet(), "n3": [spec("p.sink.0", "sink", True), spec("sink-b", "sink")]}
    plan = plan_rehome("n2", fl, online={"n1", "n3"}, listed_online=set(), min_epoch=1, departing={"sink-b"})
    assert plan[1]["instance"] == "p.mid.0" and plan[1]["succs"] == ["p.sink.0"]
    before = plan_rehome("n2", fl, online={"n1", "n3"}, listed_online=set(), min_epoch=1)
    assert before[1]["succs"] == ["p.sink.0", "sink-b"]  # what it was: the departing copy included
    plan = plan_rehome("n3", fl, online={"n1", "n2"}, listed_online=set(), min_epoch=1, departing={"mid-b"})
    assert plan[0]["instance"] == "p.sink.0" and plan[0]["preds"] == ["mid-a", "mid-b", "p.mid.0"]


def test_an_instance_already_listed_by_an_online_node_is_skipped() -> None:
    plan = plan_rehome("n2", fleet(), online={"n1", "n3"}, listed_online={"p.mid.0", "mid-b"}, min_epoch=5)
    assert plan == []


def test_a_source_and_a_sink_get_only_the_side_they_have() -> None:
    hosted = fleet()
    plan = plan_rehome("n1", hosted, online={"n2", "n3"}, listed_online=set(), min_epoch=5)
    src = next(s for s in plan if s["instance"] == "p.source.0")
    assert src["preds"] == [] and src["succs"] == ["mid-a", "mid-b", "p.mid.0"]
    plan = plan_rehome("n3", hosted, online={"n1", "n2"}, listed_online=set(), min_epoch=5)
    assert plan[0]["preds"] == ["mid-a", "mid-b", "p.mid.0"] and plan[0]["succs"] == []


def test_hosted_record_round_trip_and_bad_payloads() -> None:
    specs = fleet()["n1"]
    assert decode_hosted(encode_hosted(specs)) == sorted(specs, key=lambda s: s["instance"])
    for bad in (b"{}", b"[1]", b'[{"instance": 3}]', b"not json"):
        with pytest.raises(ValueError):
            decode_hosted(bad)


def _agent(tmp_path: Path) -> Any:
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}/state"\ndead_after = 1.0\n'
                    '[mqtt]\nhost = "127.0.0.1"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    agent.bus.retained_in = True  # the retained records are in (daemon._on_connected's sync marker)
    return agent


def test_the_agent_reads_departing_instances_from_the_node_states(tmp_path: Path) -> None:
    """The daemon side of the test above: who is departing comes from the other online nodes'
    retained states (each instance's scaling state, from its heartbeat) and from our workers."""
    agent = _agent(tmp_path)
    created: List[Any] = []
    agent.core.creating.create = lambda spec, reply, cause, now: created.append(spec)
    agent.bus.connected, agent.core.view.online, agent.core.rehoming.offline_since = True, {"n9": False, "n3": True}, {"n9": 0.0}
    agent.core.view.hosted_by_node = {"n9": [spec("p.mid.0", "mid", True)],
                            "n3": [spec("p.sink.0", "sink", True), spec("sink-b", "sink"), spec("sink-c", "sink")]}
    agent.core.view.fleet["n3"] = {"instances": [{"id": "p.sink.0", "stats": {"state": "active"}},
                                       {"id": "sink-b", "stats": {"state": "departing"}},
                                       {"id": "sink-c", "stats": {"state": "deleting"}}]}
    agent.core.rehomer.tick(100.0, agent.wall())
    assert [(s.instance, s.succs) for s in created] == [("p.mid.0", ("p.sink.0", "sink-c"))]


def test_a_retry_after_a_failed_rehome_does_not_place_the_others_again(tmp_path: Path) -> None:
    """A re-home that fails (no free slot) must not make the next period plan the lost node again
    and place a second time an instance whose createNode() went to another node, not yet listed
    in that node's state: two incarnations of one copy (CHANGELOG.md, "Two nodes ran, then both
    fenced, one copy"). Only the failed one is tried again, and our re-homed record stops
    claiming it meanwhile (a returning node would otherwise forget an instance that runs
    nowhere)."""
    agent = _agent(tmp_path)
    asked: List[Any] = []
    agent.core.creating.create = lambda spec, reply, cause, now: asked.append((spec.instance, reply))
    agent.bus.connected, agent.core.view.online, agent.core.rehoming.offline_since = True, {"n9": False}, {"n9": 0.0}
    agent.core.view.hosted_by_node = {"n9": [spec("p.mid.0", "mid", True), spec("mid-b", "mid")]}
    agent.core.rehomer.tick(100.0, agent.wall())
    assert [a[0] for a in asked] == ["mid-b", "p.mid.0"]
    assert set(agent.core.view.rehomed_by_node["me"]) == {"mid-b", "p.mid.0"}
    asked[0][1]({"ok": False, "error": "no node has a free slot"})  # mid-b failed; p.mid.0 on its way
    assert set(agent.core.view.rehomed_by_node["me"]) == {"p.mid.0"}
    agent.core.rehomer.tick(101.0, agent.wall())
    assert [a[0] for a in asked[2:]] == ["mid-b"]
    agent.core.rehomer.tick(102.0, agent.wall())
    assert len(asked) == 3  # nothing failed since: nothing planned again
    # n9 comes back and lists both: the claims end (the next loss of n9 re-homes them again)
    agent.core.view.online, agent.core.rehoming.offline_since = {"n9": True}, {}
    agent.core.view.fleet["n9"] = {"instances": [{"id": "p.mid.0"}, {"id": "mid-b"}]}
    agent.core.rehomer.tick(103.0, agent.wall())
    assert agent.core.rehoming.claims == {}


def test_a_failed_rehome_is_not_placed_again_when_the_returning_node_runs_it(tmp_path: Path) -> None:
    """The other half of test_rehome_retry: a re-home that fails after the lost node
    came back is placed again only when no online node runs the instance once the node has been
    back for a while (its state then shows what it re-adopted); here it re-adopted it."""
    agent = _agent(tmp_path)
    asked: List[Any] = []
    agent.core.creating.create = lambda spec, reply, cause, now: asked.append((spec.instance, reply))
    agent.bus.connected, agent.core.view.online, agent.core.rehoming.offline_since = True, {"n9": False}, {"n9": 0.0}
    agent.core.view.hosted_by_node = {"n9": [spec("p.mid.0", "mid", True)]}
    agent.core.rehomer.tick(100.0, agent.wall())
    agent.core.view.online, agent.core.rehoming.offline_since, agent.core.rehoming.online_since = {"n9": True}, {}, {"n9": 105.0}
    asked[0][1]({"ok": False, "error": "not ready 20.0s after start"})
    agent.core.rehomer.tick(106.0, agent.wall())  # back for 1 s: its state may not show what it re-adopted yet
    assert len(asked) == 1 and "p.mid.0" in agent.core.rehoming.retry
    agent.core.view.fleet["n9"] = {"instances": [{"id": "p.mid.0"}]}  # it did
    agent.core.rehomer.tick(130.0, agent.wall())
    assert len(asked) == 1 and not agent.core.rehoming.retry


def test_an_idle_copy_is_rehomed_idle_out_of_rebuilt_successors_and_its_creator_told() -> None:
    """op-0 re-homed in the middle of its duplication with its idle copy: started active, the
    copy ran with tables some neighbours never applied, and its Deletion was never acked (77
    of 400 checker schedules). Re-homed idle, it waits for a Start; its creator is told of it
    (`idle_copies`) to adopt it before it may leave, and no re-homed predecessor routes to it
    before that adoption announces it (CHANGELOG.md, "An idle copy re-homed together with its
    creator came back active"). A keeper is never idle; preds keep idle copies."""
    fl = {"n1": [spec("p.source.0", "source", True)],
          "n2": [spec("p.mid.0", "mid", True), spec("mid-b", "mid", creator="p.mid.0"),
                 spec("mid-c", "mid", creator="mid-x")],
          "n3": [spec("p.sink.0", "sink", True), spec("sink-b", "sink", creator="p.sink.0")]}
    idle = {"mid-b", "p.mid.0", "sink-b"}
    plan = plan_rehome("n2", fl, online={"n1", "n3"}, listed_online=set(), min_epoch=1, idle=idle)
    by = {s["instance"]: s for s in plan}
    assert [(i, s["active"]) for i, s in sorted(by.items())] == [("mid-b", False), ("mid-c", True), ("p.mid.0", True)]
    assert by["p.mid.0"]["extra"]["idle_copies"] == ["mid-b"]
    assert "idle_copies" not in by["mid-c"]["extra"] and by["mid-b"]["extra"]["creator"] == "p.mid.0"
    assert by["p.mid.0"]["succs"] == ["p.sink.0"]  # the idle sink-b left out
    assert by["p.mid.0"]["preds"] == ["p.source.0"]
    # the sink lost instead: the idle mid-b stays among its preds (it refuses unknown senders)
    sink = plan_rehome("n3", fl, online={"n1", "n2"}, listed_online=set(), min_epoch=1, idle=idle)
    assert {s["instance"]: s["preds"] for s in sink}["p.sink.0"] == ["mid-b", "mid-c", "p.mid.0"]
    # not told which copies are idle: every instance active, as before
    assert all(s["active"] and "idle_copies" not in s["extra"]
               for s in plan_rehome("n2", fl, online={"n1", "n3"}, listed_online=set(), min_epoch=1))


def test_the_agent_reads_idle_copies_from_the_lost_nodes_last_state(tmp_path: Path) -> None:
    """The daemon side: which copies were idle comes from the lost node's last retained state
    (and the online nodes' states, and our workers)."""
    agent = _agent(tmp_path)
    created: List[Any] = []
    agent.core.creating.create = lambda spec, reply, cause, now: created.append(spec)
    agent.bus.connected, agent.core.view.online, agent.core.rehoming.offline_since = True, {"n2": False, "n1": True, "n3": True}, {"n2": 0.0}
    agent.core.view.hosted_by_node = {"n1": [spec("p.source.0", "source", True)],
                            "n2": [spec("p.mid.0", "mid", True), spec("mid-b", "mid", creator="p.mid.0")],
                            "n3": [spec("p.sink.0", "sink", True)]}
    agent.core.view.fleet["n2"] = {"instances": [{"id": "mid-b", "stats": {"state": "idle"}},  # the lost node's last state
                                       {"id": "p.mid.0", "stats": {"state": "duplicating"}}]}
    agent.core.rehomer.tick(100.0, agent.wall())
    assert [(s.instance, s.active, s.extra.get("idle_copies")) for s in created] == [
        ("mid-b", False, None), ("p.mid.0", True, ["mid-b"])]


def test_a_rehomed_instance_is_told_the_round_it_waited_to_start_under_its_locks(tmp_path: Path) -> None:
    """coordination = "fgme": a decided round waits for its 2-FGME locks, and the decision is in
    the instance's files only. The lost node's last state reports it (`lock.intent`); the
    re-homed incarnation gets it as `lock_intent` and runs it. Not an adoption (`adopting`: the
    idle copy is adopted from `idle_copies`), not for a copy re-homed idle."""
    agent = _agent(tmp_path)
    created: List[Any] = []
    agent.core.creating.create = lambda spec, reply, cause, now: created.append(spec)
    agent.bus.connected, agent.core.view.online, agent.core.rehoming.offline_since = True, {"n2": False, "n1": True, "n3": True}, {"n2": 0.0}
    agent.core.view.hosted_by_node = {"n1": [spec("p.source.0", "source", True)],
                                 "n2": [spec("p.mid.0", "mid", True), spec("mid-b", "mid", creator="p.mid.0"),
                                        spec("mid-c", "mid", creator="p.mid.0")],
                                 "n3": [spec("p.sink.0", "sink", True)]}
    agent.core.view.fleet["n2"] = {"instances": [
        {"id": "p.mid.0", "stats": {"state": "active", "lock": {"intent": "duplicate", "adopting": None}}},
        {"id": "mid-b", "stats": {"state": "active", "lock": {"intent": "terminate", "adopting": "x"}}},
        {"id": "mid-c", "stats": {"state": "idle", "lock": {"intent": "terminate", "adopting": None}}}]}
    agent.core.rehomer.tick(100.0, agent.wall())
    assert sorted((s.instance, s.extra.get("lock_intent")) for s in created) == [
        ("mid-b", None), ("mid-c", None), ("p.mid.0", "duplicate")]
    # the planner drops an intent its spec carried from an earlier re-home when none is reported
    fl = {"n2": [spec("p.mid.0", "mid", True, lock_intent="terminate")], "n1": [spec("p.source.0", "source", True)]}
    assert "lock_intent" not in plan_rehome("n2", fl, online={"n1"}, listed_online=set(), min_epoch=1)[0]["extra"]


def test_a_rehomed_keyed_instance_is_told_the_key_groups_its_dead_incarnation_owned(tmp_path: Path) -> None:
    """The daemon reads them from the lost node's last retained state (the worker's heartbeat
    stats, `groups`); an instance it said nothing of is not told any (it holds the dealing)."""
    agent = _agent(tmp_path)
    created: List[Any] = []
    agent.core.creating.create = lambda spec, reply, cause, now: created.append(spec)
    agent.bus.connected, agent.core.view.online, agent.core.rehoming.offline_since = True, {"n2": False, "n1": True, "n3": True}, {"n2": 0.0}
    agent.core.view.hosted_by_node = {"n1": [spec("p.source.0", "source", True)],
                            "n2": [spec("p.mid.0", "mid", True), spec("mid-b", "mid", owned_groups=[[0, 127, 0]])],
                            "n3": [spec("p.sink.0", "sink", True)]}
    agent.core.view.fleet["n2"] = {"instances": [{"id": "p.mid.0", "stats": {"groups": [[0, 27, 1], [40, 127, 0]]}},
                                       {"id": "mid-b", "stats": {}}]}
    agent.core.rehomer.tick(100.0, agent.wall())
    assert [(s.instance, s.extra.get("owned_groups")) for s in created] == [
        ("mid-b", None), ("p.mid.0", [[0, 27, 1], [40, 127, 0]])]


def test_a_rehomed_keyed_instance_resumes_the_groups_it_is_told_not_every_group(tmp_path: Path) -> None:
    """The worker side: re-homed without its state, a keyed copy owned every group (the dealing of a
    deployed keeper: 'handing 128 key groups' when it left, where its predecessor had 28-32), and
    it and its siblings refused each other's Redirects for ever. Told its groups, it owns exactly
    those at their versions, and says so in its heartbeat; an unusable list leaves the dealing."""
    import dataclasses
    import os

    from memory_wire import MemoryWire

    from agent.instance.shell import Worker
    from agent.mqtt.settings import BrokerSpec
    from foglab.tools.dataplane_bench import initial_specs, pipeline_toml

    toml = pipeline_toml("p", [
        {"name": "src", "kind": "source", "function": "agent.operators.taxi:source", "key": "medallion"},
        {"name": "win", "function": "agent.operators.keyed:tumbling_window",
         "params": {"time_field": "dropoff_datetime", "size_ms": 60000}},
        {"name": "out", "kind": "sink", "function": "agent.operators.builtin:counting_sink"},
    ], scaling={"policy": "none"})
    base = [s for s in initial_specs(toml, BrokerSpec("127.0.0.1", 1), str(tmp_path / "state"), cluster="c",
                                     extra={"sink_dir": str(tmp_path / "sink")}) if s.operator == "win"][0]

    def rehomed(runs: Any, where: str) -> Worker:
        spec = dataclasses.replace(base, restart=True, state_dir=str(tmp_path / where),
                                   extra={**base.extra, "owned_groups": runs, "min_epoch": 1_800_000_000})
        w = Worker(spec, out=open(os.devnull, "w"), clock=lambda: 100.0, transport=MemoryWire())  # noqa: SIM115
        w.start()
        return w

    w = rehomed([[0, 27, 3], [96, 99, 0]], "a")
    assert w.core.moves is not None
    assert w.core.moves.member.owned == set(range(28)) | set(range(96, 100))
    assert w.core.moves.versions == {**{g: 3 for g in range(28)}, **{g: 0 for g in range(96, 100)}}
    assert w.core.snapshot_stats()["groups"] == [[0, 27, 3], [96, 99, 0]]
    # its groups' output counters went with its node: new ids start above any the dead one used
    floors = w.core.keyed.floors  # type: ignore[union-attr]
    assert set(floors) == set(range(28)) | set(range(96, 100)) and min(floors.values()) >= int(1_700_000_000 * 1e6)
    bad = rehomed([[0, 500, 1]], "b")  # out of range: bus input, refused as a whole
    assert bad.core.moves is not None and bad.core.moves.member.owned == set(range(128))


def test_fogctl_why_says_who_rehomed_an_instance_and_when() -> None:
    """The agents' retained re-homed records (instance -> time, per re-homing node): `why` names
    the latest re-home of the instance; a malformed record (bus input) is skipped, not fatal."""
    import types

    from agent.fogctl.commands import rehomed_of

    def m(payload: bytes) -> Any:
        return types.SimpleNamespace(payload=payload)

    snap = {"fog/c/agents/n2/rehomed": m(b'{"cells.0": 100.0, "sink.0": 50}'),
            "fog/c/agents/n3/rehomed": m(b'{"cells.0": 180.5}'),
            "fog/c/agents/n4/rehomed": m(b'["not", "a", "record"]'),
            "fog/c/agents/n5/rehomed": m(b'{"cells.0": true}')}
    assert rehomed_of(snap, "cells.0") == {"by": "n3", "at": 180.5}
    assert rehomed_of(snap, "sink.0") == {"by": "n2", "at": 50.0}
    assert rehomed_of(snap, "other") is None


def test_a_rehomed_predecessor_of_keyed_instances_gets_its_group_table_from_their_reports() -> None:
    """Its saved table went with its node; the dealing over its successors named owners the groups
    had left, and it refused their Redirects for ever ("which does not own it"). The plan hands it
    its successors' reports; the table takes each group's owner at the highest version, and a
    group no one reports (in the middle of a move) makes no table: the dealing, logged."""
    from agent.dataplane.owners import TableError, table_from_reports
    from agent.instance.groups import restored_table

    hosted = {"n1": [spec("p.source.0", "source", True), spec("p.mid.0", "mid", True)],
              "n2": [spec("mid-b", "mid")]}
    reports = {"p.mid.0": [[0, 63, 2]], "mid-b": [[64, 127, 1], [0, 3, 1]]}
    (src,) = [d for d in plan_rehome("n1", hosted, {"n2"}, set(), 0, groups=reports) if d["operator"] == "source"]
    assert src["extra"]["succ_groups"] == reports
    table = table_from_reports(src["extra"]["succ_groups"], 128)
    assert [table.owner(g) for g in (0, 3, 4, 63, 64, 127)] == ["p.mid.0"] * 4 + ["mid-b"] * 2
    assert table.version(0) == 2 and table.version(64) == 1
    assert restored_table({}, ["p.mid.0", "mid-b"], 128, {}, reports) == table
    partial = {"p.mid.0": [[0, 63, 2]], "mid-b": [[70, 127, 1]]}  # 64-69 moving: no table from it
    with pytest.raises(TableError):
        table_from_reports(partial, 128)
    dealt = restored_table({}, ["p.mid.0", "mid-b"], 128, {}, partial)
    assert dealt is not None and dealt.version(0) == 0
    for bad in ({"x": [[0, 500, 1]]}, {"x": "runs"}, [], {}):  # bus input: refused, never a crash
        with pytest.raises(TableError):
            table_from_reports(bad, 128)


# ---- keyed operators: groups in the middle of a move when a node is lost ---------------------------

KEYED_PIPE = "\n".join([
    '[pipeline]', 'name = "p"', '', '[scaling]', 'policy = "none"', '',
    '[[operator]]', 'name = "source"', 'kind = "source"', 'function = "agent.operators.taxi:source"', '',
    '[[operator]]', 'name = "op"', 'kind = "map"', 'function = "agent.operators.builtin:validate"', 'key = "k"', '',
    '[[operator]]', 'name = "cnt"', 'kind = "map"', 'function = "agent.operators.keyed:keyed_count"',
    'key_groups = 8', '',
    '[[operator]]', 'name = "sink"', 'kind = "sink"', 'function = "agent.operators.builtin:counting_sink"', '',
])


def keyed_spec(instance: str, operator: str, keeper: bool = False, **extra: Any) -> Dict[str, Any]:
    return {**spec(instance, operator, keeper, **extra), "pipeline_toml": KEYED_PIPE}


def keyed_instance(name: str, owned: Dict[int, int], restart: bool = False, keyed: Any = None,
                   state: Any = None, **extra: Any) -> Any:
    """A sans-IO instance of the keyed count `cnt` owning `owned` (group -> version), started;
    `restart`: restarted with the saved keyed state `keyed` (a re-home: its standby copy) and
    the saved instance state `state` (a crash restart: its own files)."""
    from agent.config import load_pipeline_text
    from agent.instance.core import Instance
    from agent.instance.events import Restarted, Started
    from agent.instance.handover import Member
    from agent.instance.spec import InstanceSpec
    from agent.operators.builtin import OperatorContext
    from agent.operators.keyed import KeyedCount
    from foglab.sim.instance_check import BROKER, CLUSTER, WALL0

    s = InstanceSpec(name, "cnt", "n2", CLUSTER, "p", KEYED_PIPE, BROKER, succs=("p.sink.0",), preds=("p.op.0",),
                     keeper=name == "p.cnt.0", state_dir="/nonexistent", heartbeat_period=3600.0,
                     restart=restart, extra=dict(extra))
    inst = Instance(s, load_pipeline_text(KEYED_PIPE, "test"),
                    KeyedCount(OperatorContext(name, "cnt", "n2", "map", params={})))
    if restart:
        inst.handle(Restarted(WALL0, dict(state or {}), keyed=keyed), 0.0)
        return inst
    inst.moves.member = Member(name, owned)
    inst.moves.versions = dict(owned)
    inst.handle(Started(WALL0), 0.0)
    return inst


def test_a_group_moving_off_a_live_leaver_stays_in_the_table_of_a_predecessor_rehomed_meanwhile() -> None:
    """Two copies on n2 are leaving, each handing its groups to the keeper on n1, when n1 (the
    keeper and the predecessor in_zone) is lost; their Redirects never reached in_zone. Were a group
    moving out reported by no instance (the leaver counting only its settled groups, the keeper not
    having taken the Offer), the re-homed in_zone would deal its table again and refuse the leavers'
    Redirects sent again after the silence for ever ("which does not own it"; CHANGELOG.md, "A node
    lost while key groups moved left its re-homed keyed window stalled"). The leaver reports such a
    group at its version before the move: the table names the leaver, the Redirect sent again is
    taken and its Eos goes back, and the re-homed keeper resumes only its own groups (the leaver's
    come with their state, its chunk standing for the lost Offer)."""
    from agent.dataplane.owners import groups_from_runs
    from agent.instance.groups import restored_table
    from agent.instance.handover import Eos, Predecessor, Redirect, Send

    keeper = keyed_instance("p.cnt.0", {g: 0 for g in range(4)})
    leaver = keyed_instance("cnt-b", {g: 1 for g in range(4, 8)})
    leaver.moves.hand_rest("p.cnt.0", ["p.op.0"])  # leaving: Redirects to p.op.0, lost with n1
    assert set(leaver.moves.member.old.moving) == {4, 5, 6, 7}
    reports = {"p.cnt.0": keeper.snapshot_stats()["groups"], "cnt-b": leaver.snapshot_stats()["groups"]}
    assert reports["cnt-b"] == [[4, 7, 1]]  # still its own, at the version before the move
    hosted = {"n1": [keyed_spec("p.source.0", "source", True), keyed_spec("p.op.0", "op", True),
                     keyed_spec("p.cnt.0", "cnt", True), keyed_spec("p.sink.0", "sink", True)],
              "n2": [keyed_spec("cnt-b", "cnt", creator="p.cnt.0")]}
    plan = {d["instance"]: d for d in plan_rehome("n1", hosted, {"n2"}, {"cnt-b"}, 0, groups=reports)}
    op = plan["p.op.0"]
    assert op["succs"] == ["cnt-b", "p.cnt.0"]
    table = restored_table({}, op["succs"], 8, {}, op["extra"].get("succ_groups"))
    assert table is not None
    assert [(table.owner(g), table.version(g)) for g in range(8)] == [("p.cnt.0", 0)] * 4 + [("cnt-b", 1)] * 4
    pred = Predecessor("p.op.0", table)
    for g, (new, _) in sorted(leaver.moves.member.old.moving.items()):  # sent again after MOVE_RESEND
        v = leaver.moves.member.old.versions[g]
        assert pred.on_redirect("cnt-b", Redirect(g, new, v)) == [Send("cnt-b", Eos(g, "p.op.0"))]
        assert (table.owner(g), table.version(g)) == ("p.cnt.0", 2)
    assert groups_from_runs(plan["p.cnt.0"]["extra"]["owned_groups"], 8) == {g: 0 for g in range(4)}


def test_a_keyed_copy_its_lost_node_never_listed_is_rehomed_owning_no_group() -> None:
    """Same run: the keeper had created a copy on n1 a moment before n1 was lost, before n1's state
    listed it. Re-homed with no group list, it held the dealing (every group: "handing 128 key
    groups" when it left) next to the keeper and the leavers, and they refused each other's
    Redirects ("group 0 is already owned or expected"). A copy of a keyed operator with no
    report owns no group; a copy of a plain operator is not told any."""
    hosted = {"n1": [keyed_spec("p.op.0", "op", True), keyed_spec("p.cnt.0", "cnt", True),
                     keyed_spec("cnt-c", "cnt", creator="p.cnt.0"), keyed_spec("op-b", "op", creator="p.op.0")],
              "n2": [keyed_spec("p.source.0", "source", True), keyed_spec("p.sink.0", "sink", True)]}
    plan = {d["instance"]: d for d in plan_rehome("n1", hosted, {"n2"}, set(), 0,
                                                  groups={"p.cnt.0": [[0, 7, 0]]})}
    assert plan["cnt-c"]["extra"]["owned_groups"] == []
    assert "owned_groups" not in plan["op-b"]["extra"] and "owned_groups" not in plan["p.op.0"]["extra"]
    copy = keyed_instance("cnt-c", {}, restart=True, owned_groups=plan["cnt-c"]["extra"]["owned_groups"],
                          min_epoch=1_800_000_000)
    assert copy.moves.member.owned == set() and copy.snapshot_stats()["groups"] == []
    # with no report of any instance of the operator, nothing is known: as before, no list
    bare = {d["instance"]: d for d in plan_rehome("n1", hosted, {"n2"}, set(), 0)}
    assert "owned_groups" not in bare["cnt-c"]["extra"]


def test_a_group_handed_out_by_a_live_leaver_goes_to_its_new_owner_in_a_rehomed_predecessors_table() -> None:
    """in_zone has taken a leaver's Redirect of a group (its table: the keeper, version 3) and the
    leaver every Eos, so the leaver has sent the group's state, when the keeper's node (with
    in_zone) is lost. The leaver no longer owns the group, the keeper has not installed it: with no
    report naming it, the re-homed in_zone would deal its table again and refuse every mover's
    Redirect ("which does not own it"; CHANGELOG.md, "A node lost while key groups moved left its
    re-homed keyed window stalled"). The leaver reports what it handed out and is not installed yet
    (`handed`); the re-homed predecessor's table names the new owner at the move's version, and the
    re-homed keeper takes the chunks sent again after the silence as the Offer its dead incarnation
    got."""
    from agent.dataplane.owners import TableError, table_from_reports
    from agent.instance.groups import restored_table
    from agent.instance.moves import encode
    from agent.instance.handover import Eos

    keeper = keyed_instance("p.cnt.0", {g: 0 for g in range(4)})
    leaver = keyed_instance("cnt-b", {g: 2 for g in range(4, 8)})
    leaver.moves.hand_rest("p.cnt.0", ["p.op.0"])
    leaver.moves.on_message("p.op.0", encode(Eos(5, "p.op.0")))  # in_zone took group 5's Redirect
    leaver.moves.hand_out_turn()
    leaver.moves.flush()
    stats = leaver.snapshot_stats()
    assert stats["groups"] == [[4, 4, 2], [6, 7, 2]] and stats["handed"] == [[5, "p.cnt.0", 3]]
    reports = {"p.cnt.0": keeper.snapshot_stats()["groups"], "cnt-b": stats["groups"]}
    with pytest.raises(TableError):  # group 5: reported by no instance
        table_from_reports(reports, 8)
    hosted = {"n1": [keyed_spec("p.source.0", "source", True), keyed_spec("p.op.0", "op", True),
                     keyed_spec("p.cnt.0", "cnt", True), keyed_spec("p.sink.0", "sink", True)],
              "n2": [keyed_spec("cnt-b", "cnt", creator="p.cnt.0")]}
    plan = {d["instance"]: d for d in plan_rehome("n1", hosted, {"n2"}, {"cnt-b"}, 0, groups=reports,
                                                  handed={"cnt-b": stats["handed"], "x": [[5, 7]], "y": "bad"})}
    op = plan["p.op.0"]
    table = restored_table({}, op["succs"], 8, {}, op["extra"].get("succ_groups"))
    assert table is not None
    assert [(table.owner(g), table.version(g)) for g in range(8)] == (
        [("p.cnt.0", 0)] * 4 + [("cnt-b", 2), ("p.cnt.0", 3), ("cnt-b", 2), ("cnt-b", 2)])
    assert plan["p.cnt.0"]["extra"]["owned_groups"] == [[0, 3, 0]]  # not group 5: its state is not there
    # the re-homed keeper: group 5's chunks, sent again by the leaver, install it
    again = keyed_instance("p.cnt.0", {}, restart=True, owned_groups=plan["p.cnt.0"]["extra"]["owned_groups"],
                           min_epoch=1_800_000_000)
    (_, _, bodies) = leaver.moves.outgoing[5]
    assert bodies
    for body in bodies:
        again.moves.on_message("cnt-b", body)
    again.moves.take_in_turn()
    assert again.moves.member.owned == {0, 1, 2, 3, 5} and again.moves.versions[5] == 3
    assert again.stats["handover_errors"] == 0


def test_a_rehomed_old_owner_starts_again_the_moves_a_live_new_owner_waits_for() -> None:
    """The keeper's node is lost while its copy on another node waits for its share (the Start
    named the groups, the keeper's Redirects and state had not all gone): the keeper's re-homed
    incarnation resumed the groups as its own and no longer knew it was moving them, and the copy
    held their records and waited for their state for ever (never settled). A keyed instance
    reports the groups on their way to it (`expecting`); the plan gives the re-homed old owner
    those groups at the version before the move and the moves to start again, and a group a live
    sibling reports at a newer version (moved on since the lost node's last state) is not its."""
    from agent.dataplane.owners import table_from_reports
    from agent.instance.handover import Eos, Predecessor, Redirect, Send

    copy = keyed_instance("cnt-b", {8 - 1: 1})
    for g in range(4, 7):
        copy.moves.expect(g, "p.cnt.0", 1)
    stats = copy.snapshot_stats()
    assert stats["expecting"] == [[4, "p.cnt.0", 1], [5, "p.cnt.0", 1], [6, "p.cnt.0", 1]]
    reports = {"p.cnt.0": [[0, 7, 0]], "cnt-b": stats["groups"]}  # the keeper's last state: group 7 not moved yet
    hosted = {"n1": [keyed_spec("p.source.0", "source", True), keyed_spec("p.op.0", "op", True),
                     keyed_spec("p.cnt.0", "cnt", True), keyed_spec("p.sink.0", "sink", True)],
              "n2": [keyed_spec("cnt-b", "cnt", creator="p.cnt.0")]}
    plan = {d["instance"]: d for d in plan_rehome(
        "n1", hosted, {"n2"}, {"cnt-b"}, 0, groups=reports,
        expecting={"cnt-b": stats["expecting"] + [[9, 1, 1], "bad"], "p.cnt.0": [[0, "cnt-b", 1]]})}
    extra = plan["p.cnt.0"]["extra"]
    assert extra["owned_groups"] == [[0, 6, 0]]  # 7 is cnt-b's (version 1); 4-6 the keeper's until they move
    assert extra["moves_out"] == [[4, "cnt-b", 1], [5, "cnt-b", 1], [6, "cnt-b", 1]]
    keeper = keyed_instance("p.cnt.0", {}, restart=True, **extra)
    m = keeper.moves.member
    assert m.owned == set(range(7)) and {g: new for g, (new, _) in m.old.moving.items()} == {
        4: "cnt-b", 5: "cnt-b", 6: "cnt-b"}
    assert {g: m.old.versions[g] for g in m.old.moving} == {4: 1, 5: 1, 6: 1}
    # the re-homed predecessor's table names the keeper at version 0: it takes the Redirects
    table = table_from_reports(plan["p.op.0"]["extra"]["succ_groups"], 8)
    pred = Predecessor("p.op.0", table)
    for g in (4, 5, 6):
        assert pred.on_redirect("p.cnt.0", Redirect(g, "cnt-b", 1)) == [Send("p.cnt.0", Eos(g, "p.op.0"))]
    # a copy that is not expecting anything from the keeper: no move starts again
    assert "moves_out" not in {d["instance"]: d for d in plan_rehome(
        "n1", hosted, {"n2"}, {"cnt-b"}, 0, groups=reports)}["p.cnt.0"]["extra"]


def test_a_group_installed_at_a_lost_copy_before_its_standby_held_it_goes_again_from_its_lost_old_owner() -> None:
    """The keeper hands groups to a copy on its own node and the copy installs them, but the node
    is lost before the copy's standby holds the save that installed them (its Installed waits
    for that). Had the copy's heartbeat said it owned them, its re-homed incarnation would resume
    them empty while the keeper's standby copy still holds their state, and when the copy hands
    them back the keeper would keep its older state over them: the records applied in between
    lost (CHANGELOG.md, "A copy lost with its node right after installing a group resumed it
    empty"). A group whose Installed has not left is reported as on its way (`expecting`), and a
    lost old owner resumes it and sends it again to its lost new owner, which installs it from
    the chunks."""
    from agent.dataplane.keygroups import key_group
    from agent.dataplane.owners import groups_from_runs, table_from_reports
    from agent.instance.handover import Eos, Predecessor, Redirect, Send
    from agent.instance.moves import encode

    g = key_group("a", 8)
    keeper = keyed_instance("p.cnt.0", {x: 0 for x in range(8)}, replicate=True)
    keeper.keyed.apply("p.source.0", [("p.source.0", 0, {"k": "a"}), ("p.source.0", 1, {"k": "a"})], 1)
    copy = keyed_instance("cnt-b", {}, replicate=True)
    keeper.moves.start(g, "cnt-b", ["p.op.0"])
    keeper.moves.on_message("p.op.0", encode(Eos(g, "p.op.0")))
    keeper.moves.hand_out_turn()
    keeper.moves.flush()
    keeper.moves.replicated((10 ** 9, 0))  # the keeper's standby holds it: its chunks leave
    (_, v, bodies) = keeper.moves.outgoing[g]
    assert bodies and v == 1
    for body in bodies:
        copy.moves.on_message("p.cnt.0", body)
    copy.moves.take_in_turn()
    copy.moves.flush()  # installed; its Installed waits for the copy's standby
    assert g in copy.moves.member.owned and copy.moves.after_copy
    stats, kstats = copy.snapshot_stats(), keeper.snapshot_stats()
    assert stats["groups"] == [] and stats["expecting"] == [[g, "p.cnt.0", 1]]
    assert kstats["handed"] == [[g, "cnt-b", 1]]
    # both on n1, lost: the keeper resumes the group (its standby copy holds it until the
    # Installed) and starts its move again; the copy is not given it
    hosted = {"n1": [keyed_spec("p.op.0", "op", True), keyed_spec("p.cnt.0", "cnt", True),
                     keyed_spec("cnt-b", "cnt", creator="p.cnt.0")],
              "n2": [keyed_spec("p.source.0", "source", True), keyed_spec("p.sink.0", "sink", True)]}
    plan = {d["instance"]: d for d in plan_rehome(
        "n1", hosted, {"n2"}, set(), 0, groups={"p.cnt.0": kstats["groups"], "cnt-b": stats["groups"]},
        handed={"p.cnt.0": kstats["handed"]}, expecting={"cnt-b": stats["expecting"]})}
    assert plan["cnt-b"]["extra"]["owned_groups"] == []
    k_extra = plan["p.cnt.0"]["extra"]
    assert k_extra["moves_out"] == [[g, "cnt-b", 1]]
    assert groups_from_runs(k_extra["owned_groups"]) == {x: 0 for x in range(8)}
    # the re-homed predecessor routes the group to the copy and answers the keeper's Redirect at once
    table = table_from_reports(plan["p.op.0"]["extra"]["succ_groups"], 8)
    assert (table.owner(g), table.version(g)) == ("cnt-b", 1)
    pred = Predecessor("p.op.0", table)
    assert pred.on_redirect("p.cnt.0", Redirect(g, "cnt-b", 1)) == [Send("p.cnt.0", Eos(g, "p.op.0"))]
    # the re-homed keeper (its standby copy) sends the group again; the re-homed copy installs it
    keeper2 = keyed_instance("p.cnt.0", {}, restart=True, keyed=keeper.keyed.to_json(), **k_extra)
    copy2 = keyed_instance("cnt-b", {}, restart=True, **plan["cnt-b"]["extra"])
    assert keeper2.moves.member.old.moving == {g: ("cnt-b", {"p.op.0"})}
    keeper2.moves.on_message("p.op.0", encode(Eos(g, "p.op.0")))
    keeper2.moves.hand_out_turn()
    keeper2.moves.flush()
    (_, _, again) = keeper2.moves.outgoing[g]
    for body in again:
        copy2.moves.on_message("p.cnt.0", body)
    copy2.moves.take_in_turn()
    assert g in copy2.moves.member.owned and copy2.stats["handover_errors"] == 0
    assert copy2.keyed.states[g] == keeper.keyed.states[g] and copy2.keyed.states[g]
    # once the standby holds the save that installed it, the Installed leaves: the group is ours
    copy.moves.replicated(copy.moves.after_copy[-1][0])
    assert copy.snapshot_stats()["groups"] == [[g, g, 1]] and copy.snapshot_stats()["expecting"] == []


def test_a_group_a_lost_copys_standby_holds_is_not_sent_again_from_its_lost_old_owner() -> None:
    """The case next to the one above: the copy's standby copy did hold the save that installed
    the group (its `owned` says so), but the node was lost before a heartbeat said more than
    `expecting`. The copy's newest word owns the group at the move's version: it resumes it with
    its state, and the keeper, whose report still names the move, neither resumes the group nor
    sends it again (two owners of one group, each with its windows)."""
    hosted = {"n1": [keyed_spec("p.op.0", "op", True), keyed_spec("p.cnt.0", "cnt", True, standby="n2"),
                     keyed_spec("cnt-b", "cnt", creator="p.cnt.0", standby="n2")],
              "n2": [keyed_spec("p.source.0", "source", True), keyed_spec("p.sink.0", "sink", True)]}
    g = 3
    keeper_groups = [[x, x, 0] for x in range(8)]
    plan = {d["instance"]: d for d in plan_rehome(
        "n1", hosted, {"n2"}, set(), 0, groups={"p.cnt.0": keeper_groups, "cnt-b": []},
        handed={"p.cnt.0": [[g, "cnt-b", 1]]}, expecting={"cnt-b": [[g, "p.cnt.0", 1]]},
        standby_groups={"cnt-b": [[g, g, 1]]})}
    from agent.dataplane.owners import groups_from_runs
    assert groups_from_runs(plan["cnt-b"]["extra"]["owned_groups"]) == {g: 1}
    k_extra = plan["p.cnt.0"]["extra"]
    assert k_extra.get("moves_out", []) == []
    assert g not in groups_from_runs(k_extra["owned_groups"])


def test_a_leaver_says_installed_again_so_an_old_owner_whose_installed_was_lost_stops_waiting() -> None:
    """A copy installed a group and its Installed waited, in memory, for the standby copy of that
    save; the worker ended first (its agent killed: a drain) and restarted from its own files, then
    handed the group on and left. The old owner's chunks sent again after the silence reached
    nobody: it waited for that Installed for ever and never scaled in (not settled, two cells
    instances at the end). The groups installed are saved with the instance state and a leaver
    says Installed again for each; the old owner takes an Installed only from its move's new owner."""
    from agent.dataplane.envelope import Kind, decode
    from agent.dataplane.keygroups import key_group
    from agent.instance.commands import Publish
    from agent.instance.handover import Eos, Installed
    from agent.instance.moves import encode

    g = key_group("a", 8)
    keeper = keyed_instance("p.cnt.0", {x: 0 for x in range(8)})
    copy = keyed_instance("cnt-b", {}, replicate=True)
    keeper.moves.start(g, "cnt-b", ["p.op.0"])
    keeper.moves.on_message("p.op.0", encode(Eos(g, "p.op.0")))
    keeper.moves.hand_out_turn()
    keeper.moves.flush()
    for body in keeper.moves.outgoing[g][2]:
        copy.moves.on_message("p.cnt.0", body)
    copy.moves.take_in_turn()
    copy.moves.flush()
    assert copy.moves.after_copy  # the Installed waits for the standby copy: then the worker ends
    again = keyed_instance("cnt-b", {}, restart=True, keyed=copy.keyed.to_json(), state=copy.persisted_state(),
                           replicate=True)
    assert g in again.moves.member.owned and g in keeper.moves.member.old.waiting_install
    # an Installed from another instance than the move's new owner does not end the wait
    keeper.moves.on_message("cnt-c", encode(Installed(g)))
    assert g in keeper.moves.member.old.waiting_install
    sent = [decode(c.payload) for c in again.moves.installed_again() if isinstance(c, Publish)]
    bodies = [e.body for e in sent if e.kind is Kind.PROTO]
    assert bodies == [encode(Installed(g))]  # leaving: every group it installed, said again
    keeper.moves.on_message("cnt-b", bodies[0])
    assert g not in keeper.moves.member.old.waiting_install and not keeper.moves.member.busy()


def test_groups_no_instance_reports_are_the_lost_keepers_when_nothing_else_there_may_hold_them() -> None:
    """A leaver hands its groups to the keeper and leaves a second before the keeper's node is lost;
    the node's last state still shows the keeper without them, and the leaver is gone: no instance
    reports them, and a re-homed in_zone that dealt its table again would refuse every Redirect
    (CHANGELOG.md, "A node lost while key groups moved left its re-homed keyed window stalled"). A
    live instance's report is fresh, so such groups moved onto the lost node after its last state;
    when its keeper is the only instance there that may hold them (the others reported, or are
    copies that said nothing), they are the keeper's, at version 0 on both sides. An instance of the
    lost node that said nothing and is not a copy may hold them: then nothing is guessed."""
    from agent.dataplane.owners import table_from_reports

    hosted = {"n1": [keyed_spec("p.op.0", "op", True), keyed_spec("p.cnt.0", "cnt", True),
                     keyed_spec("cnt-c", "cnt", creator="p.cnt.0")],
              "n2": [keyed_spec("p.source.0", "source", True), keyed_spec("p.sink.0", "sink", True),
                     keyed_spec("cnt-b", "cnt", creator="p.cnt.0")]}
    reports = {"p.cnt.0": [[0, 3, 1]], "cnt-b": [[6, 7, 2]]}  # 4 and 5: installed at the keeper since
    plan = {d["instance"]: d for d in plan_rehome("n1", hosted, {"n2"}, {"cnt-b"}, 0, groups=reports)}
    assert plan["p.cnt.0"]["extra"]["owned_groups"] == [[0, 3, 1], [4, 5, 0]]
    assert plan["cnt-c"]["extra"]["owned_groups"] == []
    table = table_from_reports(plan["p.op.0"]["extra"]["succ_groups"], 8)
    assert [(table.owner(g), table.version(g)) for g in range(8)] == (
        [("p.cnt.0", 1)] * 4 + [("p.cnt.0", 0)] * 2 + [("cnt-b", 2)] * 2)
    # the copy on the lost node is no copy (no creator) and said nothing: the groups may be its
    hosted["n1"][2] = keyed_spec("cnt-c", "cnt")
    plan = {d["instance"]: d for d in plan_rehome("n1", hosted, {"n2"}, {"cnt-b"}, 0, groups=reports)}
    assert plan["p.cnt.0"]["extra"]["owned_groups"] == [[0, 3, 1]]


def test_a_group_the_lost_keeper_was_moving_on_has_one_version_in_its_list_and_its_predecessors_table() -> None:
    """The lost keeper's last state lacks a group (it came from a leaver since) and a live copy
    waits for it (version 3). The keeper resumes it at version 2 and sends its Redirect again at 3;
    given the group as an unreported one at version 0, its re-homed predecessor would refuse it
    ("Redirect of group 19 to version 3, after version 0") and the copy would never leave
    (CHANGELOG.md, "A node lost while key groups moved left its re-homed keyed window stalled").
    Both take what the keeper resumes."""
    from agent.dataplane.owners import table_from_reports
    from agent.instance.handover import Eos, Predecessor, Redirect, Send

    hosted = {"n1": [keyed_spec("p.op.0", "op", True), keyed_spec("p.cnt.0", "cnt", True)],
              "n2": [keyed_spec("p.source.0", "source", True), keyed_spec("p.sink.0", "sink", True),
                     keyed_spec("cnt-b", "cnt", creator="p.cnt.0")]}
    plan = {d["instance"]: d for d in plan_rehome(
        "n1", hosted, {"n2"}, {"cnt-b"}, 0, groups={"p.cnt.0": [[0, 3, 0]], "cnt-b": [[6, 7, 1]]},
        expecting={"cnt-b": [[4, "p.cnt.0", 3], [5, "p.cnt.0", 3]]})}
    assert plan["p.cnt.0"]["extra"]["owned_groups"] == [[0, 3, 0], [4, 5, 2]]
    assert plan["p.cnt.0"]["extra"]["moves_out"] == [[4, "cnt-b", 3], [5, "cnt-b", 3]]
    table = table_from_reports(plan["p.op.0"]["extra"]["succ_groups"], 8)
    assert [table.version(g) for g in range(8)] == [0, 0, 0, 0, 2, 2, 1, 1]
    pred = Predecessor("p.op.0", table)
    assert pred.on_redirect("p.cnt.0", Redirect(4, "cnt-b", 3)) == [Send("p.cnt.0", Eos(4, "p.op.0"))]


def test_a_move_both_ends_on_the_lost_node_completed_after_its_last_state_follows_the_standby_copies() -> None:
    """The keeper creates a copy on its own node and hands it its share; the node is lost before its
    state lists the copy. Re-homed owning no group although its standby copy holds the groups it
    installed, while the keeper resumes them from its older report and its own copy has forgotten
    them, the copy would start their windows over (CHANGELOG.md, "A keyed copy lost with its node
    just after a move resumed its groups without their state"). The standby copies say which groups
    each instance owns as of the save they hold (an Installed leaves only once that save is copied):
    the newer word wins, group by group."""
    hosted = {"n1": [keyed_spec("p.op.0", "op", True), keyed_spec("p.cnt.0", "cnt", True, standby="n2"),
                     keyed_spec("cnt-c", "cnt", creator="p.cnt.0", standby="n2")],
              "n2": [keyed_spec("p.source.0", "source", True), keyed_spec("p.sink.0", "sink", True)]}
    last_state = {"p.cnt.0": [[0, 7, 0]]}  # n1's last retained state: before the copy took groups 4-7
    for keeper_copy in ([[0, 3, 0]], [[0, 7, 0]]):  # the keeper's copy after the move, or one save behind
        plan = {d["instance"]: d for d in plan_rehome(
            "n1", hosted, {"n2"}, set(), 0, groups=last_state,
            standby_groups={"p.cnt.0": keeper_copy, "cnt-c": [[4, 7, 1]]})}
        assert plan["cnt-c"]["extra"]["owned_groups"] == [[4, 7, 1]], keeper_copy
        assert plan["p.cnt.0"]["extra"]["owned_groups"] == [[0, 3, 0]], keeper_copy
        assert plan["p.op.0"]["extra"]["succ_groups"] == {"p.cnt.0": [[0, 3, 0]], "cnt-c": [[4, 7, 1]]}
    # a copy older than the node's last state changes nothing: the report's newer versions stay
    plan = {d["instance"]: d for d in plan_rehome(
        "n1", hosted, {"n2"}, set(), 0, groups={"p.cnt.0": [[0, 3, 0], [4, 7, 2]], "cnt-c": []},
        standby_groups={"p.cnt.0": [[0, 3, 0]], "cnt-c": [[4, 7, 1]]})}
    assert plan["p.cnt.0"]["extra"]["owned_groups"] == [[0, 3, 0], [4, 7, 2]]
    assert plan["cnt-c"]["extra"]["owned_groups"] == []


def test_a_rehomed_keyed_instance_forgets_the_groups_of_its_standby_copy_it_is_not_given(tmp_path: Path) -> None:
    """The worker side: re-homed with its standby copy, the old owner of a move whose new owner
    holds the groups at a newer version is not given them (plan above), but its copy may still
    hold their state (saved before it handed them out): kept, their timers fired their windows
    there a second time, with older contents. They are forgotten; its own groups stay."""
    from agent.instance.keyed_state import KeyedState

    old = keyed_instance("p.cnt.0", {g: 0 for g in range(8)})
    assert old.keyed is not None
    old.keyed.apply("p.op.0", [("p.source.0", j, {"k": f"k{j}"}) for j in range(64)], 0)
    held = set(old.keyed.states)
    assert held & set(range(4)) and held - set(range(4))  # keys in both halves
    old.keyed.save(tmp_path / "c.keyed.json")
    again = _restarted_keyed("p.cnt.0", KeyedState.load(tmp_path / "c.keyed.json"), owned_groups=[[0, 3, 0]],
                             min_epoch=1_800_000_000)
    assert again.moves.member.owned == set(range(4))
    assert set(again.keyed.states) == held & set(range(4))
    assert again.snapshot_stats()["groups"] == [[0, 3, 0]]


def _restarted_keyed(name: str, keyed: Any, **extra: Any) -> Any:
    """A sans-IO keyed count `cnt` restarted with a saved keyed state (a re-home's standby copy)."""
    from agent.config import load_pipeline_text
    from agent.instance.core import Instance
    from agent.instance.events import Restarted
    from agent.instance.spec import InstanceSpec
    from agent.operators.builtin import OperatorContext
    from agent.operators.keyed import KeyedCount
    from foglab.sim.instance_check import BROKER, CLUSTER, WALL0

    s = InstanceSpec(name, "cnt", "n2", CLUSTER, "p", KEYED_PIPE, BROKER, succs=("p.sink.0",), preds=("p.op.0",),
                     keeper=name == "p.cnt.0", state_dir="/nonexistent", heartbeat_period=3600.0,
                     restart=True, extra=dict(extra))
    inst = Instance(s, load_pipeline_text(KEYED_PIPE, "test"),
                    KeyedCount(OperatorContext(name, "cnt", "n2", "map", params={})))
    inst.handle(Restarted(WALL0, {}, keyed=keyed), 0.0)
    return inst


def test_a_rehome_goes_to_the_standby_holding_its_copy_even_with_its_slots_taken(tmp_path: Path) -> None:
    """Two keyed copies lost with n3 have their standby copies on n1, which has a free slot for
    one: placed on n2, the other would resume its key groups empty (CHANGELOG.md, "A keyed copy
    lost with its node just after a move resumed its groups without their state"). The standby
    comes first in a re-home's ranking also when placement skips it for want of a slot, and
    starts the instance beyond its slots when it holds its copy (not while it drains)."""
    import json as _json

    from agent.instance.spec import InstanceSpec
    from agent.node import spawns
    from foglab.sim.instance_check import BROKER

    agent = _agent(tmp_path)
    root = agent.core.replication.store.root
    root.mkdir(parents=True)
    (root / "cnt-c.keyed.json").write_text("{}")
    (root / "cnt-c.replica.json").write_text(_json.dumps({"host": "n3", "gen": 1, "log": 0, "owned": [[0, 3, 1]]}))

    def job(instance: str, standby: str) -> Any:
        return InstanceSpec(instance, "cnt", "me", "c", "p", KEYED_PIPE, BROKER, restart=True,
                            extra={"standby": standby, "min_epoch": 1_800_000_000})

    assert agent.core.creating.here.beyond_slots(job("cnt-c", "me"), "rehome")
    assert not agent.core.creating.here.beyond_slots(job("cnt-d", "me"), "rehome")  # no copy here
    assert not agent.core.creating.here.beyond_slots(job("cnt-c", "n2"), "rehome")  # its copy is said to be elsewhere
    assert not agent.core.creating.here.beyond_slots(job("cnt-c", "me"), "spawn")
    agent.core.drain.draining = True
    assert not agent.core.creating.here.beyond_slots(job("cnt-c", "me"), "rehome")
    agent.core.drain.draining = False
    # first in the ranking, with no free slot in the fleet views (placement skips it)
    tried: List[Any] = []
    agent.core.creating.handle = lambda e, now: tried.append(  # type: ignore[method-assign]
        spawns.candidates(e.ranking, e.spec, e.cause, agent.node, e.online))
    agent.core.view.online["n2"] = True
    agent.core.creating.create(job("cnt-c", "n2"), lambda _r: None, cause="rehome", now=0.0)
    agent.core.creating.create(job("cnt-c", "n2"), lambda _r: None, cause="spawn", now=0.0)
    assert tried[0][0] == "n2" and "n2" not in tried[1]


def test_a_standby_lists_what_its_copies_of_an_offline_host_own_and_the_rehome_reads_it(tmp_path: Path) -> None:
    """The daemon side of the standby copies' word: a standby lists in its retained state what
    the copies it holds of an offline host say they own (`standby_groups`; not while the host is
    online: nobody needs it then), publishing its state again when the host goes offline; the
    re-homing agent reads it from the standby each lost instance's hosted record names (its own
    store when that is itself)."""
    import json as _json

    import paho.mqtt.client as mqtt

    from agent import topics
    from agent.node import rehoming

    agent = _agent(tmp_path)
    root = agent.core.replication.store.root
    root.mkdir(parents=True)
    (root / "cnt-c.keyed.json").write_text("{}")
    (root / "cnt-c.replica.json").write_text(_json.dumps({"host": "n3", "gen": 1, "log": 0, "owned": [[0, 3, 1]]}))

    def status(node: str, payload: bytes) -> None:
        topic = topics.agent_status("c", node)
        msg = mqtt.MQTTMessage(topic=topic.encode())
        msg.payload = payload
        agent.core.inbound.on_status(msg, topics.parse("c", topic), 0.0)

    status("n3", b"online")
    assert "standby_groups" not in agent.core.state_doc()
    agent.core._state_dirty = False
    status("n3", b"offline")
    assert agent.core._state_dirty  # published again at once
    assert agent.core.state_doc()["standby_groups"] == {"cnt-c": [[0, 3, 1]]}
    agent.core.view.hosted_by_node["n3"] = [keyed_spec("cnt-c", "cnt", creator="p.cnt.0", standby="me"),
                                       keyed_spec("cnt-d", "cnt", creator="p.cnt.0", standby="n2"),
                                       keyed_spec("cnt-e", "cnt", creator="p.cnt.0", standby="n4")]
    agent.core.view.online.update(n2=True, n4=False)
    agent.core.view.fleet["n2"] = {"standby_groups": {"cnt-d": [[4, 7, 2]], "cnt-x": [[0, 0, 0]]}}
    agent.core.view.fleet["n4"] = {"standby_groups": {"cnt-e": [[0, 0, 9]]}}  # offline: not read
    v = agent.core.view  # what the re-homing agent passes (agent.node.rehomer, Rehomer.tick)
    got = rehoming.standby_groups(agent.node, "n3", v.hosted_by_node, agent.core.replication.store.owned(["n3"]), v.fleet,
                                  v.online)
    assert got == {"cnt-c": [[0, 3, 1]], "cnt-d": [[4, 7, 2]]}


def test_a_copy_idle_in_the_lost_nodes_last_state_whose_standby_copy_owns_groups_is_rehomed_active() -> None:
    """R16's schedule, seeds 6 and 7: the keeper's copy was idle in n1's last state and had
    started and taken 8 groups since (its standby copy said so); re-homed idle with them, it was
    left out of the re-homed in_zone's successors, which found "8 groups reported by no
    instance" and dealt its table again. It started: it is re-homed active, a successor."""
    hosted = {"n1": [keyed_spec("p.op.0", "op", True), keyed_spec("p.cnt.0", "cnt", True, standby="n2"),
                     keyed_spec("cnt-c", "cnt", creator="p.cnt.0", standby="n2")],
              "n2": [keyed_spec("p.source.0", "source", True), keyed_spec("p.sink.0", "sink", True)]}
    plan = {d["instance"]: d for d in plan_rehome(
        "n1", hosted, {"n2"}, set(), 0, idle={"cnt-c"}, groups={"p.cnt.0": [[0, 7, 0]]},
        standby_groups={"p.cnt.0": [[0, 3, 0]], "cnt-c": [[4, 7, 1]]})}
    assert plan["cnt-c"]["active"] and plan["cnt-c"]["extra"]["owned_groups"] == [[4, 7, 1]]
    assert "cnt-c" in plan["p.op.0"]["succs"]
    assert plan["p.op.0"]["extra"]["succ_groups"] == {"p.cnt.0": [[0, 3, 0]], "cnt-c": [[4, 7, 1]]}
    idle = {d["instance"]: d for d in plan_rehome(  # a copy that owns nothing stays idle
        "n1", hosted, {"n2"}, set(), 0, idle={"cnt-c"}, groups={"p.cnt.0": [[0, 7, 0]]},
        standby_groups={"cnt-c": []})}
    assert not idle["cnt-c"]["active"] and "cnt-c" not in idle["p.op.0"]["succs"]


def test_a_rehomed_new_owner_that_handed_a_resumed_group_on_does_not_take_its_old_owners_offer_again() -> None:
    """A leaving copy is handing a group to the keeper (version 8) when the keeper's node is
    lost. The keeper's re-homed incarnation resumes the group at version 8 and hands it to a new
    copy (version 9); then the leaver's Offer of that move reaches it. Taking the Offer and the
    chunks would give the group two owners, the keeper with the leaver's older state, and the
    copy's hand-back would be refused ("already owned or expected"; CHANGELOG.md, "A re-homed
    new owner took its old owner's Offer again after handing the group on"). An Offer of a move
    no newer than one we had the group at is not taken; its chunks are answered Installed, so
    the leaver forgets the group."""
    from agent.instance.handover import Eos, Installed, Offer
    from agent.instance.moves import encode

    leaver = keyed_instance("cnt-b", {5: 2})
    leaver.moves.hand_rest("p.cnt.0", ["p.op.0"])  # group 5 to the keeper, version 3
    leaver.moves.on_message("p.op.0", encode(Eos(5, "p.op.0")))
    leaver.moves.hand_out_turn()
    leaver.moves.flush()
    (_, version, bodies) = leaver.moves.outgoing[5]
    assert version == 3 and bodies
    # the keeper re-homed with group 5 at the move's version, then handed it to a copy
    keeper = keyed_instance("p.cnt.0", {}, restart=True, owned_groups=[[0, 0, 0], [5, 5, 3]], min_epoch=1_800_000_000)
    assert keeper.moves.member.owned == {0, 5} and keeper.moves.versions[5] == 3
    keeper.moves.start(5, "cnt-d", ["p.op.0"])
    keeper.moves.on_message("p.op.0", encode(Eos(5, "p.op.0")))
    keeper.moves.hand_out_turn()
    keeper.moves.flush()
    keeper.moves.on_message("cnt-d", encode(Installed(5)))
    keeper.moves.flush()
    assert 5 not in keeper.moves.member.owned
    # the leaver's Offer and chunks of version 3, sent again
    keeper.moves.on_message("cnt-b", dict(encode(Offer(5)), v=3))
    for body in bodies:
        keeper.moves.on_message("cnt-b", body)
    keeper.moves.take_in_turn()
    assert 5 not in keeper.moves.member.owned and 5 not in keeper.moves.member.new.expected, "the group owned twice"
    assert ("cnt-b", encode(Installed(5))) in keeper.moves.deferred  # the leaver forgets it
    # the copy hands the group back (version 5): taken as any move
    keeper.moves.on_message("cnt-d", dict(encode(Offer(5)), v=5))
    assert keeper.moves.member.new.expected == {5: "cnt-d"}
    assert keeper.stats["handover_errors"] == 0


def test_a_rehomed_new_owner_does_not_take_again_a_move_its_siblings_show_is_over() -> None:
    """A leaver hands a group to the keeper (version 3); the keeper installs it, but the leaver's
    Installed is lost, so it keeps sending its chunks again. The keeper hands the group on
    (version 4) to a copy, which is handing it back (version 5) when the keeper's node is lost.
    The re-homed keeper has no memory of the moves its dead incarnation completed: taking the
    old leaver's chunks of version 3 as a move whose Offer its loss had lost, it would install
    the group's old state and answer the copy's real hand-back Installed, so the copy would
    forget the newer state, and its later Redirects, carrying version 4, would be refused for
    ever by its predecessor (CHANGELOG.md, "A re-homed new owner took a move long over again from
    a leaver's chunks"). The plan tells the re-homed instance the newest version its siblings
    know of each group (`moved_on`): a move towards it no newer than that is over, its chunks are
    answered Installed; the copy's move, newer, is taken from its chunks."""
    from agent.instance.handover import Eos, Installed
    from agent.instance.moves import encode

    old = keyed_instance("cnt-a", {5: 2})  # the old leaver: group 5 to the keeper, version 3
    old.moves.hand_rest("p.cnt.0", ["p.op.0"])
    old.moves.on_message("p.op.0", encode(Eos(5, "p.op.0")))
    old.moves.hand_out_turn()
    old.moves.flush()
    (_, v_old, old_bodies) = old.moves.outgoing[5]
    assert v_old == 3 and old_bodies
    copy = keyed_instance("cnt-b", {5: 4})  # the copy the keeper handed it to (version 4), leaving
    copy.moves.hand_rest("p.cnt.0", ["p.op.0"])
    moving = copy.snapshot_stats()  # the Redirect out, no Eos yet: reported at the version before
    copy.moves.on_message("p.op.0", encode(Eos(5, "p.op.0")))
    copy.moves.hand_out_turn()
    copy.moves.flush()
    (_, v_new, new_bodies) = copy.moves.outgoing[5]
    assert v_new == 5 and new_bodies
    handed = copy.snapshot_stats()  # every Eos in: handed out
    hosted = {"n1": [keyed_spec("p.source.0", "source", True), keyed_spec("p.op.0", "op", True),
                     keyed_spec("p.cnt.0", "cnt", True), keyed_spec("p.sink.0", "sink", True)],
              "n2": [keyed_spec("cnt-b", "cnt", creator="p.cnt.0")],
              "n3": [keyed_spec("cnt-a", "cnt", creator="p.cnt.0")]}
    keeper_report = [[0, 4, 0], [6, 7, 0]]  # the keeper's last state: group 5 handed on to cnt-b
    for stats in (moving, handed):
        plan = {d["instance"]: d for d in plan_rehome(
            "n1", hosted, {"n2", "n3"}, {"cnt-a", "cnt-b"}, 0,
            groups={"p.cnt.0": keeper_report, "cnt-a": old.snapshot_stats()["groups"], "cnt-b": stats["groups"]},
            handed={"cnt-a": old.snapshot_stats()["handed"], "cnt-b": stats["handed"]},
            expecting={"cnt-a": [], "cnt-b": []})}
        extra = plan["p.cnt.0"]["extra"]
        assert extra["owned_groups"] == keeper_report
        assert extra["moved_on"] == [[5, 5, 4]]  # the copy's, before its move to us
        keeper = keyed_instance("p.cnt.0", {}, restart=True, **extra)
        # the old leaver's chunks of version 3, sent again: a move over long ago
        for body in old_bodies:
            keeper.moves.on_message("cnt-a", body)
        keeper.moves.take_in_turn()
        m = keeper.moves.member
        assert 5 not in m.owned and 5 not in m.new.expected, "the group's old state taken as a new move"
        assert ("cnt-a", encode(Installed(5))) in keeper.moves.deferred  # the old leaver forgets it
        # the copy's chunks of version 5 (its Offer went to the dead incarnation): taken, installed
        for body in new_bodies:
            keeper.moves.on_message("cnt-b", body)
        keeper.moves.take_in_turn()
        assert 5 in m.owned and keeper.moves.versions[5] == 5 and keeper.moves.installed_from[5] == "cnt-b"
        assert keeper.stats["handover_errors"] == 0


def test_a_move_only_its_predecessor_saw_begin_goes_again_from_the_lost_old_owner() -> None:
    """A keyed instance and the copy it has just created are lost together. It had handed the
    copy its share and the predecessor had taken the Redirects (its Eos went to the lost node),
    but neither end had reported the move: the old owner's last word still owns the group, the
    copy's standby lacks it. Resuming the group as its own and later handing it to the keeper,
    the old owner would have its Redirect refused for ever by the predecessor, which routes the
    group to the copy, and the copy would hold the group's records for ever (CHANGELOG.md, "A
    move only the predecessor had seen begin was forgotten when both its ends were lost"). The
    predecessor's report of the Redirects it took (`redirected`) makes the copy expect the
    group: the old owner starts that move again, the copy is not given it."""
    from agent.dataplane.owners import groups_from_runs

    hosted = {"n1": [keyed_spec("cnt-s", "cnt"), keyed_spec("cnt-o", "cnt", creator="cnt-s")],
              "n2": [keyed_spec("p.source.0", "source", True), keyed_spec("p.op.0", "op", True),
                     keyed_spec("p.cnt.0", "cnt", True), keyed_spec("p.sink.0", "sink", True)]}
    groups = {"cnt-s": [[0, 3, 0]], "p.cnt.0": [[4, 7, 0]]}
    taken = {"p.op.0": [[2, "cnt-s", "cnt-o", 1], [6, "p.cnt.0", "cnt-o", 1]]}

    def plan(redirected: Any, standby: Any = None) -> Dict[str, Any]:
        return {d["instance"]: d["extra"] for d in plan_rehome(
            "n1", hosted, {"n2"}, set(), 0, groups=groups, redirected=redirected,
            standby_groups={"cnt-o": standby or []})}

    extra = plan(taken)
    assert extra["cnt-s"]["moves_out"] == [[2, "cnt-o", 1]]  # not group 6: its old owner is alive
    assert groups_from_runs(extra["cnt-s"]["owned_groups"]) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert extra["cnt-o"]["owned_groups"] == []
    assert "moves_out" not in plan(None)["cnt-s"]  # as before: the move is forgotten
    # two predecessors took the same Redirect: the move starts again once
    assert plan({**taken, "p.op.1": [[2, "cnt-s", "cnt-o", 1]]})["cnt-s"]["moves_out"] == [[2, "cnt-o", 1]]
    # the copy's standby holds the group installed: the move is over, nothing goes again
    done = plan(taken, standby=[[2, 2, 1]])
    assert "moves_out" not in done["cnt-s"] and groups_from_runs(done["cnt-o"]["owned_groups"]) == {2: 1}
    # a Redirect of a version the old owner is not just before (an older move) starts nothing
    assert "moves_out" not in plan({"p.op.0": [[2, "cnt-s", "cnt-o", 3], "junk", [2, "cnt-s"]]})["cnt-s"]
