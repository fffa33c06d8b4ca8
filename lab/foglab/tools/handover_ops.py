"""The operators of `fog-agent bench handover --live` (foglab.tools.handover_live): a source, a keyed
count with a padded state, its stateless twin and a sink that stamps arrival times.

Only the bench's local fleet runs them: its agents list this module in `[operators] modules`
(agent.operators.admission), so a fog node never admits it. Records and outputs carry what the
bench needs to tell moving keys from the others and to measure latency without a clock in the
operators: the source stamps `t0` (wall time at generation; the fleet shares one machine and one
clock), the operators name the instance that processed the record (`i`), the sink appends one
line per new output with its arrival time.

Stream (`HandoverSource`, deterministic by sequence number `s`, so the verifier regenerates it):
the first `cold_keys` records are one per cold key ("c0", "c1", ...) carrying `pad` bytes that
the keyed count keeps in that key's state (the instance's state to move: cold_keys x pad); then
`hot_keys` keys ("h0", ...) in turn, no pad: the load that flows while the groups move.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

from agent.dataplane.envelope import Item
from agent.operators.builtin import CountingSink, MapOperator, Operator, OperatorContext, Param
from agent.operators.keyed import KeyedOperator
from agent.operators.taxi import SOURCE_PARAMS, TaxiSource, check_source_params

__all__ = ["HandoverSource", "PaddedCount", "StatelessTag", "StampingSink", "stream_key", "MAX_PAD", "LAT_SUFFIX"]

MAX_PAD = 1 << 20  # bytes of padding one key may hold (a record's `pad` is bounded before use)
LAT_SUFFIX = ".lat"  # <sink_dir>/<sink instance>.lat: "key n s t0 instance arrival" per new output


def stream_key(seq: int, cold_keys: int, hot_keys: int) -> str:
    """The key of record `seq` of the stream (the source's and the verifier's one definition)."""
    return f"c{seq}" if seq < cold_keys else f"h{(seq - cold_keys) % hot_keys}"


class _Records:
    """The record factory of `HandoverSource`: `make()` is called once per sequence number, in
    order (also to wind forward after a restart), so `n` is the record's `s`."""

    def __init__(self, cold_keys: int, hot_keys: int, pad: int) -> None:
        self.cold, self.hot, self.pad = cold_keys, hot_keys, pad
        self.n = 0

    def __call__(self) -> Dict[str, Any]:
        n = self.n
        self.n += 1
        rec: Dict[str, Any] = {"k": stream_key(n, self.cold, self.hot), "s": n, "t0": time.time()}
        if n < self.cold and self.pad:
            rec["pad"] = self.pad
        return rec


class HandoverSource:
    """The taxi source's rate profile and flow control (agent.operators.taxi.TaxiSource) over the
    bench's stream (module docstring)."""

    params_schema = dict(SOURCE_PARAMS, cold_keys=Param("integer", min=0), hot_keys=Param("integer", min=1),
                         pad=Param("integer", min=0, max=MAX_PAD))
    check_params = staticmethod(check_source_params)

    @classmethod
    def build(cls, ctx: OperatorContext) -> TaxiSource:
        p = ctx.params
        return TaxiSource(ctx, record_factory=_Records(int(p.get("cold_keys", 0)), int(p.get("hot_keys", 64)),
                                                       int(p.get("pad", 0))))


def _pad_of(rec: Any) -> int:
    v = rec.get("pad") if isinstance(rec, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_PAD else 0


class PaddedCount(KeyedOperator):
    """A running count per key, one output per record; a record with `pad` makes its key's state
    hold that many bytes more (the state a hand-over moves). Output: the key, its count so far,
    the record's `s` and `t0`, and this instance (`i`)."""

    params_schema: Dict[str, Param] = {}

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        n, pad = state if state is not None else (0, "")
        out = []
        for rec in records:
            n += 1
            size = _pad_of(rec)
            if size:
                pad = "x" * size
            out.append({"k": key, "n": n, "s": rec.get("s"), "t0": rec.get("t0"), "i": self.ctx.instance})
        return out, [n, pad]


class StatelessTag:
    """The baseline: the same output without state (`n` is absent), the same routing by key and the
    same `service_time_ms` in the pipeline; a copy takes its groups at once (no hand-over)."""

    params_schema: Dict[str, Param] = {}

    @classmethod
    def build(cls, ctx: OperatorContext) -> Operator:
        me = ctx.instance

        def tag(rec: Any) -> Any:
            return {"k": rec.get("k"), "s": rec.get("s"), "t0": rec.get("t0"), "i": me}

        return MapOperator(tag, passes=False)


class _Stamping(CountingSink):
    """The counting sink (ids, duplicates dropped by id) that also appends, for each new output, its
    key, count, sequence number, `t0`, instance and arrival wall time to `<instance>.lat`."""

    reads_records = True

    def __init__(self, ctx: OperatorContext) -> None:
        super().__init__(ctx)
        self._lat = open(ctx.sink_dir / f"{ctx.instance}{LAT_SUFFIX}", "a", buffering=1 << 16)

    def _new_ids(self, items: List[Item]) -> Tuple[List[Item], List[str]]:
        fresh, lines = super()._new_ids(items)
        now = time.time()
        rows = []
        for _src, _seq, rec in fresh:
            r = rec if isinstance(rec, dict) else {}
            rows.append(f"{r.get('k')} {r.get('n', 0)} {r.get('s')} {r.get('t0')} {r.get('i')} {now:.6f}\n")
        self._lat.write("".join(rows))
        self._lat.flush()
        return fresh, lines

    def close(self) -> None:
        super().close()
        self._lat.close()


class StampingSink:
    """Factory of the stamping sink (a class defined here: the allow-list's "defined in")."""

    params_schema: Dict[str, Param] = {}

    @classmethod
    def build(cls, ctx: OperatorContext) -> Operator:
        return _Stamping(ctx)


def read_lat(path: Any) -> List[Tuple[str, int, int, float, str, float]]:
    """The lines of one `.lat` file: (key, n, s, t0, instance, arrival)."""
    out = []
    with open(path) as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 6:
                out.append((parts[0], int(parts[1]), int(parts[2]), float(parts[3]), parts[4], float(parts[5])))
    return out

