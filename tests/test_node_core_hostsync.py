"""agent.node.hostsync on its own: which worker is sent which host table when, and the "moved"
statements this node makes, decided without a daemon, a broker or a worker."""

from __future__ import annotations

from typing import Any, Dict, List

from agent.node.hostmap import MAX_MOVED
from agent.node.hostsync import HostSync, generation_of


def spec(instance: str, pipeline: str = "p", generation: Any = None) -> Dict[str, Any]:
    return {"instance": instance, "pipeline": pipeline, "extra": {"generation": generation}}


HOSTED: Dict[str, List[Dict[str, Any]]] = {"n2": [spec("p.b.0")], "n3": [spec("q.c.0", "q")]}
ONLINE = {"n2": True, "n3": True}


def test_each_worker_gets_its_pipelines_table_once_per_process_and_again_when_it_changes() -> None:
    h = HostSync("me")
    workers = {"p.a.0": ("p", 100), "q.a.0": ("q", 101)}
    recomputed, send = h.sync(workers, HOSTED, {}, ONLINE, {})
    assert recomputed and [(i, pid) for i, pid, _ in send] == [("p.a.0", 100), ("q.a.0", 101)]
    tables = {i: t for i, _, t in send}
    assert tables["p.a.0"]["bound"] == {"p.a.0": "me", "p.b.0": "n2"}
    assert tables["q.a.0"]["bound"] == {"q.a.0": "me", "q.c.0": "n3"}
    assert h.near == {"me", "n2", "n3"}
    h.delivered("p.a.0", 100, tables["p.a.0"])  # q.a.0's send failed: it is tried again
    assert h.sync(workers, HOSTED, {}, ONLINE, {}) == (False, [("q.a.0", 101, tables["q.a.0"])])
    h.delivered("q.a.0", 101, tables["q.a.0"])
    assert h.sync(workers, HOSTED, {}, ONLINE, {}) == (False, [])
    restarted = dict(workers, **{"p.a.0": ("p", 200)})  # a new process of p.a.0
    assert h.sync(restarted, HOSTED, {}, ONLINE, {}) == (False, [("p.a.0", 200, tables["p.a.0"])])
    h.dirty = True  # a record changed, the table did not: nothing to send
    h.delivered("p.a.0", 200, tables["p.a.0"])
    assert h.sync(restarted, HOSTED, {}, ONLINE, {}) == (True, [])
    moved = dict(HOSTED, n2=[], n4=[spec("p.b.0")])
    h.dirty = True
    recomputed, send = h.sync(restarted, moved, {}, dict(ONLINE, n4=True), {})
    assert [(i, t["bound"]["p.b.0"]) for i, _, t in send] == [("p.a.0", "n4")]
    assert h.near == {"me", "n3", "n4"}
    recomputed, _ = h.sync({"p.a.0": ("p", 200)}, moved, {}, dict(ONLINE, n4=True), {})  # q.a.0 left
    assert recomputed and h.near == {"me", "n4"}


def test_a_statement_of_a_move_is_bounded_and_dropped_while_the_instance_runs_here_again() -> None:
    h = HostSync("me")
    assert h.stated_move("p.a.0", None) is False and h.moved_to == {}
    h.dirty = False
    assert h.stated_move("p.a.0", "n2") is True and h.dirty
    h.stated_move("p.b.0", "me")
    h.stated_move("p.a.0", "n3")  # newest last
    assert list(h.moved_to.items()) == [("p.b.0", "me"), ("p.a.0", "n3")]
    assert h.moved_statements({"p.a.0", "p.b.0"}) == {"p.b.0": "me"}
    assert h.moved_statements(set()) == {"p.b.0": "me", "p.a.0": "n3"}
    for k in range(MAX_MOVED):
        h.stated_move(f"x.{k}", "n2")
    assert len(h.moved_to) == MAX_MOVED and "p.b.0" not in h.moved_to


def test_the_bindings_are_kept_only_when_they_changed() -> None:
    h = HostSync("me")
    assert h.bindings_to_keep() is None
    h.sync({}, {"n2": [spec("p.b.0")]}, {"n3": {"moved": {"p.b.0": "n2"}}}, ONLINE, {})
    saved = h.bindings_to_keep()
    assert saved is not None and saved["bound"] == [["p.b.0", "n2", "p", ""]]
    h.kept(saved)
    assert h.bindings_to_keep() is None
    again = HostSync("me", bindings=saved)
    assert again.hostmap.bound("p.b.0") == "n2" and again.bindings_to_keep() is None


def test_a_hosted_records_generation_is_read_as_bus_input() -> None:
    assert generation_of(spec("a", generation="g1")) == "g1"
    assert generation_of(spec("a", generation=5)) == "" and generation_of({"extra": "x"}) == ""
    assert generation_of(spec("a", generation="g" * 100)) == "g" * 64


def test_an_instance_whose_start_here_failed_is_bound_where_it_runs_proven() -> None:
    """A copy placed here whose worker exited before it was ready (the node cut off the broker:
    "cannot reach the broker"), then started by the next node. While it started it was ours,
    bound here; kept as the binding to move from, the next node's listing made it a move
    without a statement: bound there *unproven*, so our workers held its first epoch and
    refused it 20 s later, and its predecessor and the source held their records for good
    (tests/test_reliability.py::test_each_fault_path_on_a_fixed_schedule, not settled). It
    never ran here: it starts over, as for a node that never saw it. Likewise a hand-over to
    us that failed to start: bound again where it still runs, proven."""
    online = {"n2": True, "n3": True}
    mine = {"p.a.0": ("p", 100)}
    h = HostSync("n1")
    h.sync(dict(mine, **{"b-x": ("p", 101)}), {"n1": [spec("p.a.0")]}, {}, online, {})
    assert h.hostmap.bound("b-x") == "n1"
    h.not_started("b-x")  # the agent reaped it before "ready": the spawn goes to the next node
    h.sync(mine, {"n1": [spec("p.a.0")]}, {}, online, {})  # nobody lists it yet
    h.dirty = True  # n2's hosted record lists it (the daemon says a record changed)
    _, send = h.sync(mine, {"n1": [spec("p.a.0")], "n2": [spec("b-x")]}, {}, online, {})
    table = send[0][2]
    assert table["bound"]["b-x"] == "n2" and "b-x" not in table.get("unproven", ()), table

    # p.b.0 runs on n3 and is handed over to us; its start here fails, n3 restarts it
    hosted = {"n1": [spec("p.a.0")], "n3": [spec("p.b.0")]}
    h.dirty = True
    h.sync(mine, hosted, {}, online, {})
    assert h.hostmap.bound("p.b.0") == "n3" and h.hostmap.proven("p.b.0")
    h.sync(dict(mine, **{"p.b.0": ("p", 102)}), hosted, {}, online, {})
    assert h.hostmap.bound("p.b.0") == "n1"
    h.not_started("p.b.0")
    h.sync(mine, hosted, {}, online, {})
    assert h.hostmap.bound("p.b.0") == "n3" and h.hostmap.proven("p.b.0")
