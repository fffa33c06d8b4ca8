"""`make demo`'s analytics step: what the demo produced -> spool -> landing zone -> Spark report.

`agent.runtime.demo.run_demo` imports this module and calls the hook registered here with its
work directory and summary. If the demo's agents spilled (spool directories with `closed/` under
the work directory), those files are used as they are. Otherwise the hook spills, through the
same `Spool`, what the demo left on disk:

- "records": every id the counting sinks recorded, with its DEBS 2015 fields regenerated from the
  seeded source (`taxi.TaxiGenerator(seed, source instance)`; the i-th record of a source is the
  one with sequence number i), so the DEBS queries run on exactly the records that reached the sink;
- "generated": the ids that had to reach the sink (`demo.expected_ids`: sources regenerated and
  passed through the pipeline's filters), for the exactly-once accounting;
- "metrics": per-operator demand (ceil(input rate / capacity)) and supply (instances) per sample;
- "events": the scale-out / scale-in counts and the protocol message total of the summary.

Then `run_demo_analytics` lands the spool and runs the job in local mode.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

__all__ = ["demo_hook", "spill_demo_outputs"]


def _spool_dirs(workdir: Path) -> List[Path]:
    return sorted(p.parent for p in workdir.rglob("closed") if p.is_dir() and (p.parent / "open").is_dir())


def spill_demo_outputs(workdir: Path, summary: Dict[str, Any], pipeline_path: Optional[Path] = None) -> Path:
    """Write a spool under `<workdir>/analytics-spool` from the demo's artefacts; returns its dir."""
    from agent.config import load_pipeline
    from agent.runtime import demo as rdemo
    from agent.runtime.operators import read_sink_ids
    from agent.runtime.spool import Spool
    from agent.runtime.taxi import TaxiGenerator

    cfg = load_pipeline(pipeline_path or rdemo.DEFAULT_PIPELINE)
    sink_dir = workdir / "sink"
    spool = Spool(workdir / "analytics-spool", "demo", rotate_bytes=2 << 20, background=True)
    counts = rdemo.source_counts(sink_dir)
    received, _dup = read_sink_ids(sink_dir)
    seed = int(cfg.operators[0].params.get("seed", 1))
    for src, n in counts.items():
        got = received.get(src, set())
        gen = TaxiGenerator(seed, src)
        batch = []
        for seq in range(n):
            rec = gen.record()
            if seq in got:
                batch.append(dict(rec, src=src, seq=seq))
            if len(batch) >= 1000:
                _put(spool, "records", batch)
                batch = []
        _put(spool, "records", batch)
    for src, ids in rdemo.expected_ids(cfg, counts).items():
        _put(spool, "generated", [{"src": src, "seq": s} for s in sorted(ids)])
    rows = []
    for s in summary.get("samples", []):
        for op in [o.name for o in cfg.operators[1:]]:
            cap = cfg.scaling_for(op).capacity
            cap = float(cap) if not isinstance(cap, str) else 500.0
            demand = max(1, math.ceil(float(s.get("input_rate", 0.0)) / cap))
            rows.append({"ts": s["t"], "operator": op, "demand": demand,
                         "supply": int(s.get("instances", {}).get(op, 0))})
    _put(spool, "metrics", rows)
    _put(spool, "events", [{"event": "scale_out", "count": int(summary.get("scale_outs", 0))},
                           {"event": "scale_in", "count": int(summary.get("scale_ins", 0))},
                           {"event": "protocol_message", "count": int(summary.get("protocol_messages", 0))}])
    spool.close()
    return spool.dir


def _put(spool: Any, kind: str, records: Sequence[Dict[str, Any]]) -> None:
    if not records:
        return
    done = 0
    while done < len(records):  # back pressure: wait, never drop
        done += spool.append_many(kind, records[done:])
        if done < len(records):
            spool.wait_writable(1.0)


def demo_hook(workdir: Path, summary: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    from agent.analytics.job import run_demo_analytics

    dirs: Union[List[Path], Path] = _spool_dirs(workdir) or [spill_demo_outputs(workdir, summary)]
    report = run_demo_analytics(dirs, workdir)
    print(f"analytics report: {report}")
    return {"report": str(report)}


try:  # register with the demo when it imports us
    from agent.runtime.demo import ANALYTICS_HOOKS

    if demo_hook not in ANALYTICS_HOOKS:
        ANALYTICS_HOOKS.append(demo_hook)
except ImportError:  # pragma: no cover - runtime area absent
    pass
