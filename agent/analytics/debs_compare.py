"""DEBS 2015 queries 1 and 2 at the edge against the batch job, window by window (issue 22, item 6).

Query 1: the edge's answer is the windows of `foglab.operators.debs` (`TopRoutes` or the merge of
the two stages: one row per window, emitted when the watermark passed its end); the batch answer
`agent.analytics.debs.top_routes` over the same trips with the same tumbling window. Both rank by
trips, then the most recent drop-off, then the cells as numbers, so equal inputs give equal lists.
Query 2: the windows of `foglab.operators.debs_areas.MergeTopAreas` against
`agent.analytics.debs.profitable_areas`; a window in which no cell has both a profit and an empty
taxi has no row in batch and an empty list at the edge: equal. The profits and ratios are compared
exactly (the edge computes the same doubles: foglab.operators.debs_areas.median).

`compare_top_routes` / `compare_profitable_areas` list every window whose lists differ. Windows
the batch has past the edge's last emitted one were still open at the edge when its input ended
(the watermark never reached them): counted as `open_at_edge`, not as a difference; a batch window
before that which the edge never emitted is a difference.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List

__all__ = ["batch_top_routes", "compare_top_routes", "batch_profitable_areas", "compare_profitable_areas"]


def batch_top_routes(trips: Any, n: int = 10) -> List[Dict[str, Any]]:
    """The batch job's query 1 as small rows for the driver (a few per window): start_ms, rank,
    start_cell, end_cell, trips, last_ms. `trips` comes from `prepare_trips(df, window)`."""
    from pyspark.sql import functions as F

    from agent.analytics.debs import top_routes

    rows = top_routes(trips, n).select(
        (F.unix_timestamp("window_start") * 1000).cast("long").alias("start_ms"), "rank", "start_cell", "end_cell",
        "trips", (F.unix_timestamp("last_dropoff") * 1000).cast("long").alias("last_ms"))
    return [r.asDict() for r in rows.collect()]


def batch_profitable_areas(trips: Any, n: int = 10, recent: str = "15 minutes") -> List[Dict[str, Any]]:
    """The batch job's query 2 as small rows for the driver (at most `n` per window): start_ms,
    rank, cell, profit, empty_taxis, profitability."""
    from pyspark.sql import functions as F

    from agent.analytics.debs import profitable_areas

    rows = profitable_areas(trips, n, recent).select(
        (F.unix_timestamp("window_start") * 1000).cast("long").alias("start_ms"), "rank", "cell", "profit",
        "empty_taxis", "profitability")
    return [r.asDict() for r in rows.collect()]


def _compare(at_edge: Dict[int, List[Any]], at_batch: Dict[int, List[Any]], absent: Any) -> Dict[str, Any]:
    """Window by window; a window the edge emitted and the batch has no row for counts as `absent`."""
    last = max(at_edge) if at_edge else None
    diffs = []
    equal = open_at_edge = 0
    for start in sorted(set(at_edge) | set(at_batch)):
        e, b = at_edge.get(start), at_batch.get(start, absent if start in at_edge else None)
        if e is None and (last is None or start > last):
            open_at_edge += 1
        elif e == b:
            equal += 1
        else:
            diffs.append({"start": start, "edge": e, "batch": b})
    return {"windows_edge": len(at_edge), "windows_batch": len(at_batch), "equal": equal,
            "open_at_edge": open_at_edge, "differences": diffs}


def compare_top_routes(edge: Iterable[Dict[str, Any]], batch: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """{windows_edge, windows_batch, equal, open_at_edge, differences: [{start, edge, batch}]}."""
    at_edge = {int(w["start"]): [list(r) for r in w["top"]] for w in edge}
    at_batch: Dict[int, List[Any]] = {}
    for r in sorted(batch, key=lambda r: (r["start_ms"], r["rank"])):
        at_batch.setdefault(int(r["start_ms"]), []).append(
            [r["start_cell"], r["end_cell"], int(r["trips"]), int(r["last_ms"])])
    return _compare(at_edge, at_batch, None)


def compare_profitable_areas(edge: Iterable[Dict[str, Any]], batch: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """Query 2, as `compare_top_routes`: the edge's `areas` lists against the batch rows."""
    at_edge = {int(w["start"]): [list(r) for r in w["areas"]] for w in edge}
    at_batch: Dict[int, List[Any]] = {}
    for r in sorted(batch, key=lambda r: (r["start_ms"], r["rank"])):
        at_batch.setdefault(int(r["start_ms"]), []).append(
            [r["cell"], float(r["profit"]), int(r["empty_taxis"]), float(r["profitability"])])
    return _compare(at_edge, at_batch, [])
