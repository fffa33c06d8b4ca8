"""The batch job over a landing zone: DEBS queries, elasticity report, accounting, Parquet + report.

Entry points:
- `fog-agent analytics run --landing DIR --out DIR [--master URL]` (agent.cli.spill_cmd);
- `spark-submit --py-files agent.zip agent/analytics/job.py --landing DIR --out DIR` (any master);
- `run_demo_analytics(spool_dirs_or_landing, out_dir)` for `make demo`;
- `run_job(spark, landing, out)` with a session you already have (tests).

Landing zone layout: `kind=<kind>/date=<date>/node=<node>/*.jsonl.gz` (agent.spill.landing).
Kinds read: "records" (sink output: DEBS fields + src/seq ids), "batches" (sink output as the
batches arrived, keys once per batch: see `read_records`), "generated" (source id ranges),
"metrics" (per-instance load samples), "events" (protocol, lock and spool events). A missing kind
only leaves its part of the report empty.

Outputs in --out: Parquet tables top_routes/, profitable_areas/, elasticity_series/,
elasticity_metrics/, event_counts/, accounting_summary/, accounting_missing/,
accounting_duplicates/, trips_per_window/, report.md with PNG plots, and plans.txt (the physical
plans: no Python UDF node in any of them). Only small aggregates
(a few hundred rows) ever reach the driver, for the report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Sequence, Union

__all__ = ["build_session", "read_kind", "read_records", "run", "run_demo_analytics", "run_job", "main"]

PathLike = Union[str, Path]


def build_session(master: Optional[str] = None, app: str = "fog-analytics",
                  driver_memory: Optional[str] = None) -> Any:
    """A SparkSession; `master=None` keeps what spark-submit configured (or local[*])."""
    import os

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    b = (SparkSession.builder.appName(app).config("spark.sql.session.timeZone", "UTC")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.debug.maxToStringFields", "1000"))  # no warning for the report's wide plans
    if driver_memory:  # only effective when this call starts the JVM (not under spark-submit)
        b = b.config("spark.driver.memory", driver_memory)
    if master:
        b = b.master(master)
        if master.startswith("local"):
            b = b.config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "8")
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


# Kinds whose every line names its node (events.make): their date=/node= folders are not read as
# columns, which would give the frame a second `node` (Spark warns COLUMN_ALREADY_EXISTS).
NAMES_ITS_NODE = frozenset({"events"})


def read_kind(spark: Any, landing: PathLike, kind: str, schema: Optional[str] = None) -> Optional[Any]:
    path = Path(landing) / f"kind={kind}"
    if not path.is_dir() or not any(path.glob("date=*/node=*/*.gz")):
        return None
    reader = spark.read
    if kind in NAMES_ITS_NODE:
        reader = reader.option("recursiveFileLookup", "true")
    if schema:
        reader = reader.schema(schema)
    return reader.json(str(path))


BATCH_SCHEMA_DDL = "k ARRAY<STRING>, r ARRAY<STRING>"


def read_records(spark: Any, landing: PathLike) -> Optional[Any]:
    """Sink output with the TRIP schema: kind "records" (one record, or an array of records, per
    line) plus kind "batches" (a sink's batch as it arrived: {"k": keys, "r": [[src, seq,
    [values]], ...]}), expanded with built-in expressions only: each row of `r` is read as JSON
    text, split into [src, seq, values], and the values are paired with the keys in a map."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    from agent.analytics import debs

    records = read_kind(spark, landing, "records", debs.TRIP_SCHEMA_DDL)
    batches = read_kind(spark, landing, "batches", BATCH_SCHEMA_DDL)
    if batches is None:
        return records
    schema = StructType.fromDDL(debs.TRIP_SCHEMA_DDL)
    parts = [c for c in batches.columns if c not in ("k", "r")]  # date=/node= partition columns
    rows = batches.select(*parts, "k", F.explode("r").alias("row")).select(
        *parts, "k", F.from_json("row", "ARRAY<STRING>").alias("a"))
    rows = rows.select(*parts, F.col("a")[0].alias("src"), F.col("a")[1].alias("seq"),
                       F.map_from_arrays("k", F.from_json(F.col("a")[2], "ARRAY<STRING>")).alias("m"))
    cols = []
    for f in schema.fields:
        if f.name == "src":
            cols.append(F.col("src").cast(f.dataType).alias("src"))
        elif f.name == "seq":
            cols.append(F.col("seq").cast(f.dataType).alias("seq"))
        else:
            cols.append(F.col("m")[f.name].cast(f.dataType).alias(f.name))
    expanded = rows.select(*cols, *parts)
    return expanded if records is None else records.unionByName(expanded, allowMissingColumns=True)


