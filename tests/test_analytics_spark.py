"""The PySpark batch job against answers computed by hand (real Spark, local mode).

One module so that the module-scoped `spark` fixture starts once. Each data set is built so that a
plausible mistake changes the answer: trips just west of the grid (truncation instead of floor
folds them into cell 1), ties broken by freshness then cell, a zero fare that would move the
median, a drop-off exactly on a window boundary, empty taxis whose pickup was outside the grid.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from agent.analytics.grid import CELL_LAT, CELL_LON, ORIGIN_LAT, ORIGIN_LON, cell_index

pytestmark = pytest.mark.spark

DAY = "2013-01-01"


def at(cell: Tuple[float, float], off: Tuple[float, float] = (0.0, 0.0)) -> Tuple[float, float]:
    """(lat, lon) of a point in cell (x, y), offset in cell units from its centre."""
    x, y = cell
    return ORIGIN_LAT - (y - 1 + off[1]) * CELL_LAT, ORIGIN_LON + (x - 1 + off[0]) * CELL_LON


_seq = [0]


def trip(start: Tuple[float, float], end: Tuple[float, float], pickup: str, dropoff: str,
         fare: float = 10.0, tip: float = 1.0, medallion: Optional[str] = None,
         start_off=(0.2, -0.3), end_off=(-0.3, 0.2), raw_start=None, raw_end=None) -> Dict:
    _seq[0] += 1
    fare, tip = float(fare), float(tip)
    plat, plon = raw_start if raw_start else at(start, start_off)
    dlat, dlon = raw_end if raw_end else at(end, end_off)
    return {
        "src": "t", "seq": _seq[0], "medallion": medallion or f"M{_seq[0]}", "hack_license": "H",
        "pickup_datetime": f"{DAY} {pickup}", "dropoff_datetime": f"{DAY} {dropoff}",
        "trip_time_in_secs": 60, "trip_distance": 1.0,
        "pickup_longitude": plon, "pickup_latitude": plat, "dropoff_longitude": dlon,
        "dropoff_latitude": dlat, "payment_type": "CRD", "fare_amount": fare, "surcharge": 0.5,
        "mta_tax": 0.5, "tip_amount": tip, "tolls_amount": 0.0, "total_amount": fare + tip + 1.0,
    }


def frame(spark, rows: List[Dict]):
    from agent.analytics.debs import TRIP_SCHEMA_DDL

    schema_cols = [c.split()[0] for c in TRIP_SCHEMA_DDL.split(", ")]
    data = [tuple(r.get(c) for c in schema_cols) for r in rows]
    return spark.createDataFrame(data, TRIP_SCHEMA_DDL)


def test_grid_reference_matches_the_challenge_definition() -> None:
    assert cell_index(ORIGIN_LAT, ORIGIN_LON) == (1, 1)  # the origin is the CENTRE of cell 1.1
    assert cell_index(*at((1, 1), (0.49, 0.49))) == (1, 1)
    assert cell_index(*at((1, 1), (-0.51, 0.0)))[0] == 0  # just west of the grid: outside
    assert cell_index(*at((300, 300), (0.4, 0.4))) == (300, 300)
    assert cell_index(*at((300, 300), (0.6, 0.0)))[0] == 301
    # 500 m: ~0.0045 degrees of latitude; at 41 N, ~0.0060 degrees of longitude.
    assert abs(CELL_LAT * 111_200 - 500) < 5 and abs(CELL_LON * 111_200 * math.cos(math.radians(40.9)) - 500) < 10


def q1_rows() -> List[Dict]:
    rows = []
    A, B, C = ((1, 1), (2, 2)), ((5, 5), (6, 6)), ((3, 3), (3, 4))
    for t in ("10:10:00", "10:15:00", "10:20:00"):
        rows.append(trip(*A, "09:55:00", t))
    for t in ("10:05:00", "10:11:00", "10:25:00"):
        rows.append(trip(*B, "09:55:00", t))
    for t in ("10:12:00", "10:13:00"):
        rows.append(trip(*C, "09:55:00", t))
    singles = [((9, 9), "10:09:00"), ((8, 8), "10:08:00"), ((7, 7), "10:07:00"),
               ((300, 300), "10:06:00"), ((11, 11), "10:05:00"), ((12, 12), "10:04:00"),
               ((50, 50), "10:03:00"), ((40, 40), "10:03:00"), ((13, 13), "10:01:00")]
    for s, t in singles:
        off = (0.4, 0.4) if s == (300, 300) else (0.2, -0.3)
        rows.append(trip(s, (1, 1) if s == (300, 300) else (20, 20), "09:58:00", t, start_off=off,
                         end_off=(-0.4, -0.4)))
    # Outside the grid: 4 trips from just west of cell 1.1 (a truncating cell function folds them
    # into 1.1 and they would rank first), 5 with a zero GPS fix, 2 starting south of row 300.
    for _ in range(4):
        rows.append(trip((1, 1), (2, 2), "10:00:00", "10:29:00", start_off=(-0.7, 0.0)))
    for _ in range(5):
        rows.append(trip((1, 1), (2, 2), "10:00:00", "10:29:30", raw_start=(0.0, 0.0)))
    for _ in range(2):
        rows.append(trip((5, 301), (5, 300), "10:00:00", "10:29:40", start_off=(0.0, 0.0)))
    # Window 10:30-11:00: drop-off exactly on the boundary belongs to the later window.
    rows.append(trip(*A, "10:20:00", "10:30:00"))
    rows.append(trip(*A, "10:40:00", "10:45:00"))
    rows.append(trip(*C, "10:40:00", "10:46:00"))
    return rows


def test_top_routes_per_window_hand_computed(spark) -> None:
    from agent.analytics.debs import prepare_trips, top_routes

    trips = prepare_trips(frame(spark, q1_rows()))
    got = [(r["window_start"].strftime("%H:%M"), r["rank"], r["start_cell"], r["end_cell"], r["trips"])
           for r in top_routes(trips).orderBy("window_start", "rank").collect()]
    w1 = [("10:00", i + 1, s, e, n) for i, (s, e, n) in enumerate([
        ("5.5", "6.6", 3),  # tie on 3 trips with 1.1->2.2: fresher last drop-off (10:25) first
        ("1.1", "2.2", 3),
        ("3.3", "3.4", 2),
        ("9.9", "20.20", 1), ("8.8", "20.20", 1), ("7.7", "20.20", 1),
        ("300.300", "1.1", 1), ("11.11", "20.20", 1), ("12.12", "20.20", 1),
        ("40.40", "20.20", 1),  # tie at 10:03 with 50.50: lower start cell wins the 10th place
    ])]
    w2 = [("10:30", 1, "1.1", "2.2", 2), ("10:30", 2, "3.3", "3.4", 1)]
    assert got == w1 + w2


def q2_rows() -> List[Dict]:
    P, Q, R = (10, 10), (20, 20), (30, 30)
    outside = at((1, 1), (0.0, -400.0))
    return [
        trip(P, Q, "10:05:00", "10:16:00", 10, 2, "t1"),
        trip(P, Q, "10:10:00", "10:20:00", 20, 0, "t2"),
        trip(Q, R, "10:25:00", "10:40:00", 9, 1, "t2"),  # t2 is busy again before 10:30
        trip(P, P, "10:00:00", "10:05:00", 8, 1, "t3"),  # ended before the last 15 min
        trip(P, P, "10:12:00", "10:18:00", 0, 5, "t4"),  # zero fare: not in the median
        trip(P, Q, "10:15:00", "10:28:00", 30, 6, "t5"),
        trip(Q, P, "10:14:00", "10:22:00", 5, 1, "t6"),
        trip(P, Q, "10:35:00", "10:50:00", 7, 0, "t6"),  # next pickup after 10:30: empty in W1
        trip(R, R, "10:46:00", "10:55:00", 4, 0, "t7"),
        trip(P, P, "10:02:00", "10:17:00", 100, 0, "t8", raw_start=outside),  # pickup outside
        trip(P, P, "10:20:00", "10:25:00", 50, 0, "t9", raw_end=outside),  # drop-off outside
    ]


def test_profitable_areas_hand_computed(spark) -> None:
    from agent.analytics.debs import prepare_trips, profitable_areas

    trips = prepare_trips(frame(spark, q2_rows()))
    got = [(r["window_start"].strftime("%H:%M"), r["rank"], r["cell"], r["profit"], r["empty_taxis"],
            round(r["profitability"], 9))
           for r in profitable_areas(trips).orderBy("window_start", "rank").collect()]
    assert got == [
        # P: median of {12, 20, 36, 50} = 28 (t3 too early, t4 zero fare, t8 started outside);
        #    empty: t3, t4, t6, t8 (t8 started outside the grid but was dropped off in P).
        ("10:00", 1, "10.10", 28.0, 4, 7.0),
        # Q: profit 6 (t6); empty: t1, t5 (t2 picked up again at 10:25).
        ("10:00", 2, "20.20", 6.0, 2, 3.0),
        # W2: P has profit 7 but no empty taxi, Q an empty taxi but no profit: not ranked.
        ("10:30", 1, "30.30", 4.0, 2, 2.0),
    ]


def test_elasticity_report_matches_the_metrics_module(spark) -> None:
    from agent import metrics_spec
    from agent.analytics.elasticity import spec_metrics

    series = {
        "in_zone": ([0, 5, 10, 15, 20, 30], [2, 3, 3, 1, 2, 2], [2, 2, 4, 4, 2, 3]),
        "validate": ([0, 2, 3, 7, 8], [1, 4, 2, 2, 5], [1, 1, 3, 3, 3]),  # even number of steps
        "sink": ([100], [2], [1]),  # a single sample holds 1 s
        "source": ([0, 10, 20, 30], [5, 5, 5, 5], [5, 5, 5, 5]),
    }
    rows = [(op, float(t), float(d), float(s)) for op, (ts, ds, ss) in series.items()
            for t, d, s in zip(ts, ds, ss)]
    df = spark.createDataFrame(rows, "operator STRING, t DOUBLE, demand DOUBLE, supply DOUBLE")
    got = {r["operator"]: r.asDict() for r in spec_metrics(df).collect()}
    assert set(got) == set(series)
    for op, (ts, ds, ss) in series.items():
        ref = metrics_spec.elasticity_metrics(ts, ds, ss).as_dict()
        for key, value in ref.items():
            assert got[op][key] == pytest.approx(value, abs=1e-12), (op, key)
    # And one by hand, so that the module and the job cannot be wrong together.
    z = got["in_zone"]
    assert z["duration"] == 35.0 and z["accuracy_u"] == pytest.approx(5 / 35)
    assert z["accuracy_o"] == pytest.approx(25 / 35) and z["timeshare_o"] == pytest.approx(15 / 35)
    assert z["reconfigurations"] == 3 and z["cost"] == pytest.approx(95 / 60)


def test_series_from_instance_metrics(spark) -> None:
    from agent.analytics.elasticity import series_from_metrics

    rows = [(0.5, "v", "v-1", 300.0, 500.0), (1.5, "v", "v-2", 400.0, 500.0),
            (2.0, "v", "v-1", 300.0, 500.0),
            (5.2, "v", "v-1", 1200.0, 500.0),
            (0.1, "s", "s-1", 10.0, 500.0)]
    df = spark.createDataFrame(rows, "ts DOUBLE, operator STRING, instance STRING, load DOUBLE, capacity DOUBLE")
    got = sorted(tuple(r) for r in series_from_metrics(df, period=5.0).collect())
    assert got == [("s", 0.0, 1.0, 1.0), ("v", 0.0, 2.0, 2.0), ("v", 5.0, 3.0, 1.0)]


def test_accounting_finds_missing_duplicated_and_unexpected_ids(spark) -> None:
    from agent.analytics.accounting import accounting

    generated = spark.createDataFrame(
        [("s1", 0, 5, None), ("s2", None, None, 0), ("s2", None, None, 1)],
        "src STRING, first BIGINT, count BIGINT, seq BIGINT")
    arrived = spark.createDataFrame(
        [("s1", 0), ("s1", 1), ("s1", 2), ("s1", 2), ("s1", 4), ("s2", 0), ("s2", 1), ("s3", 9)],
        "src STRING, seq BIGINT")
    a = accounting(arrived, generated)
    (s,) = a["summary"].collect()
    assert (s["generated"], s["arrived"], s["distinct_ids"], s["duplicate_copies"], s["missing"],
            s["unexpected"], s["exactly_once"]) == (7, 8, 7, 1, 1, 1, False)
    assert [tuple(r) for r in a["missing"].collect()] == [("s1", 3)]
    assert [tuple(r) for r in a["unexpected"].collect()] == [("s3", 9)]
    assert [(r["src"], r["seq"], r["copies"]) for r in a["duplicates"].collect()] == [("s1", 2, 2)]


def test_the_answers_count_a_record_once_when_a_re_homed_sink_landed_it_again(spark) -> None:
    """A sink's id file is on its node: re-homed after the node was lost, it lands the replays of
    records that had landed already. The accounting counts the copies; the queries read each id
    once (ids-less rows stay as they are)."""
    from agent.analytics import debs
    from agent.analytics.accounting import accounting, unique_records

    rows = [dict(r, src="src-1", seq=i) for i, r in enumerate(q1_rows())]
    anonymous = dict(rows[0], src=None, seq=None)
    landed = frame(spark, rows + rows[:10] + [anonymous, anonymous])
    once = unique_records(landed)
    assert once.count() == len(rows) + 2

    def answer(df) -> list:  # type: ignore[no-untyped-def]
        top = debs.top_routes(debs.prepare_trips(df)).orderBy("window_start", "rank")
        return [(r["window_start"], r["rank"], r["start_cell"], r["end_cell"], r["trips"]) for r in top.collect()]

    assert answer(once) == answer(frame(spark, rows + [anonymous, anonymous]))
    (s,) = accounting(landed.where("src IS NOT NULL"), None)["summary"].collect()
    assert (s["arrived"], s["distinct_ids"], s["duplicate_copies"]) == (len(rows) + 10, len(rows), 10)


def test_whole_job_from_spools_to_report(spark, tmp_path: Path) -> None:
    """Spools -> landing zone -> run_job: Parquet tables, report.md with plots, exactly once."""
    from agent.analytics.job import land_spools, run_job
    from agent.spill.spool import Spool

    spool = Spool(tmp_path / "spool", "n1", rotate_bytes=3000, sync_bytes=1000)
    rows = q1_rows()
    rows = [dict(r, src="src-1", seq=i) for i, r in enumerate(rows)]
    seq = len(rows)
    # The first 10 as one batch line (a JSON array, as a sink may spill it), the rest one by one.
    assert spool.append_lines("records", [json.dumps(rows[:10]).encode() + b"\n"]) == 1
    assert spool.append_many("records", rows[10:]) == len(rows) - 10
    spool.append("generated", {"src": "src-1", "first": 0, "count": seq})
    for i in range(20):
        for inst in ("in_zone-1", "in_zone-2")[: 1 + (i >= 10)]:
            spool.append("metrics", {"ts": 5.0 * i, "operator": "in_zone", "instance": inst,
                                     "load": 400.0 + 60 * i, "capacity": 500.0})
    for ev in ["duplication_request"] * 3 + ["lock_enter"] * 2:
        spool.append("events", {"ts": 1.0, "event": ev})
    spool.close()
    landing = tmp_path / "landing"
    assert land_spools([tmp_path / "spool"], landing) == len(spool.closed_files())
    assert land_spools([tmp_path / "spool"], landing) == len(spool.closed_files())  # idempotent
    out = tmp_path / "out"
    report = run_job(spark, landing, out)
    text = report.read_text()
    for section in ("End-to-end accounting", "query 1", "query 2", "SPEC metrics", "events"):
        assert section.lower() in text.lower()
    for png in ("trips_per_window.png", "top_routes.png", "elasticity.png"):
        assert (out / png).stat().st_size > 1000
    (summary,) = spark.read.parquet(str(out / "accounting_summary")).collect()
    assert summary["exactly_once"] is True and summary["generated"] == summary["arrived"] == len(rows)
    counts = {r["event"]: r["count"] for r in spark.read.parquet(str(out / "event_counts")).collect()}
    assert counts == {"duplication_request": 3, "lock_enter": 2}
    routes = spark.read.parquet(str(out / "top_routes")).where("rank = 1").orderBy("window_start").collect()
    assert [(r["start_cell"], r["end_cell"], r["trips"]) for r in routes][:2] == [("5.5", "6.6", 3), ("1.1", "2.2", 2)]
    plans = (out / "plans.txt").read_text()
    assert "== top_routes ==" in plans and "== elasticity_metrics ==" in plans
    assert "EvalPython" not in plans and "PythonUDF" not in plans  # built-in expressions only
    (m,) = spark.read.parquet(str(out / "elasticity_metrics")).collect()
    assert m["operator"] == "in_zone" and m["reconfigurations"] >= 1 and m["samples"] == 20
