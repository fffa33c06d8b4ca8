"""The Gesscale policies in the daemon (docs/measurement.md, "Policies in the daemon"): the pure
context and mapping on constructed fleets, then a live fleet of three real agents running
`policy = "threshold"` that scales out under load and back in, every record exactly once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_process import CHECKOUT_PATH
from agent.node.placement import (
    NodeView,
    PlacementRequest,
    get_policy,
    instance_context,
    nd_max_first,
    policy_for_operator,
    spread,
)
from agent.policy.decentralized import Action
from agent.policy.live import LivePolicy, PeriodInputs, parse_context


def doc(node: str, *items: Dict[str, Any]) -> Dict[str, Any]:
    return {"node": node, "slots": 4, "free_slots": 4 - len(items), "instances": list(items)}


def inst(iid: str, op: str, status: str = "active", keeper: bool = False, bp: Any = None,
         pipeline: str = "p") -> Dict[str, Any]:
    stats: Dict[str, Any] = {"signals": {"backpressure": bp}} if bp is not None else {}
    return {"id": iid, "operator": op, "status": status, "keeper": keeper, "pipeline": pipeline, "stats": stats}


LAT = {"a": {"b": 10.0, "c": 80.0}, "b": {"a": 12.0, "c": 70.0}, "c": {"a": 78.0}}


def test_context_counts_siblings_ranks_the_farthest_first_and_reads_upstream_backpressure() -> None:
    docs = {
        "a": doc("a", inst("p.w.0", "w", keeper=True), inst("p.src.0", "src", bp=0.7)),
        "b": doc("b", inst("w-b-1", "w"), inst("w-b-2", "w", status="starting")),
        "c": doc("c", inst("w-c-1", "w"), inst("w-c-2", "w", status="terminating"),
                 inst("other", "w", pipeline="q"), inst("s2", "src", bp=0.2)),
    }
    ctx = {i: instance_context(docs, LAT, "p", "w", "src", i) for i in ("p.w.0", "w-b-1", "w-b-2", "w-c-1")}
    assert {c["n"] for c in ctx.values()} == {4}  # starting counts, terminating and other pipelines do not
    assert {c["nd_max_ms"] for c in ctx.values()} == {80.0}  # a-c, read from the a row (c measured 78 the other way)
    assert ctx["w-c-1"]["rank"] == 0  # c is far from a and b: removed first
    assert ctx["p.w.0"]["rank"] == 3  # the keeper is always last
    assert sorted(c["rank"] for c in ctx.values()) == [0, 1, 2, 3]
    assert {c["upstream_backpressure"] for c in ctx.values()} == {0.7}
    assert instance_context(docs, LAT, "p", "w", "src", "unknown")["rank"] is None
    assert instance_context(docs, {}, "p", "w", "", "w-b-1")["upstream_backpressure"] == 0.0


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.integers(-8, 8), st.integers(0, 2**32 - 1))
def test_siblings_with_one_view_apply_exactly_the_operator_level_change(n: int, delta: int, seed: int) -> None:
    """Every instance computes its context from the same fleet view: the ranks are a permutation,
    and the threshold policy's +1/-1 is carried out by exactly one instance (never the keeper)."""
    import random

    rnd = random.Random(seed)
    nodes = ["a", "b", "c", "d"]
    lat = {x: {y: float(rnd.randint(1, 200)) for y in nodes if y != x} for x in nodes}
    ids = ["p.w.0"] + [f"w-{k}" for k in range(1, n)]
    docs: Dict[str, Dict[str, Any]] = {x: doc(x) for x in nodes}
    for k, iid in enumerate(ids):
        docs[nodes[rnd.randrange(4)]]["instances"].append(inst(iid, "w", keeper=(k == 0)))
    ranks = [instance_context(docs, lat, "p", "w", None, i)["rank"] for i in ids]
    assert sorted(ranks) == list(range(n)) and ranks[0] == n - 1
    util = 0.95 if delta >= 0 else 0.1  # above up (0.9) or below down (0.5)
    acted: List[Any] = []
    for iid in ids:
        pol = LivePolicy("threshold")
        assert pol.set_context(instance_context(docs, lat, "p", "w", None, iid))
        d = pol.decide(PeriodInputs(0.0, 100.0, util * 100.0, 100.0, 0.0, iid == "p.w.0", 0.5))
        if d.action is not Action.NONE:
            acted.append((iid, d.action, d.count))
    if delta >= 0:
        assert [(a, c) for _, a, c in acted] == [(Action.DUPLICATE, 1)], acted
    elif n > 1:
        assert len(acted) == 1 and acted[0][1] is Action.TERMINATE and acted[0][0] != "p.w.0", acted
    else:
        assert acted == []  # the keeper alone never leaves


