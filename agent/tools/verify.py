"""Exactly-once verification of a demo or chaos run: which record ids had to reach the sink, and
which did (docs/design.md, "exactly once").

Sources are seeded, so the verifier regenerates each source's records (`taxi.TaxiGenerator`),
passes them through the pipeline's map operators, and compares the ids that should reach the sink
with the ids the counting sinks recorded (`*.ids` files).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

from agent.config import PipelineConfig
from agent.operators.builtin import MapOperator, OperatorContext, load_operator, read_sink_ids
from agent.operators.taxi import TaxiGenerator

@dataclass(frozen=True)
class Verdict:
    generated: int
    expected: int  # ids that pass the pipeline's filters
    received: int
    lost: int
    duplicated: int
    unexpected: int  # ids at the sink that should have been filtered or were never generated
    lost_sample: Tuple[Tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.unexpected == 0


def source_counts(sink_dir: Path) -> Dict[str, int]:
    """Records generated per source instance, from the sources' `<instance>.source.json` files."""
    out: Dict[str, int] = {}
    for path in sorted(Path(sink_dir).glob("*.source.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[str(data.get("instance", path.name[: -len(".source.json")]))] = int(data.get("generated", 0))
    return out


def expected_ids(cfg: PipelineConfig, counts: Dict[str, int]) -> Dict[str, Set[int]]:
    """Ids that should reach the sink: regenerate each seeded source, apply the map operators."""
    src = cfg.operators[0]
    maps = []
    for op in cfg.operators[1:-1]:
        ctx = OperatorContext(instance="verifier", operator=op.name, node="verifier", kind=op.kind,
                              params=dict(op.params), state_dir=Path(tempfile.gettempdir()),
                              sink_dir=Path(tempfile.gettempdir()), restart=False)
        built = load_operator(op.function, ctx)
        if not isinstance(built, MapOperator):
            raise ValueError(f"verifier: operator {op.name} is not a per-record map")
        maps.append(built.fn)
    regenerate = src.function.endswith(":source") and src.function.startswith("agent.operators.taxi")
    out: Dict[str, Set[int]] = {}
    for instance, n in counts.items():
        if not regenerate:
            out[instance] = set(range(n))
            continue
        gen = TaxiGenerator(int(src.params.get("seed", 1)), instance)
        keep = set()
        for seq in range(n):
            rec: Any = gen.record()
            for fn in maps:
                rec = fn(rec)
                if rec is None:
                    break
            if rec is not None:
                keep.add(seq)
        out[instance] = keep
    return out


def verify(cfg: PipelineConfig, sink_dir: Path) -> Verdict:
    counts = source_counts(sink_dir)
    expected = expected_ids(cfg, counts)
    received, dup = read_sink_ids(sink_dir)
    lost: List[Tuple[str, int]] = []
    unexpected = 0
    for src, ids in expected.items():
        got = received.get(src, set())
        lost.extend((src, s) for s in sorted(ids - got))
        unexpected += len(got - ids)
    unexpected += sum(len(v) for k, v in received.items() if k not in expected)
    return Verdict(
        generated=sum(counts.values()),
        expected=sum(len(v) for v in expected.values()),
        received=sum(len(v) for v in received.values()),
        lost=len(lost),
        duplicated=dup,
        unexpected=unexpected,
        lost_sample=tuple(lost[:5]),
    )
