"""End-to-end accounting: did every generated record id arrive at the sink exactly once?

A record id is (source instance, sequence number), as the runtime's sources number them
(`agent.operators.taxi.TaxiSource`). Sources spill what they generated as kind "generated", either
one row per record {"src", "seq"} or one row per range {"src", "first", "count"} (compact: the ids
of a source are consecutive). Sinks spill what arrived as kind "records" with "src" and "seq".
Records that only carry a "record_id" use it as `src` with seq 0.

Everything is one full outer join of expected and arrived ids plus aggregations in Spark: the
driver receives one summary row, never the ids themselves.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["unique_records", "record_keys", "generated_keys", "accounting"]


def unique_records(records: Any) -> Any:
    """One row per record id (src, seq): what the queries read. A sink drops the copies it has
    seen by id, but its id file is on its node: a sink re-homed after its node was lost, or its
    disk, lands the replays of records that had already landed from the old node. The landing
    keeps both files (each landed exactly once) and the accounting counts the copies
    (`duplicate_copies`); the answers count each record once. Rows without an id are kept as they
    are (one id-less row must not stand for all of them)."""
    from pyspark.sql import functions as F

    has_id = F.col("src").isNotNull() & F.col("seq").isNotNull()
    return records.where(has_id).dropDuplicates(["src", "seq"]).unionByName(records.where(~has_id))


def record_keys(df: Any) -> Any:
    """(src string, seq long) of each arrived record."""
    from pyspark.sql import functions as F

    cols = set(df.columns)
    if {"src", "seq"} <= cols:
        if "record_id" in cols:
            src = F.coalesce(F.col("src"), F.col("record_id").cast("string"))
            seq = F.coalesce(F.col("seq").cast("long"), F.lit(0).cast("long"))
        else:
            src, seq = F.col("src"), F.col("seq").cast("long")
    elif "record_id" in cols:
        src, seq = F.col("record_id").cast("string"), F.lit(0).cast("long")
    else:
        raise ValueError(f"records have no id columns: expected src+seq or record_id, found {sorted(cols)}")
    return df.select(src.alias("src"), seq.alias("seq"))


def generated_keys(df: Any) -> Any:
    """Expand range rows with the built-in `sequence` + `explode` (no Python)."""
    from pyspark.sql import functions as F

    cols = set(df.columns)
    parts = []
    if {"first", "count"} <= cols:
        ranges = df.where(F.col("first").isNotNull() & (F.col("count") > 0))
        parts.append(ranges.select(
            F.col("src").cast("string").alias("src"),
            F.explode(F.sequence(F.col("first").cast("long"),
                                 (F.col("first") + F.col("count") - 1).cast("long"))).alias("seq")))
        single = df.where(F.col("first").isNull())
    else:
        single = df
    if {"src", "seq"} <= cols or "record_id" in cols:
        parts.append(record_keys(single).where(F.col("src").isNotNull()))
    if not parts:
        raise ValueError(f"generated rows: expected src+first+count, src+seq or record_id, found {sorted(cols)}")
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def accounting(arrived: Any, generated: Optional[Any]) -> Dict[str, Any]:
    """Return a dict of DataFrames: summary (one row), duplicates, missing, unexpected."""
    from pyspark.sql import functions as F

    keys = record_keys(arrived)
    counts = keys.groupBy("src", "seq").agg(F.count(F.lit(1)).alias("copies"))
    duplicates = counts.where("copies > 1")
    summary_cols = [
        F.sum("copies").alias("arrived"),
        F.count(F.lit(1)).alias("distinct_ids"),
        F.sum(F.when(F.col("copies") > 1, F.col("copies") - 1).otherwise(0)).alias("duplicate_copies"),
    ]
    summary = counts.agg(*summary_cols)
    out: Dict[str, Any] = {"duplicates": duplicates}
    if generated is None:
        out["summary"] = summary.select(
            F.lit(None).cast("long").alias("generated"), "arrived", "distinct_ids", "duplicate_copies",
            F.lit(None).cast("long").alias("missing"), F.lit(None).cast("long").alias("unexpected"),
            F.lit(None).cast("boolean").alias("exactly_once"))
        return out
    # One full outer join of expected ids with arrived ids answers every question at once.
    expected = generated_keys(generated).distinct().withColumn("expected", F.lit(True))
    joined = expected.join(counts, ["src", "seq"], "full_outer").cache()  # summary + 2 tables
    is_exp, arrived_col = F.col("expected").isNotNull(), F.col("copies").isNotNull()
    n = joined.agg(
        F.sum(F.when(is_exp, 1).otherwise(0)).cast("long").alias("generated"),
        F.coalesce(F.sum("copies"), F.lit(0)).cast("long").alias("arrived"),
        F.sum(F.when(arrived_col, 1).otherwise(0)).cast("long").alias("distinct_ids"),
        F.coalesce(F.sum(F.when(F.col("copies") > 1, F.col("copies") - 1)), F.lit(0)).cast("long")
        .alias("duplicate_copies"),
        F.sum(F.when(is_exp & ~arrived_col, 1).otherwise(0)).cast("long").alias("missing"),
        F.sum(F.when(arrived_col & ~is_exp, 1).otherwise(0)).cast("long").alias("unexpected"),
    )
    out["summary"] = n.select(
        "generated", "arrived", "distinct_ids", "duplicate_copies", "missing", "unexpected",
        ((F.col("missing") == 0) & (F.col("unexpected") == 0) & (F.col("duplicate_copies") == 0))
        .alias("exactly_once"))
    missing = joined.where(is_exp & ~arrived_col).select("src", "seq")
    unexpected = joined.where(arrived_col & ~is_exp).select("src", "seq")
    out["missing"] = missing
    out["unexpected"] = unexpected
    return out
