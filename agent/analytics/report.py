"""The human report: Markdown with PNG plots, from the job's Parquet tables.

Only bounded results reach the driver here: the three busiest windows' top-10s, per-operator
metrics (one row each), event counts (one row per event type), the accounting summary (one row),
trips per window, and the demand/supply series (thinned to at most MAX_POINTS per operator).
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["write_report"]

MAX_POINTS = 2000
BUSIEST = 3


def _table(rows: Sequence[Dict[str, Any]], cols: Sequence[str]) -> str:
    if not rows:
        return "_(none)_\n"

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "NaN" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _load(spark: Any, out: Path, name: str) -> Optional[Any]:
    p = out / name
    return spark.read.parquet(str(p)) if p.is_dir() else None


def _rows(df: Any, limit: int) -> List[Dict[str, Any]]:
    return [r.asDict() for r in df.limit(limit).collect()]


def write_report(spark: Any, out: Path, landing: Path, elapsed: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pyspark.sql import functions as F

    md: List[str] = ["# Fog run report", ""]
    md.append(f"Landing zone: `{landing}`; tables (Parquet) in `{out}`; job time {elapsed:.1f} s.\n")

    # Accounting -----------------------------------------------------------------------------
    md.append("## End-to-end accounting (record ids)\n")
    summ = _load(spark, out, "accounting_summary")
    if summ is not None:
        rows = _rows(summ, 1)
        md.append(_table(rows, ["generated", "arrived", "distinct_ids", "duplicate_copies", "missing",
                                "unexpected", "exactly_once"]))
        if rows and rows[0].get("exactly_once") is None:
            md.append("\nNo `generated` spill: missing ids cannot be known, duplicates are.\n")
    else:
        md.append("_(no sink records spilled)_\n")

    # DEBS queries ---------------------------------------------------------------------------
    tpw = _load(spark, out, "trips_per_window")
    routes = _load(spark, out, "top_routes")
    areas = _load(spark, out, "profitable_areas")
    md.append("## DEBS 2015 query 1: top-10 routes per 30-minute window\n")
    if tpw is not None and routes is not None:
        per_window = _rows(tpw.orderBy("window_start"), 5000)
        busiest = sorted(per_window, key=lambda r: -r["trips_in_grid"])[:BUSIEST]
        total = sum(r["trips"] for r in per_window)
        outside = sum(r["trips_outside_grid"] for r in per_window)
        md.append(f"{total} trips in {len(per_window)} windows; {outside} outside the 300 x 300 grid "
                  f"(not routed). The {len(busiest)} busiest windows:\n")
        fig, ax = plt.subplots(figsize=(9, 3.5))
        xs = [r["window_start"] for r in per_window]
        if xs:  # close the last step at its window's end
            xs = xs + [xs[-1] + datetime.timedelta(minutes=30)]
        for key, label in (("trips_in_grid", "in grid"), ("trips_outside_grid", "outside grid")):
            ys = [r[key] for r in per_window]
            ax.plot(xs, ys + ys[-1:], drawstyle="steps-post", label=label)
        ax.set_ylabel("trips per 30 min")
        ax.set_title("Trips that reached the sink, by drop-off window")
        ax.legend()
        fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(out / "trips_per_window.png", dpi=100)
        plt.close(fig)
        md.append("![trips per window](trips_per_window.png)\n")
        starts = [b["window_start"] for b in busiest]
        # One bounded query per table for all the busiest windows (<= 10 rows per window).
        all_top = _rows(routes.where(F.col("window_start").isin(starts)).orderBy("window_start", "rank"),
                        10 * BUSIEST) if starts else []
        all_areas = (_rows(areas.where(F.col("window_start").isin(starts)).orderBy("window_start", "rank"),
                           10 * BUSIEST) if starts and areas is not None else [])
        for i, b in enumerate(busiest):
            start = b["window_start"]
            top = [r for r in all_top if r["window_start"] == start]
            md.append(f"### Window {start} ({b['trips_in_grid']} trips in the grid)\n")
            md.append(_table(top, ["rank", "start_cell", "end_cell", "trips", "last_dropoff"]))
            if areas is not None:
                top_a = [r for r in all_areas if r["window_start"] == start]
                md.append("\nMost profitable areas (query 2) in this window:\n")
                md.append(_table(top_a, ["rank", "cell", "profit", "empty_taxis", "profitability"]))
            if i == 0 and top:
                fig, ax = plt.subplots(figsize=(7, 3.5))
                labels = [f"{r['start_cell']}->{r['end_cell']}" for r in top][::-1]
                ax.barh(labels, [r["trips"] for r in top][::-1])
                ax.set_xlabel("trips")
                ax.set_title(f"Top routes, window {start}")
                fig.tight_layout()
                fig.savefig(out / "top_routes.png", dpi=100)
                plt.close(fig)
                md.append("\n![top routes](top_routes.png)\n")
    else:
        md.append("_(no sink records spilled)_\n")

    # Elasticity ----------------------------------------------------------------------------
    md.append("## Elasticity: demand vs supply per operator (SPEC metrics)\n")
    mets = _load(spark, out, "elasticity_metrics")
    series = _load(spark, out, "elasticity_series")
    if mets is not None and series is not None:
        rows = _rows(mets.orderBy("operator"), 1000)
        md.append("Demand = instances an ideal auto-scaler would run (ceil(load / capacity)); supply = "
                  "instances that reported. Definitions: `agent.metrics_spec` (Gesscale V-A).\n")
        md.append(_table(rows, ["operator", "accuracy_u", "accuracy_o", "timeshare_u", "timeshare_o",
                                "excess_time", "reconfigurations", "cost", "duration"]))
        ops = [r["operator"] for r in rows][:8]
        fig, axes = plt.subplots(len(ops), 1, figsize=(9, 2.2 * max(1, len(ops))), squeeze=False)
        every = _rows(series.where(F.col("operator").isin(ops)).orderBy("operator", "t"), 50000 * len(ops))
        for ax, op in zip(axes[:, 0], ops):
            pts = [p for p in every if p["operator"] == op]
            step = max(1, len(pts) // MAX_POINTS)
            pts = pts[::step]
            t0 = pts[0]["t"] if pts else 0.0
            ax.plot([p["t"] - t0 for p in pts], [p["demand"] for p in pts], drawstyle="steps-post", label="demand")
            ax.plot([p["t"] - t0 for p in pts], [p["supply"] for p in pts], drawstyle="steps-post", label="supply")
            ax.set_ylabel(op)
            ax.legend(loc="upper right")
        axes[-1, 0].set_xlabel("seconds since start")
        fig.tight_layout()
        fig.savefig(out / "elasticity.png", dpi=100)
        plt.close(fig)
        md.append("\n![demand vs supply](elasticity.png)\n")
    else:
        md.append("_(no metrics spilled)_\n")

    md.append("## Protocol, lock and spool events\n")
    ev = _load(spark, out, "event_counts")
    if ev is not None:
        cols = [c for c in ev.columns]
        md.append(_table(_rows(ev.orderBy(F.desc("count")), 200), cols))
    else:
        md.append("_(no events spilled)_\n")

    report = out / "report.md"
    report.write_text("\n".join(md))
    return report
