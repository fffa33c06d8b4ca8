"""DEBS 2015 Grand Challenge queries in batch form, as Spark DataFrame expressions.

The challenge defines two *continuous* queries over a sliding 30-minute (query 1) and 15/30-minute
(query 2) window, re-evaluated on every event. Over data at rest we evaluate them once per
30-minute *tumbling* window of drop-off time (aligned on the hour, UTC), which is what a
researcher looks at afterwards. Simplifications, all documented in docs/spill.md:

Query 1 -- frequent routes. A route is (pickup cell, drop-off cell) on the 500 m grid; both cells
must be inside the 300 x 300 grid (other trips are counted in `trips_outside_grid`, not routed).
Per window: the 10 routes with most trips whose drop-off falls in the window. Ties (the challenge
breaks them by freshness): more recent last drop-off first, then lower start cell (x, y), then
lower end cell -- so the answer is deterministic.

Query 2 -- profitable areas (on 500 m cells, not the original 250 m). Per window [s, e):
- profit(cell) = exact median of fare_amount + tip_amount over trips that started in the cell and
  ended in the last 15 minutes of the window [e - 15 min, e), as in the challenge. Trips with
  fare_amount <= 0 (disputes, no charge, bad data) or a negative tip do not enter the median.
- empty_taxis(cell) = taxis whose last drop-off in the window was in the cell and that have not
  picked anyone up since (before e). A taxi's next pickup comes from all its trips, in or out of
  the grid.
- profitability = profit / empty_taxis; cells with no empty taxi (undefined ratio) or no
  profitable trip are not ranked. Top 10 by profitability, ties by higher profit, then cell.

Everything is built-in expressions (window functions, `percentile`, `row_number`): no Python UDF
and no collect(), so the plan is the same in local mode and on a cluster.
"""

from __future__ import annotations

from typing import Any

from agent.analytics.grid import cell_columns, in_grid

__all__ = ["TRIP_FIELDS", "TRIP_SCHEMA_DDL", "prepare_trips", "top_routes", "profitable_areas"]

TRIP_FIELDS = (
    "medallion", "hack_license", "pickup_datetime", "dropoff_datetime", "trip_time_in_secs",
    "trip_distance", "pickup_longitude", "pickup_latitude", "dropoff_longitude", "dropoff_latitude",
    "payment_type", "fare_amount", "surcharge", "mta_tax", "tip_amount", "tolls_amount",
    "total_amount",
)

# The sink's spilled record: the DEBS fields plus its record id (source instance, sequence number)
# and, when `in_zone` ran, its cells. An explicit schema spares Spark a full pass to infer one.
TRIP_SCHEMA_DDL = (
    "src STRING, seq BIGINT, record_id STRING, medallion STRING, hack_license STRING, "
    "pickup_datetime STRING, dropoff_datetime STRING, trip_time_in_secs BIGINT, "
    "trip_distance DOUBLE, pickup_longitude DOUBLE, pickup_latitude DOUBLE, "
    "dropoff_longitude DOUBLE, dropoff_latitude DOUBLE, payment_type STRING, fare_amount DOUBLE, "
    "surcharge DOUBLE, mta_tax DOUBLE, tip_amount DOUBLE, tolls_amount DOUBLE, total_amount DOUBLE"
)

WINDOW = "30 minutes"
TS_FORMAT = "yyyy-MM-dd HH:mm:ss"


def prepare_trips(df: Any, window: str = WINDOW) -> Any:
    """Parse times, compute grid cells and the window of each trip (drop-off time): 30 minutes,
    or `window` (a Spark interval, e.g. "5 minutes": the edge's windows, to compare with them)."""
    from pyspark.sql import functions as F

    px, py = cell_columns("pickup_latitude", "pickup_longitude")
    dx, dy = cell_columns("dropoff_latitude", "dropoff_longitude")
    out = (
        df.withColumn("pickup_ts", F.to_timestamp("pickup_datetime", TS_FORMAT))
        .withColumn("dropoff_ts", F.to_timestamp("dropoff_datetime", TS_FORMAT))
        .where(F.col("pickup_ts").isNotNull() & F.col("dropoff_ts").isNotNull())
        .withColumn("px", px).withColumn("py", py).withColumn("dx", dx).withColumn("dy", dy)
        .withColumn("window", F.window("dropoff_ts", window))
    )
    return out.withColumn("in_grid", in_grid(F.col("px"), F.col("py")) & in_grid(F.col("dx"), F.col("dy")))


def _cell(x: str, y: str) -> Any:
    from pyspark.sql import functions as F

    return F.concat_ws(".", F.col(x).cast("string"), F.col(y).cast("string"))


def top_routes(trips: Any, n: int = 10) -> Any:
    """Query 1: window_start, window_end, rank, start_cell, end_cell, trips, last_dropoff."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    routes = (
        trips.where("in_grid")
        .groupBy("window", "px", "py", "dx", "dy")
        .agg(F.count(F.lit(1)).alias("trips"), F.max("dropoff_ts").alias("last_dropoff"))
    )
    w = Window.partitionBy("window").orderBy(
        F.desc("trips"), F.desc("last_dropoff"), "px", "py", "dx", "dy")
    return (
        routes.withColumn("rank", F.row_number().over(w))
        .where(F.col("rank") <= n)
        .select(
            F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
            "rank", _cell("px", "py").alias("start_cell"), _cell("dx", "dy").alias("end_cell"),
            "trips", "last_dropoff",
        )
    )


def profitable_areas(trips: Any, n: int = 10, recent: str = "15 minutes") -> Any:
    """Query 2: window_start, window_end, rank, cell, profit, empty_taxis, profitability. `recent`:
    the end of the window whose trips make the profit (the challenge's 15 minutes; a Spark interval,
    so that a test with shorter windows can compare with the edge's `recent_ms`)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    # Empty taxis: the trip's drop-off is the taxi's last in the window and its next pickup (from
    # any trip of the same taxi) is not before the window end.
    by_taxi = Window.partitionBy("medallion").orderBy("dropoff_ts", "pickup_ts")
    empty = (
        trips.withColumn("next_pickup", F.lead("pickup_ts").over(by_taxi))
        .where(in_grid(F.col("dx"), F.col("dy")))
        .where(F.col("next_pickup").isNull() | (F.col("next_pickup") >= F.col("window.end")))
        .groupBy("window", F.col("dx").alias("x"), F.col("dy").alias("y"))
        .agg(F.countDistinct("medallion").alias("empty_taxis"))
    )
    profit = (
        trips.where(in_grid(F.col("px"), F.col("py")))
        .where((F.col("fare_amount") > 0) & (F.col("tip_amount") >= 0))
        .where(F.col("dropoff_ts") >= F.col("window.end") - F.expr(f"INTERVAL {recent}"))
        .groupBy("window", F.col("px").alias("x"), F.col("py").alias("y"))
        .agg(F.expr("percentile(fare_amount + tip_amount, 0.5)").alias("profit"))
    )
    areas = profit.join(empty, ["window", "x", "y"]).withColumn(
        "profitability", F.col("profit") / F.col("empty_taxis"))
    w = Window.partitionBy("window").orderBy(F.desc("profitability"), F.desc("profit"), "x", "y")
    return (
        areas.withColumn("rank", F.row_number().over(w))
        .where(F.col("rank") <= n)
        .select(
            F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
            "rank", _cell("x", "y").alias("cell"), "profit", "empty_taxis", "profitability",
        )
    )
