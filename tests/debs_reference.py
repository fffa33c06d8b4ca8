"""DEBS 2015 query 2 by its batch definition, in plain Python, for small inputs: the oracle of the
edge's three stages in the unit and live tests (tests/test_debs_areas.py, tests/test_debs_edge.py).

Written from the definition (docs/spill.md, agent/analytics/debs.py profitable_areas), not from the
edge's code: each taxi's trips sorted by (drop-off, pickup), the next pickup of each trip, the
median as Spark's `percentile` computes it (for an even count a + 0.5 * (b - a)), the ranking by a
sort. tests/test_debs_edge.py checks it against Spark.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

from agent.operators.keyed import parse_event_time


def _cell(text: str) -> Tuple[int, int]:
    x, y = text.split(".")
    return int(x), int(y)


def reference_areas(trips: Iterable[Dict[str, Any]], size_ms: int, recent_ms: int = 900_000,
                    k: int = 10) -> Dict[int, List[List[Any]]]:
    """{window start ms: [[cell, profit, empty taxis, profitability], ...]} for every window with a
    ranked cell (windows without one are absent, as in the batch job's table)."""
    rows = []
    for r in trips:
        d, p = parse_event_time(r["dropoff_datetime"]), parse_event_time(r["pickup_datetime"])
        if d is None or p is None:
            continue
        rows.append((r["medallion"], d, p, r["pickup_cell"], r["dropoff_cell"], r))
    empty: Dict[Tuple[int, str], set] = {}
    by_taxi: Dict[str, List[Any]] = {}
    for row in rows:
        by_taxi.setdefault(row[0], []).append(row)
    for taxi, ts in by_taxi.items():
        ts.sort(key=lambda t: (t[1], t[2], t[4]))
        for i, (_, d, _, _, dcell, _) in enumerate(ts):
            end = int(d // size_ms * size_ms) + size_ms
            if i + 1 == len(ts) or ts[i + 1][2] >= end:
                empty.setdefault((end - size_ms, dcell), set()).add(taxi)
    values: Dict[Tuple[int, str], List[float]] = {}
    for _, d, _, pcell, _, r in rows:
        start = int(d // size_ms * size_ms)
        fare, tip = r.get("fare_amount"), r.get("tip_amount")
        if fare is not None and tip is not None and fare > 0 and tip >= 0 and d >= start + size_ms - recent_ms:
            values.setdefault((start, pcell), []).append(fare + tip)
    ranked: Dict[int, List[Tuple[Any, ...]]] = {}
    for (start, cell), vs in values.items():
        n = len(empty.get((start, cell), ()))
        if n:
            vs = sorted(vs)
            mid = len(vs) // 2
            profit = vs[mid] if len(vs) % 2 else vs[mid - 1] + 0.5 * (vs[mid] - vs[mid - 1])
            ranked.setdefault(start, []).append((profit / n, profit, cell, n))
    out = {}
    for start, cells in ranked.items():
        cells.sort(key=lambda c: (-c[0], -c[1], _cell(c[2])))
        out[start] = [[cell, profit, n, ratio] for ratio, profit, cell, n in cells[:k]]
    return out
