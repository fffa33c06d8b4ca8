"""The elasticity report in Spark: demand vs supply per operator and the SPEC metrics.

The definitions are `agent.metrics_spec`'s (shared with the simulator and the demo); this module
computes the same numbers with built-in Spark expressions so that they scale to long runs with
many operators, and `tests/test_analytics_spark.py` checks both agree on the same series:

- a sample holds from its time stamp until the next one (`lead(t) - t`); the last sample of an
  operator holds for the median step, taken the way `metrics_spec.step_durations` takes it (the
  upper median: element n // 2 of the sorted steps), or 1 s for a single sample;
- accuracy_U/O = sum(max(d - s, 0) * dt) / T and sum(max(s - d, 0) * dt) / T;
- timeshare_U/O = sum(dt where d > s) / T and sum(dt where s > d) / T;
- reconfigurations = number of supply changes; cost = sum(s * dt) / 60 instance-minutes;
- excess_time = max(actual_end - ideal_end, 0) / T when the series carries `actual_end` and
  `ideal_end` columns (per operator), else 0 (as `metrics_spec.elasticity_metrics` by default).

Input series: one row per (operator, t) with demand and supply. `series_from_metrics` builds it
from the per-instance metric samples the agents spill (see docs/spill.md): supply = instances that
reported in the period, demand = ceil(total load / capacity), the instances an ideal, instantaneous
auto-scaler would run (Gesscale's reference), at least 1.
"""

from __future__ import annotations

from typing import Any

__all__ = ["series_from_metrics", "spec_metrics"]


def series_from_metrics(metrics: Any, period: float = 5.0) -> Any:
    """Per-instance samples (ts, operator, instance, load, capacity) -> (operator, t, demand, supply).

    Rows that already carry `demand` and `supply` (operator-level samples, e.g. from the
    simulator) are passed through unchanged."""
    from pyspark.sql import functions as F

    cols = set(metrics.columns)
    if {"demand", "supply"} <= cols:
        return metrics.select("operator", F.col("ts").cast("double").alias("t"),
                              F.col("demand").cast("double"), F.col("supply").cast("double"))
    bucket = (F.floor(F.col("ts").cast("double") / period) * period).alias("t")
    per_instance = metrics.groupBy("operator", "instance", bucket).agg(
        F.avg("load").alias("load"), F.avg("capacity").alias("capacity"))
    return per_instance.groupBy("operator", "t").agg(
        F.greatest(F.lit(1.0), F.ceil(F.sum("load") / F.avg("capacity"))).cast("double").alias("demand"),
        F.countDistinct("instance").cast("double").alias("supply"),
    )


def spec_metrics(series: Any) -> Any:
    """(operator, t, demand, supply[, actual_end, ideal_end]) -> one row of SPEC metrics per operator."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    by_t = Window.partitionBy("operator").orderBy("t")
    s = series.withColumn("step", F.lead("t").over(by_t) - F.col("t")).withColumn(
        "changed", F.when(F.lag("supply").over(by_t) != F.col("supply"), 1).otherwise(0))
    steps = s.where(F.col("step").isNotNull()).groupBy("operator").agg(
        F.sort_array(F.collect_list("step")).alias("steps"))
    last_step = F.when(F.size("steps") > 0,
                       F.element_at("steps", (F.floor(F.size("steps") / 2) + 1).cast("int"))
                       ).otherwise(F.lit(1.0))
    s = (s.join(steps, "operator", "left")
         .withColumn("steps", F.coalesce(F.col("steps"), F.array().cast("array<double>")))
         .withColumn("dt", F.coalesce(F.col("step"), last_step)))
    d, sup, dt = F.col("demand"), F.col("supply"), F.col("dt")
    has_ends = {"actual_end", "ideal_end"} <= set(series.columns)
    aggs = [
        F.sum(dt).alias("duration"),
        F.sum(F.greatest(d - sup, F.lit(0.0)) * dt).alias("under_area"),
        F.sum(F.greatest(sup - d, F.lit(0.0)) * dt).alias("over_area"),
        F.sum(F.when(d > sup, dt).otherwise(0.0)).alias("under_time"),
        F.sum(F.when(sup > d, dt).otherwise(0.0)).alias("over_time"),
        F.sum("changed").cast("int").alias("reconfigurations"),
        F.sum(sup * dt).alias("supply_area"),
        F.count(F.lit(1)).alias("samples"),
    ]
    if has_ends:
        aggs.append(F.max(F.col("actual_end") - F.col("ideal_end")).alias("late"))
    g = s.groupBy("operator").agg(*aggs)
    T = F.col("duration")
    excess = F.greatest(F.col("late"), F.lit(0.0)) / T if has_ends else F.lit(0.0)
    return g.select(
        "operator",
        (F.col("under_area") / T).alias("accuracy_u"),
        (F.col("over_area") / T).alias("accuracy_o"),
        (F.col("under_time") / T).alias("timeshare_u"),
        (F.col("over_time") / T).alias("timeshare_o"),
        excess.cast("double").alias("excess_time"),
        "reconfigurations",
        (F.col("supply_area") / 60.0).alias("cost"),
        T.alias("duration"),
        "samples",
    )
