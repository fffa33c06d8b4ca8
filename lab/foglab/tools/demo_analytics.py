"""`make demo`'s analytics step: what the agents REALLY spilled -> landing zone -> Spark report.

`foglab.tools.demo.run_demo` runs its agents with `[spill]` on (`Fleet(spill=True)`): every
counting sink spools the records that reach it (kind "batches": each batch as it arrived, with its
record ids), every agent spools its per-instance metrics and its events, and each agent's path
shipper lands closed files in `<workdir>/landing` (the same verified, exactly-once landing as the
collector's); a clean agent stop closes the spools and ships the rest. Nothing is rebuilt from the
demo's output.

The one thing added here is the accounting's reference, kind "generated": the ids that had to
reach the sink, as the demo's verifier computes them (`foglab.tools.verify.expected_ids`: sources regenerated
and passed through the pipeline's filters, which drop records on purpose). Then the job runs in
local mode and the hook reports the report's path and the accounting row (`exactly_once`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Dict, Optional

__all__ = ["analyse", "spill_expected_ids", "edge_vs_batch"]


def spill_expected_ids(workdir: Path, landing: Path, pipeline_path: Path) -> int:
    """Spool the verifier's expected ids as kind "generated" and land them; returns the count."""
    from agent.analytics.job import land_spools
    from agent.config import load_pipeline
    from foglab.tools.verify import expected_ids, source_counts
    from agent.spill.spool import Spool

    cfg = load_pipeline(pipeline_path)
    counts = source_counts(workdir / "sink")
    spool = Spool(workdir / "verifier-spool", "verifier", rotate_bytes=2 << 20)
    n = 0
    for src, ids in expected_ids(cfg, counts).items():
        rows = [{"src": src, "seq": s} for s in sorted(ids)]
        if rows and spool.append_many("generated", rows) != len(rows):
            raise RuntimeError("verifier spool full")  # a fresh spool with the default 512 MiB cap
        n += len(rows)
    spool.close()
    land_spools([spool.dir], landing)
    return n


def _accounting(report: Path) -> Dict[str, Any]:
    """The accounting row of report.md (the job already collected it for the report)."""
    lines = report.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| generated |") and i + 2 < len(lines):
            keys = [k.strip() for k in line.strip("|").split("|")]
            vals = [v.strip() for v in lines[i + 2].strip("|").split("|")]
            return {k: (int(v) if re.fullmatch(r"-?\d+", v) else v) for k, v in zip(keys, vals)}
    return {}


def edge_vs_batch(landing: Path, out: Path) -> Dict[str, Dict[str, Any]]:
    """The DEBS queries as the edge computed them (the windows the sink spilled: ids
    "<operator>#...", rows with "top" for query 1, with "areas" for query 2) against the batch
    job's answers in `out` (top_routes.json, profitable_areas.json), window by window
    (agent.analytics.debs_compare): {"debs_edge_vs_batch": query 1,
    "debs_q2_edge_vs_batch": query 2}, a query the pipeline does not compute left out."""
    import json

    from agent.analytics.debs_compare import compare_profitable_areas, compare_top_routes
    from foglab.tools.verify import landed_records

    rows = [r for (src, _), r in landed_records(landing).items() if "#" in src and isinstance(r, dict) and "start" in r]
    res = {}
    for name, field, batch_json, compare in (
            ("debs_edge_vs_batch", "top", "top_routes.json", compare_top_routes),
            ("debs_q2_edge_vs_batch", "areas", "profitable_areas.json", compare_profitable_areas)):
        edge = [r for r in rows if field in r]
        if not edge or not (out / batch_json).exists():
            continue
        cmp = compare(edge, json.loads((out / batch_json).read_text()))
        cmp["equal_all"] = not cmp["differences"]
        cmp["differing"] = len(cmp["differences"])
        cmp["differences"] = cmp["differences"][:20]  # the first 20 (each with both lists) in the summary
        res[name] = cmp
    return res


def analyse(workdir: Path, pipeline_path: Path) -> Optional[Dict[str, Any]]:
    """The step itself: the verifier's expected ids spooled and landed, the job run, its report's
    accounting row returned (merged by the demo under summary[\"analytics\"])."""
    import time

    from agent.analytics.job import run_demo_analytics

    landing = Path(workdir) / "landing"
    if not any(landing.glob("kind=batches/*/*/*.gz")) and not any(landing.glob("kind=records/*/*/*.gz")):
        return {"error": f"no spilled sink records landed in {landing}"}
    t0 = time.monotonic()
    expected = spill_expected_ids(Path(workdir), landing, pipeline_path)
    report = run_demo_analytics(landing, workdir)
    acc = _accounting(report)
    print(f"analytics report: {report}", file=sys.stderr)  # stdout may be `demo --json`
    return {"report": str(report), "accounting": acc, "expected_ids": expected,
            **edge_vs_batch(landing, report.parent),
            "landed_files": sum(1 for _ in landing.glob("kind=*/*/*/*.gz")),
            "analytics_s": round(time.monotonic() - t0, 1)}