def test_a_malformed_context_is_refused_and_the_last_good_one_kept() -> None:
    pol = LivePolicy("sized")
    assert pol.set_context({"n": 3, "rank": 1, "nd_max_ms": 5.0, "upstream_backpressure": 0.2})
    for bad in (None, [], {"n": 0}, {"n": "3"}, {"n": True}):
        assert not pol.set_context(bad)
    assert pol.context == parse_context({"n": 3, "rank": 1, "nd_max_ms": 5.0, "upstream_backpressure": 0.2})
    assert parse_context({"n": 2, "rank": 7, "upstream_backpressure": 9})["rank"] is None  # out of range
    assert parse_context({"n": 2, "upstream_backpressure": 9})["upstream_backpressure"] == 1.0
    with pytest.raises(ValueError):
        LivePolicy("decentralized")  # stays in the protocol core


def test_model_policy_sees_algorithm_1_root_from_the_live_signals() -> None:
    pol = LivePolicy("model")
    pol.set_context({"n": 2, "rank": 0, "nd_max_ms": 1.0, "upstream_backpressure": 0.8})
    pol.decide(PeriodInputs(10.0, 300.0, 250.0, 130.0, 0.1, False, 0.3))
    assert pol.last is not None and pol.last["overload_root"] is True
    pol.set_context({"n": 2, "rank": 0, "nd_max_ms": 1.0, "upstream_backpressure": 0.8})
    pol.decide(PeriodInputs(20.0, 300.0, 250.0, 130.0, 0.7, False, 0.3))  # itself blocked: not the root
    assert pol.last["overload_root"] is False


def test_a_copy_goes_where_the_operator_s_nd_max_stays_smallest() -> None:
    """Siblings on a and b (10 ms apart): c is 80 ms from a, d 15 ms from both; the copy asked for
    by c's instance goes to d (ND_max 15), not to the asking node c (80) nor to the full node a."""
    lat = {"a": {"b": 10.0, "c": 80.0, "d": 15.0}, "b": {"c": 70.0, "d": 15.0}, "c": {"d": 60.0}}
    fleet = [NodeView("a", 4, 0, latency_ms=lat["a"], instances=("w-1",)),
             NodeView("b", 4, 1, latency_ms=lat["b"], instances=("w-2",)),
             NodeView("c", 4, 3, latency_ms=lat["c"], instances=("x",)),
             NodeView("d", 4, 3, latency_ms={}, instances=()),
             NodeView("e", 4, 4, online=False)]
    req = PlacementRequest("w", local="c", siblings=("w-1", "w-2"))
    assert nd_max_first(req, fleet) == ["b", "d", "c"]  # b keeps ND_max at 10; a is full, e offline
    full_b = [v if v.node != "b" else NodeView("b", 4, 0, latency_ms=lat["b"], instances=("w-2",)) for v in fleet]
    assert nd_max_first(req, full_b) == ["d", "c"]
    # no sibling in view: the default ranking (local free slot first)
    assert nd_max_first(PlacementRequest("w", local="c"), fleet)[0] == "c"
    default = get_policy("free-slots-then-latency")
    assert policy_for_operator(default, "threshold") is nd_max_first
    assert policy_for_operator(default, "sized") is nd_max_first
    assert policy_for_operator(default, "decentralized") is default
    assert policy_for_operator(spread, "model") is spread  # a deliberate choice is kept


