"""The stateful chaos verdict (foglab.tools.verify.verify_windows): the keyed window's outputs at the
sink against the fault-free reference regenerated from the seeded source. Here the "sink" is
written by hand from that reference, so that each kind of difference is known to be caught."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from agent.config import load_pipeline_text
from foglab.tools.chaos import chaos_pipeline
from foglab.tools.verify import expected_outputs, verify_windows

N = 1500


def pipeline() -> Any:
    return load_pipeline_text(chaos_pipeline(30.0, 4, pipeline="stateful"), "chaos pipeline")


@functools.lru_cache(maxsize=1)
def reference() -> Dict[Tuple[str, int], Any]:
    return expected_outputs(pipeline(), {"chaos.source.0": N})


def write_sink(tmp: Path, outputs: Dict[Tuple[str, int], Any], twice: Optional[Tuple[str, int]] = None) -> Tuple[Path, Path]:
    sink, landing = tmp / "sink", tmp / "landing" / "kind=batches" / "date=2026-11-26" / "node=n1"
    sink.mkdir()
    landing.mkdir(parents=True)
    (sink / "chaos.source.0.source.json").write_text(json.dumps({"instance": "chaos.source.0", "generated": N}))
    ids = sorted(outputs)
    (sink / "chaos.sink.0.ids").write_text("".join(f"{s} {q}\n" for s, q in ids))
    if twice is not None:
        (sink / "chaos.sink.1.ids").write_text(f"{twice[0]} {twice[1]}\n")
    keys = ["key", "start", "end", "count", "sum"]
    lines = [json.dumps({"k": keys, "r": [[s, q, [outputs[(s, q)][k] for k in keys]] for s, q in ids[i:i + 50]]})
             for i in range(0, len(ids), 50)]
    (landing / "batches+n1+0.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    return sink, tmp / "landing"


def test_the_reference_itself_is_windows_per_cell_over_the_filtered_records() -> None:
    want = reference()
    assert len(want) > 300  # ~1500 s of pickup time: 2 closed windows of hundreds of cells
    rows = list(want.values())
    assert all(r["end"] - r["start"] == 600_000 for r in rows)
    # every record that passes validate and in_zone is in exactly one window (except the open ones)
    assert 0.5 * N < sum(r["count"] for r in rows) < N
    assert len({s for s, _ in want}) == len({r["key"] for r in rows})  # one id source per cell


def test_equal_windows_pass_and_each_kind_of_difference_is_counted(tmp_path: Path) -> None:
    cfg = pipeline()
    want = reference()
    (tmp_path / "a").mkdir()
    sink, landing = write_sink(tmp_path / "a", want)
    v = verify_windows(cfg, sink, landing)
    assert v.ok and v.expected == v.received == len(want), v

    ids = sorted(want)
    changed = dict(want)
    del changed[ids[0]]  # a window lost
    changed[ids[1]] = dict(want[ids[1]], sum=want[ids[1]]["sum"] + 0.01)  # a window with other content
    changed[("chaos.cells#0000", 1)] = dict(want[ids[2]])  # a window the reference does not have
    (tmp_path / "b").mkdir()
    sink, landing = write_sink(tmp_path / "b", changed, twice=ids[3])
    v = verify_windows(cfg, sink, landing)
    assert not v.ok
    assert (v.missing, v.extra, v.differing, v.duplicated, v.unread) == (1, 1, 1, 1, 0), v
    assert any(s.startswith("differs") for s in v.samples), v.samples
