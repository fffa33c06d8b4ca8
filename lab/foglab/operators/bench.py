"""The benchmarks' source (`foglab.operators.bench:bench_source`): the taxi source
(agent.operators.taxi.TaxiSource, its rate profiles and flow control) with records that cost
nothing to make, so that a benchmark measures the data path and not the generator
(docs/measurement.md). `params.record`:

- "taxi" (default): taxi records from a pool generated once and cycled (the generator costs
  ~40 us per record here);
- "tiny": `{"v": 1}`;
- "keyed": `{"k": n mod keys, "t": n ms, "v": 1}` for keyed operators (`params.keys`, default 100),
  event times rising by 1 ms a record so that windows close as the stream goes on.

Every taxi source param but the `csv` profile: a benchmark's rate is a constant, steps or a
sinusoid, and the bench source opens no file (a node checks the paths only of its built-ins'
params, agent.operators.admission.PATH_PARAMS).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from agent.operators.builtin import OperatorContext, Param
from agent.operators.taxi import PROFILES, SOURCE_PARAMS, TaxiGenerator, TaxiSource, check_source_params

__all__ = ["BenchSource", "bench_source"]


class _TinyRecord:
    """Benchmark records: a small constant dict (measures the data path, not the generator)."""

    def __call__(self) -> Dict[str, Any]:
        return {"v": 1}


class _KeyedRecord:
    """Benchmark records for keyed operators: `{"k": n mod keys, "t": n ms, "v": 1}`, event times
    rising by 1 ms a record (windows close as the stream goes on)."""

    def __init__(self, keys: int) -> None:
        self.keys = keys
        self.n = 0

    def __call__(self) -> Dict[str, Any]:
        n = self.n
        self.n += 1
        return {"k": n % self.keys, "t": n, "v": 1}


class _Pool:
    """Benchmark taxi records: a pre-generated pool, cycled (the generator costs ~40 us per
    record here, which would measure the generator instead of the data path)."""

    def __init__(self, seed: int, stream: str, size: int = 1000) -> None:
        gen = TaxiGenerator(seed, stream)
        self.pool = [gen.record() for _ in range(size)]
        self.i = 0

    def __call__(self) -> Dict[str, Any]:
        self.i += 1
        return self.pool[self.i % len(self.pool)]

    def many(self, n: int) -> List[Dict[str, Any]]:
        """The next `n` records, as `n` calls would return them."""
        pool, size = self.pool, len(self.pool)
        out: List[Dict[str, Any]] = []
        while len(out) < n:
            start = (self.i + 1) % size
            take = min(n - len(out), size - start)
            out += pool[start:start + take]
            self.i += take
        return out


class BenchSource:
    """The factory a pipeline names as `foglab.operators.bench:bench_source`."""

    params_schema = dict({k: v for k, v in SOURCE_PARAMS.items() if k != "csv"},
                         profile=Param("string", choices=tuple(p for p in PROFILES if p != "csv")),
                         record=Param("string", choices=("taxi", "tiny", "keyed")), keys=Param("integer", min=1))

    @staticmethod
    def check_params(params: Dict[str, Any]) -> List[Tuple[str, str, Any]]:
        return check_source_params(params)

    @staticmethod
    def build(ctx: OperatorContext) -> TaxiSource:
        kind = ctx.params.get("record", "taxi")
        if kind == "taxi":
            return TaxiSource(ctx, record_factory=_Pool(int(ctx.params.get("seed", 1)), ctx.instance))
        if kind == "keyed":
            return TaxiSource(ctx, record_factory=_KeyedRecord(int(ctx.params.get("keys", 100))))
        return TaxiSource(ctx, record_factory=_TinyRecord())


bench_source = BenchSource