def test_bench_policies_simulated_side_uses_the_live_demand_and_trace() -> None:
    """The simulated row of `bench policies` on the same compressed trace: the trace peaks at the
    asked rate, demand is the smallest n with n x C >= the bucket mean, and the metrics are finite."""
    from foglab.tools.policies_bench import _demand_series, _steps, live_trace, run_simulated

    tr = live_trace(0, 1.0, 650.0)
    assert len(tr) == 60 and max(tr) == pytest.approx(650.0)
    d = _demand_series(tr, 250.0, 3, 10)
    for t in (0, 15, 59):
        b0 = (t // 10) * 10
        mean = sum(tr[b0:b0 + 10]) / 10
        assert d[t] == min(3, max(1, -(-mean // 250)))
    steps = _steps(tr, 2)
    assert steps[0][0] == 0.0 and steps[-1] == [60.0, 0.0] and len(steps) == 31
    row = run_simulated("threshold", tr)
    assert row["mode"] == "simulated" and row["duration"] == 60.0 and row["reconfigurations"] >= 0
    assert 0.0 <= row["timeshare_u"] <= 1.0 and row["cost"] > 0


@pytest.mark.slow
def test_bench_policies_prints_only_json_with_a_live_and_a_simulated_row(tmp_path: Path) -> None:
    """`fog-agent bench policies --json` end to end on a 15 s trace: its own broker and three agents
    (~40 s, up to 3 min on a loaded machine: the live side needs real agents)."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "agent", "bench", "policies", "--json", "--policies", "threshold",
                        "--minutes", "0.25", "--consolidation", "on", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, cwd=root, timeout=180, env=dict(os.environ, PYTHONPATH=CHECKOUT_PATH))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["rows"]  # the whole of stdout: progress goes to stderr
    assert [(x["policy"], x["mode"], x.get("consolidation")) for x in rows] == [
        ("threshold", "simulated", None), ("threshold", "live", True)]
    live = rows[1]
    assert live["records_lost"] == 0 and live["records_duplicated"] == 0 and live["records_generated"] > 1000, live
    assert live["duration"] == 15.0 and live["cost"] > 0
    # The site manager of the consolidated run released a node (the fleet runs one pipeline of
    # at most 5 instances on 3 x 4 slots), and the hook ran for each release it reported.
    assert live["nodes_released"] >= 1 and live["node_minutes"] < 3 * 0.25, live
    hooked = (tmp_path / "threshold-consolidated" / "site-hooks.log").read_text().split("\n")
    # (the hooks' log also holds what ran in the drain after the trace: at least the run's count)
    assert sum(1 for x in hooked if x.startswith("release ")) >= live["nodes_released"], (hooked, live)
    assert sum(1 for x in hooked if x.startswith("acquire ")) >= live["nodes_acquired"], (hooked, live)
    assert live["node_minutes"] >= live["node_minutes_packed"] * 0.5 and live["latency_s"] is not None


def test_powered_nodes_and_node_minutes_follow_the_site_actions() -> None:
    """Node-minutes of a consolidation run: every node powered, less those released and not
    acquired since; hand-computed on a constructed run of 60 s sampled every 10 s."""
    from foglab.tools.policies_bench import format_consolidation, powered_series, step_minutes

    times = [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    actions = [(5.0, "drain", "n2"), (10.0, "release", "n2"), (20.0, "release", "n3"), (35.0, "acquire", "n2"),
               (36.0, "undrain", "n2"), (50.0, "acquire", "n3")]
    powered = powered_series(times, actions, 3)
    assert powered == [3, 2, 1, 1, 2, 3]
    # 3 x 10 + 2 x 10 + 1 x 20 + 2 x 10 + 3 x 10 = 120 node-seconds = 2 node-minutes
    assert step_minutes(times, powered, 60.0) == pytest.approx(2.0)
    assert step_minutes(times, powered, 45.0) == pytest.approx((30 + 20 + 20 + 2 * 5) / 60.0)
    row = {"policy": "threshold", "mode": "live", "consolidation": True, "node_minutes": 2.0,
           "node_minutes_packed": 1.5, "nodes_released": 2, "nodes_acquired": 2, "reconfigurations": 4.0,
           "cost": 1.25, "accuracy_u": 0.01, "timeshare_u": 0.02, "deferred_share": 0.001, "latency_s": 0.2,
           "records_lost": 0}
    table = format_consolidation([dict(row, mode="simulated"), row]).splitlines()
    assert len(table) == 3  # the simulated row has no nodes: left out
    assert table[2] == "| threshold | on | 2.00 | 1.50 | 2 / 2 | 4 | 1.25 | 0.010 | 2.0 | 0.10 | 0.20 | 0 |"


THRESHOLD_PIPELINE = """
[pipeline]
name = "thr"
[scaling]
policy = "none"
period = 1.0
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[operator.params]
seed = 11
profile = "steps"
steps = {steps}
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
service_time_ms = 4.0
[operator.scaling]
policy = "threshold"
period = 1.0
cooldown = 4.0
capacity = 250.0
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def wait_still(value: Any, still: float, timeout: float) -> bool:
    """Until `value()` has not changed for `still` seconds (False after `timeout`)."""
    deadline = time.monotonic() + timeout
    last, since = value(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = value()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still:
            return True
    return False


@pytest.mark.broker
@pytest.mark.slow
def test_live_threshold_policy_scales_out_under_load_and_in_when_it_drops(tmp_path: Path, mosquitto: Any) -> None:
    """Three real agents; in_zone (4 ms per record, live capacity ~250/s) under `threshold`: at
    560 records/s it must reach >= 3 instances (one instance at a time: u > 0.9 adds one), at
    30 records/s return to its keeper, and every record must reach the sink exactly once.
    About 50 s: the load must hold long enough for two cooldowns up and two down."""
    from agent.config import load_pipeline_text
    from agent.node.deploy import RpcClient
    from foglab.tools.demo import Fleet, Monitor
    from foglab.tools.verify import verify

    steps = [[0, 40], [3, 560], [28, 30], [52, 0]]
    text = THRESHOLD_PIPELINE.format(steps=steps)
    cfg = load_pipeline_text(text)
    assert cfg.runtime_policy_errors() == []
    fleet = Fleet(tmp_path, slots=4, cluster="livethr", broker_host=mosquitto.host, broker_port=mosquitto.port,
                  shutdown_timeout=8.0)
    fleet.start()
    mon = Monitor(mosquitto.host, mosquitto.port, fleet.cluster)
    try:
        fleet.wait_online(mon)
        placed = {d.operator: d for d in fleet.deploy(text)}
        t0 = time.monotonic()
        peak, peak_at = 0, None
        while time.monotonic() - t0 < 28:
            n = mon.instances_per_operator(include_terminating=False).get("in_zone", 0)
            if n > peak:
                peak, peak_at = n, time.monotonic() - t0
            time.sleep(0.25)
        ks = mon.stats_of("thr.in_zone.0")
        assert peak >= 3, f"in_zone peaked at {peak} instances; keeper stats {ks}"
        assert ks.get("policy") == "threshold" and (ks.get("live_decision") or {}).get("context"), ks
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and mon.instances_per_operator().get("in_zone", 0) > 1:
            time.sleep(0.5)
        back_at = time.monotonic() - t0
        assert mon.instances_per_operator().get("in_zone") == 1, mon.instances_per_operator()
        ev = [e for e in mon.events if e.get("type") in ("scale_out", "scale_in") and e.get("operator") == "in_zone"]
        outs = [e for e in ev if e["type"] == "scale_out"]
        ins = [e for e in ev if e["type"] == "scale_in"]
        assert outs and ins and all((e.get("detail") or {}).get("policy") == "threshold" for e in ev), ev
        # The load ends now (the source paused) rather than at the profile's end (52 s): what
        # follows the scale-in checks nothing more. Then the sink's count must stand still 3 s.
        source = placed["source"]
        with RpcClient(mosquitto.host, mosquitto.port, fleet.cluster) as client:
            assert client.call(source.node, {"op": "set", "instance": source.instance, "fields": {"paused": True}})["ok"]
        assert mon.wait(lambda m: m.totals()["recorded"] > 0, 5)
        assert wait_still(lambda: mon.totals()["recorded"], 3.0, 30.0), "the sink still records 30 s after the load"
        print(f"live threshold: peak {peak} in_zone instances at {peak_at:.1f} s, back to 1 at {back_at:.1f} s; "
              f"{len(outs)} scale-out and {len(ins)} scale-in decisions; "
              f"series {[(round(t - mon.series[0][0], 1), c.get('in_zone')) for t, c in mon.series[::8]]}")
    finally:
        mon.close()
        fleet.stop(timeout=15)
    v = verify(cfg, fleet.sink_dir)
    print(f"live threshold: generated {v.generated}, received {v.received}, lost {v.lost}, duplicated {v.duplicated}")
    assert v.generated > 10000
    assert v.lost == 0 and v.duplicated == 0 and v.unexpected == 0, v
    assert v.received == v.expected


FOLLOW_PIPELINE = """
[pipeline]
name = "fol"
[scaling]
policy = "none"
period = 1.0
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
params = { seed = 5, profile = "constant", rate = 150.0 }
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
service_time_ms = 2.0
[operator.scaling]
policy = "threshold"
period = 1.0
cooldown = 3.0
capacity = 500.0
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


@pytest.mark.broker
@pytest.mark.slow
def test_a_slowed_instance_s_operator_count_follows_its_live_capacity(tmp_path: Path, mosquitto: Any) -> None:
    """One real agent, constant 150 records/s, in_zone under `threshold` at 2 ms per record
    (utilisation 0.3: one instance is right). Made 8 ms per record by a control message, its live
    capacity falls to the clamp (125/s), its utilisation passes 0.9 and the operator gets a second
    instance; with the configured capacity alone (500/s) it would never have scaled."""
    from foglab.tools.demo import Fleet, Monitor

    fleet = Fleet(tmp_path, nodes=("n1",), slots=4, cluster="livefol", broker_host=mosquitto.host,
                  broker_port=mosquitto.port, shutdown_timeout=8.0)
    fleet.start()
    mon = Monitor(mosquitto.host, mosquitto.port, fleet.cluster)
    keeper = "fol.in_zone.0"
    try:
        fleet.wait_online(mon)
        fleet.deploy(FOLLOW_PIPELINE)
        assert mon.wait(lambda m: ((m.stats_of(keeper).get("signals") or {}).get("processed_rate") or 0) > 100, 60)
        time.sleep(4.0)
        assert mon.instances_per_operator().get("in_zone") == 1, mon.instances_per_operator()
        u0 = (mon.stats_of(keeper).get("live_decision") or {}).get("utilisation")
        assert u0 is not None and u0 < 0.5, mon.stats_of(keeper)
        assert mon.call(fleet.host, fleet.port, "n1",
                        {"op": "set", "instance": keeper, "fields": {"service_time_ms": 8.0}})["ok"]
        t_set = time.monotonic()
        assert mon.wait(lambda m: m.instances_per_operator(include_terminating=False).get("in_zone", 0) >= 2, 30), \
            mon.stats_of(keeper)
        took = time.monotonic() - t_set
        ks = mon.stats_of(keeper)
        print(f"count follows capacity: utilisation {u0:.2f} at 2 ms; after 8 ms live capacity "
              f"{ks.get('live_capacity')}/s, second instance {took:.1f} s after the change")
        assert ks.get("live_capacity", 1e9) < 500.0 / 2, ks
    finally:
        mon.close()
        fleet.stop(timeout=15)