def run_job(spark: Any, landing: PathLike, out: PathLike, period: float = 5.0) -> Path:
    """Compute everything from `landing`, write tables and the report to `out`; return report path."""
    from pyspark.sql import functions as F

    from agent.analytics import accounting as acc
    from agent.analytics import debs, elasticity
    from agent.analytics.report import write_report

    t0 = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tables: Dict[str, Any] = {}
    records = read_records(spark, landing)
    generated = read_kind(spark, landing, "generated")
    metrics = read_kind(spark, landing, "metrics")
    events = read_kind(spark, landing, "events")

    if records is not None:
        # Parse the JSON once: the DEBS queries and the accounting all read the cached rows
        # (memory and disk: a cluster spills what does not fit, the plan stays the same).
        landed = records.cache()
        records = acc.unique_records(landed)
        trips = debs.prepare_trips(records)
        tables["top_routes"] = debs.top_routes(trips)
        tables["profitable_areas"] = debs.profitable_areas(trips)
        tables["trips_per_window"] = trips.groupBy(F.col("window.start").alias("window_start")).agg(
            F.count(F.lit(1)).alias("trips"),
            F.sum(F.when(F.col("in_grid"), 1).otherwise(0)).alias("trips_in_grid"),
            F.sum(F.when(F.col("in_grid"), 0).otherwise(1)).alias("trips_outside_grid"),
        )
        # a keyed operator's outputs (ids "<operator>#<key digest>", e.g. the edge's DEBS answers)
        # are not source records: the accounting is about the trips
        a = acc.accounting(landed.where(~F.col("src").contains("#")), generated)
        tables["accounting_summary"] = a["summary"]
        tables["accounting_duplicates"] = a["duplicates"]
        if "missing" in a:
            tables["accounting_missing"] = a["missing"]
            tables["accounting_unexpected"] = a["unexpected"]
    if metrics is not None and "operator" in metrics.columns:
        series = elasticity.series_from_metrics(metrics, period).cache()
        tables["elasticity_series"] = series
        tables["elasticity_metrics"] = elasticity.spec_metrics(series)
    if events is not None:
        keys = [c for c in ("event", "type", "kind") if c in events.columns]
        if keys:
            # One row per event, or one row per event type with a "count" (pre-aggregated).
            n = F.coalesce(F.col("count").cast("long"), F.lit(1)) if "count" in events.columns else F.lit(1)
            tables["event_counts"] = events.groupBy(*keys).agg(F.sum(n).alias("count"))

    for name, df in tables.items():
        df.write.mode("overwrite").parquet(str(out / name))
    if records is not None:
        # queries 1 and 2 as JSON too (at most 10 rows per window): what the edge's answers are
        # compared with (agent.analytics.debs_compare; the demo's analytics step)
        from agent.analytics.debs_compare import batch_profitable_areas, batch_top_routes

        (out / "top_routes.json").write_text(json.dumps(batch_top_routes(trips), separators=(",", ":")))
        (out / "profitable_areas.json").write_text(json.dumps(batch_profitable_areas(trips), separators=(",", ":")))
    _write_plans(tables, out / "plans.txt")
    # The report reads the small Parquet tables back (bounded collect()s, see report.py).
    report = write_report(spark, out, Path(landing), elapsed=time.monotonic() - t0)
    return report


def _write_plans(tables: Dict[str, Any], path: Path) -> None:
    """The physical plans, so that a reader can check there is no Python UDF (BatchEvalPython /
    ArrowEvalPython) and no driver-side step: the same plan runs on a cluster."""
    import contextlib
    import io

    buf = io.StringIO()
    for name, df in tables.items():
        buf.write(f"== {name} ==\n")
        with contextlib.redirect_stdout(buf):
            df.explain()
    path.write_text(buf.getvalue())


def run(landing: PathLike, out: PathLike, master: Optional[str] = "local[*]", period: float = 5.0) -> Path:
    spark = build_session(master)
    try:
        return run_job(spark, landing, out, period)
    finally:
        if master:  # a session we created; under spark-submit the driver owns its lifetime
            spark.stop()


def land_spools(spool_dirs: Iterable[PathLike], landing: PathLike) -> int:
    """Land every closed file of the given spool directories (the demo's "shared path" shipping)."""
    from agent.spill.landing import LandingZone
    from agent.spill.shipping import meta_for
    from agent.spill.spool import ClosedFile, parse_name

    zone = LandingZone(landing)
    n = 0
    for d in spool_dirs:
        for p in sorted((Path(d) / "closed").glob("*.jsonl.gz")):
            meta = parse_name(p.name)
            data = p.read_bytes()
            f = ClosedFile(p, meta["kind"], meta["node"], meta["date"], meta["seq"], len(data))
            zone.land(meta_for(f, data), data)
            n += 1
    return n


def run_demo_analytics(source: Union[PathLike, Sequence[PathLike]], out_dir: PathLike,
                       master: str = "local[2]") -> Path:
    """`make demo`'s last step: spool directories (or a landing zone) in, report path out.

    Spool directories are landed into `<out_dir>/landing` first (their files stay in the spools)."""
    out_dir = Path(out_dir)
    if isinstance(source, (str, Path)) and any(Path(source).glob("kind=*")):
        landing = Path(source)
    else:
        dirs = [source] if isinstance(source, (str, Path)) else list(source)
        landing = out_dir / "landing"
        land_spools(dirs, landing)
    return run(landing, out_dir / "analytics", master)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="fog-analytics", description=__doc__.splitlines()[0])
    p.add_argument("--landing", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--master", default=None, help="Spark master URL (default: spark-submit's, else local[*])")
    p.add_argument("--period", type=float, default=5.0, help="metrics period in seconds")
    args = p.parse_args(argv)
    report = run(args.landing, args.out, args.master, args.period)
    print(json.dumps({"report": str(report)}))
    return 0


if __name__ == "__main__":  # spark-submit agent/analytics/job.py ...
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
