"""DEBS query 1 at the edge (agent.operators.debs.TopRoutes, run by the keyed state as a worker
runs it) against the batch job's answer in real PySpark over the same trips, window by window
(agent.analytics.debs_compare): equal, and a changed input shows up as a listed difference."""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, List

import pytest

from agent.analytics.debs import prepare_trips
from agent.analytics.debs_compare import batch_top_routes, compare_top_routes
from agent.instance.keyed_state import KeyedState
from agent.operators.builtin import OperatorContext, in_zone, validate
from agent.operators.debs import top_routes
from agent.operators.taxi import TaxiGenerator

pytestmark = pytest.mark.spark

N = 6000  # ~100 min of drop-off time: 5-minute windows, a lateness of an hour
PARAMS = {"time_field": "dropoff_datetime", "size_ms": 300_000, "lateness_ms": 3_600_000, "k": 10}


@functools.lru_cache(maxsize=1)
def trips() -> List[Dict[str, Any]]:
    """What the demo's sink spills: the seeded records that pass validate and in_zone."""
    gen = TaxiGenerator(1, "taxi.source.0")
    out = []
    for seq in range(N):
        rec = in_zone(validate(gen.record(), {}), {})
        if rec is not None:
            out.append(dict(rec, src="taxi.source.0", seq=seq))
    return out


