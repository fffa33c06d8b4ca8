"""DEBS query 1 at the edge (agent.operators.debs.TopRoutes, run by the keyed state as a worker
runs it) against the batch job's answer in real PySpark over the same trips, window by window
(agent.analytics.debs_compare): equal, and a changed input shows up as a listed difference."""

from __future__ import annotations

import functools
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