def edge(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The keyed operator over the records in source order (one key: the field is absent)."""
    op = top_routes.build(OperatorContext("routes-0", "routes", "n", "map", params=dict(PARAMS)))
    ks = KeyedState(op, "routes", "all", 128)
    return [r for _, _, r in ks.apply("in_zone-0", [(r["src"], r["seq"], r) for r in records], 1)]


def batch(spark, records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    from agent.analytics.debs import TRIP_SCHEMA_DDL

    cols = [c.split()[0] for c in TRIP_SCHEMA_DDL.split(", ")]
    df = spark.createDataFrame([tuple(r.get(c) for c in cols) for r in records], TRIP_SCHEMA_DDL)
    return batch_top_routes(prepare_trips(df, "5 minutes"))


def test_query_1_at_the_edge_equals_the_batch_answer_window_by_window(spark) -> None:
    recs = trips()
    got = edge(recs)
    assert len(got) >= 5 and all(len(w["top"]) == 10 for w in got)
    cmp = compare_top_routes(got, batch(spark, recs))
    assert cmp["differences"] == [], cmp["differences"][:2]
    assert cmp["equal"] == cmp["windows_edge"] == len(got)
    assert cmp["open_at_edge"] >= 12  # the last hour (the lateness) and the window it ends in


def test_a_trip_lost_at_the_edge_is_a_listed_difference(spark) -> None:
    recs = trips()
    got = edge(recs)
    # drop every trip of the top route of the third window: that window's list must change
    a, b = got[2]["top"][0][:2]
    start, end = got[2]["start"], got[2]["end"]
    from agent.operators.keyed import parse_event_time

    def kept(r: Dict[str, Any]) -> bool:
        t = parse_event_time(r["dropoff_datetime"])
        return not (r["pickup_cell"] == a and r["dropoff_cell"] == b and start <= t < end)

    cmp = compare_top_routes(edge([r for r in recs if kept(r)]), batch(spark, recs))
    assert [d["start"] for d in cmp["differences"]] == [start], cmp
    assert cmp["equal"] == cmp["windows_edge"] - 1


# ---- query 1 in two keyed stages: route_counts (keyed by route, scaling) -> merge_top_routes ------

def two_stages(records: List[Dict[str, Any]], seed: int, scale: bool = True,
               give_up_ms: Any = None) -> Dict[str, Any]:
    """Stage 1 (`route_counts`, keyed by route) on 1-3 instances whose key groups move between
    them as the runtime moves them (hand_out after the group's last record at the old owner,
    take_in then fire_due at the new one): a copy joins after 1/4 of the input, a second one
    after 1/2, the first copy leaves after 3/4 (its groups to the survivors). Each instance's
    outputs (the trips it forwards, then its counts) go on its own FIFO channel; stage 2
    (`merge_top_routes`, one instance) takes them in a seeded random interleaving of the
    channels. Returns stage 2's windows, the records it forwarded and its operator."""
    import random

    from agent.dataplane.keygroups import key_group
    from agent.operators.debs import merge_top_routes, route_counts

    groups = 128
    p1 = {"time_field": "dropoff_datetime", "size_ms": PARAMS["size_ms"], "lateness_ms": PARAMS["lateness_ms"],
          "forward": True}
    p2 = dict(p1, k=10)
    if give_up_ms is not None:
        p2["give_up_ms"] = give_up_ms

    def stage1(name: str) -> KeyedState:
        op = route_counts.build(OperatorContext(name, "route_counts", "n", "map", params=dict(p1)))
        return KeyedState(op, "route_counts", "route", groups)

    merge = merge_top_routes.build(OperatorContext("top_routes-0", "top_routes", "n", "map", params=dict(p2)))
    b = KeyedState(merge, "top_routes", "all_trips", groups)
    rng = random.Random(seed)
    insts = {"rc-0": stage1("rc-0")}
    owner = {g: "rc-0" for g in range(groups)}
    chans: Dict[str, List[Any]] = {"rc-0": []}
    got: List[Any] = []
    index = [0]

    def drain(some: bool) -> None:
        # stage 2 reads a random number of batches off random channels (each channel in order)
        while any(chans.values()):
            if some and rng.random() < 0.5:
                return
            name = rng.choice([n for n, c in chans.items() if c])
            index[0] += 1
            got.extend(b.apply(name, chans[name].pop(0), index[0]))

    moved = [0]

    def move(g: int, new: str) -> None:
        moved[0] += 1
        old = owner[g]
        data = insts[old].hand_out(g)
        insts[new].take_in(g, data)
        owner[g] = new
        index[0] += 1
        out = insts[new].fire_due(index[0])
        if out:
            chans[new].append(out)

    def join(name: str, share_of: str) -> None:
        insts[name], chans[name] = stage1(name), []
        mine = sorted(g for g, o in owner.items() if o == share_of)
        for g in mine[::2]:
            move(g, name)

    def leave(name: str) -> None:
        rest = sorted(n for n in insts if n != name)
        for i, g in enumerate(sorted(g for g, o in owner.items() if o == name)):
            move(g, rest[i % len(rest)])
        drain(False)  # its channel empties before it goes (the successor acked everything)
        del insts[name], chans[name]

    n = len(records)
    for i in range(0, n, 40):
        if scale and i == (n // 4) // 40 * 40:
            join("rc-1", "rc-0")
        if scale and i == (n // 2) // 40 * 40:
            join("rc-2", "rc-1")
        if scale and i == (3 * n // 4) // 40 * 40:
            leave("rc-1")
        per: Dict[str, List[Any]] = {}
        for r in records[i:i + 40]:
            per.setdefault(owner[key_group(r["route"], groups)], []).append((r["src"], r["seq"], r))
        for name, items in per.items():
            index[0] += 1
            out = insts[name].apply("in_zone-0", items, index[0])
            if out:
                chans[name].append(out)
        drain(True)
    drain(False)
    windows = [r for s, _, r in got if s.startswith("top_routes#")]
    forwarded = [(s, q) for s, q, _ in got if not s.startswith("top_routes#")]
    return {"windows": windows, "forwarded": forwarded, "merge": merge, "stage1": insts, "moved": moved[0]}


@pytest.mark.parametrize("seed", range(6))
def test_two_stages_scaling_out_and_in_equal_the_one_stage_answer(seed: int) -> None:
    recs = trips()
    one = edge(recs)
    two = two_stages(recs, seed)
    assert two["windows"] == one  # every window, in order, equal (one-stage == batch: the test above)
    assert len(one) >= 5
    # the trips reach the sink through both stages, each once, and none of stage 1's counts
    assert sorted(two["forwarded"]) == sorted((r["src"], r["seq"]) for r in recs)
    assert two["merge"].stats() == {}  # nothing late, nothing incomplete, nothing skipped
    assert sorted(two["stage1"]) == ["rc-0", "rc-2"] and two["moved"] == 64 + 32 + 32  # out, out, in


def test_two_stages_equal_the_batch_answer_window_by_window(spark) -> None:
    recs = trips()
    got = two_stages(recs, seed=7)["windows"]
    cmp = compare_top_routes(got, batch(spark, recs))
    assert cmp["differences"] == [] and cmp["equal"] == cmp["windows_edge"] == len(got) >= 5


def test_a_count_that_never_comes_is_waited_for_then_a_listed_difference() -> None:
    """A trip dropped as late by stage 1 is never counted: stage 2 waits `give_up_ms` past the
    window's end for it, then emits the window as it has it, counted as incomplete."""
    recs = trips()
    one = edge(recs)
    # delay the first trip of the third window until stage 1's watermark passed its time but not
    # the window's end: stage 1 drops it as late, stage 2 (which gets it forwarded while the
    # window is still open there) never gets its count
    start, end, late = one[2]["start"], one[2]["end"], PARAMS["lateness_ms"]
    i = min((i for i, r in enumerate(recs) if start <= parse(r) < end), key=lambda i: parse(recs[i]))
    moved = recs[:i] + recs[i + 1:]
    newest = 0.0
    for j, r in enumerate(moved):
        newest = max(newest, parse(r))
        if newest - late > parse(recs[i]):
            break
    assert newest - late < end  # the window is still open at both stages
    moved.insert(j + 1, recs[i])
    two = two_stages(moved, seed=1, scale=False)
    assert two["merge"].stats().get("incomplete_windows") == 1
    assert two["windows"][2]["trips"] == one[2]["trips"] - 1  # emitted without that trip
    assert [w["start"] for w in two["windows"]] == [w["start"] for w in one]  # the others came out too
    assert [w for k, w in enumerate(two["windows"]) if k != 2] == [w for k, w in enumerate(one) if k != 2]


def parse(r: Dict[str, Any]) -> float:
    from agent.operators.keyed import parse_event_time

    t = parse_event_time(r["dropoff_datetime"])
    assert t is not None
    return t


def live_pipeline() -> str:
    """examples/demo-pipeline.toml (so the example itself runs) with 5-minute windows, a lateness
    of an hour and a 20 s load: ~7,000 records, ~2.5 h of drop-offs, ~19 windows closed at the
    edge. in_zone stays one instance: its copies interleave their outputs by more than an hour of
    drop-off time when it scales at these rates (the demo's lateness is 2 h for that), and a
    trip late at route_counts makes its window differ; here only route_counts scales."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "examples" / "demo-pipeline.toml").read_text()
    subs = [(r'name = "taxi"', 'name = "q1"'), (r"size_ms = 1800000", "size_ms = 300000"),
            (r"lateness_ms = 7200000", "lateness_ms = 3600000"),
            (r"(?m)^steps = .*$", "steps = [[0, 150], [4, 500], [16, 100], [20, 0]]"), (r"period = 2.0", "period = 1.0"),
            (r'(in_zone")\nservice_time_ms = 4.0\n(key = "route".*\n\[operator.scaling\]\n)', r'\1\n\2policy = "none"\n')]
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text)
        assert n >= 1, pattern  # the example changed: adapt this test
    return text


@pytest.mark.broker
@pytest.mark.slow
def test_live_route_counts_scale_out_and_in_and_every_window_equals_the_batch_answer(tmp_path) -> None:
    """The demo (private broker, three agents, real workers, its pipeline on a shorter load):
    route_counts scales out (500 records/s > r*C = 140) and back in while its key groups move
    with their state; every window the edge emitted equals the batch answer over the trips the
    sink recorded (each route's trips and freshest drop-off per window, ranked as the batch job
    ranks: `window_row` over all of them, no lateness), and every trip arrived exactly once."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from agent.operators.debs import window_row
    from agent.tools.verify import landed_records

    root = Path(__file__).resolve().parent.parent
    pipeline = tmp_path / "q1.toml"
    pipeline.write_text(live_pipeline())
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "demo", "--pipeline", str(pipeline), "--json", "--no-analytics", "--quiet",
         "--workdir", str(tmp_path / "run"), "--plot", str(tmp_path / "demo.png")],
        capture_output=True, text=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(root)), cwd=str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["ok"] is True and summary["lost"] == 0 and summary["duplicated"] == 0
    rc = summary["scaling_by_operator"].get("route_counts", {})
    assert rc.get("outs", 0) >= 1 and rc.get("ins", 0) >= 1, summary["scaling_by_operator"]
    assert summary["handover"]["messages"] > 0  # key groups moved, with their state
    landed = landed_records(tmp_path / "run" / "landing")
    windows = [r for (s, _), r in landed.items() if s.startswith("q1.top_routes#") or s.startswith("top_routes#")]
    trips_ = [r for (s, _), r in landed.items() if "#" not in s]
    assert len(trips_) == summary["records_out"] > 3000
    size = 300_000
    ref: Dict[int, Dict[str, List[float]]] = {}
    for r in trips_:
        t = parse(r)
        acc = ref.setdefault(int(t // size * size), {}).setdefault(f"{r['pickup_cell']}>{r['dropoff_cell']}", [0, t])
        acc[0] += 1
        acc[1] = max(acc[1], t)
    assert len(windows) >= 5, (len(windows), sorted(ref))  # 1.5-2 h of drop-offs, the last hour still open
    for w in windows:
        assert w == window_row(w["start"], size, ref[w["start"]], 10), (w["start"], summary["keyed_late"])
    assert summary["keyed_late"] == dict.fromkeys(("late_dropped", "incomplete_windows", "late_counts", "late_trips"), 0)
    assert sorted(w["start"] for w in windows) == sorted(ref)[:len(windows)]  # no window skipped
