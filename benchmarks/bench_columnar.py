"""Issue 26 item 3's last cut, measured before it is built: a columnar data batch for the MQTT hops.

The source -> chain of 2 hop spends, besides paho and the broker, the source's encode of each
batch and the chain head's decode (parse, validate, rebuild 100 dict records). Today's compact
body is row-wise: `{"k": [keys], "r": [[source, seq, [values]], ...]}`. The columnar body
sends each field as one list: `{"k": [keys], "s": [sources], "q": [seqs], "c": [[values of key
0], [values of key 1], ...]}`: fewer JSON arrays (17 + 3 instead of 100 + 200 for a taxi
batch) and checks per column instead of per row; the records are still rebuilt into dicts
(`dict(zip(keys, row)) for row in zip(*columns)`), since the map reads them.

Both codecs validate what they decode as hostile (every id a string and an integer >= 0, every
column as long as the batch). They take turns in short slices in one process (as
bench_cuts.py), CPU time per batch of encode + decode, the median over rounds and the per-round
ratio. The payloads are checked to decode to the same items.

Run: `python benchmarks/bench_columnar.py [--rounds 10] [--reps 300] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

from agent.dataplane.envelope import Item, MalformedEnvelope, _fast_dumps, _parse, decode, encode_data
from foglab.operators.bench import _Pool


def encode_columnar(sender: str, epoch: int, seq: int, items: List[Item]) -> bytes:
    keys = tuple(items[0][2])
    rows = []
    for it in items:
        rec = it[2]
        if type(rec) is not dict or tuple(rec) != keys:
            raise ValueError("not one schema")  # the row form's fallback, not measured here
        rows.append(list(rec.values()))
    body = {"k": keys, "s": [it[0] for it in items], "q": [it[1] for it in items], "c": [list(c) for c in zip(*rows)]}
    return _fast_dumps([1, sender, epoch, seq, "d", body])


def decode_columnar(raw: bytes) -> List[Item]:
    msg = _parse(raw)
    if type(msg) is not list or len(msg) != 6 or type(msg[5]) is not dict:
        raise MalformedEnvelope("envelope")
    body = msg[5]
    keys, srcs, seqs, cols = body.get("k"), body.get("s"), body.get("q"), body.get("c")
    if (len(body) != 4 or type(keys) is not list or type(srcs) is not list or type(seqs) is not list
            or type(cols) is not list or len(cols) != len(keys) or len(seqs) != len(srcs)):
        raise MalformedEnvelope("columnar body")
    n = len(srcs)
    if (not all(type(k) is str for k in keys) or not all(type(s) is str for s in srcs)
            or not all(type(q) is int and q >= 0 for q in seqs)
            or not all(type(c) is list and len(c) == n for c in cols)):
        raise MalformedEnvelope("columnar body")
    return list(zip(srcs, seqs, [dict(zip(keys, row)) for row in zip(*cols)]))


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=300, help="batches per variant per round")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    items = [("source-0", i, r) for i, r in enumerate(_Pool(1, "source-0").many(100))]
    rows = encode_data("source-0", 0, 1, items)
    cols = encode_columnar("source-0", 0, 1, items)
    assert decode(rows).body == decode_columnar(cols) == items

    variants: Dict[str, Callable[[], Any]] = {
        "rows": lambda: decode(encode_data("source-0", 0, 1, items)),
        "columns": lambda: decode_columnar(encode_columnar("source-0", 0, 1, items)),
        "rows_decode": lambda: decode(rows),
        "columns_decode": lambda: decode_columnar(cols),
    }
    per: Dict[str, List[float]] = {n: [] for n in variants}
    for r in range(a.rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            f = variants[name]
            c0 = time.process_time()
            for _ in range(a.reps):
                f()
            per[name].append((time.process_time() - c0) / a.reps)
    out: Dict[str, Any] = {
        "cpu_ms_per_batch": {n: round(1000 * statistics.median(v), 4) for n, v in per.items()},
        "ratio_columns_to_rows": round(statistics.median(c / r for c, r in zip(per["columns"], per["rows"])), 3),
        "ratio_decode": round(statistics.median(c / r for c, r in zip(per["columns_decode"], per["rows_decode"])), 3),
        "payload_bytes": {"rows": len(rows), "columns": len(cols)},
        "rounds": a.rounds, "reps": a.reps,
    }
    if a.json:
        print(json.dumps(out))
    else:
        c = out["cpu_ms_per_batch"]
        print(f"encode + decode of a 100-record taxi batch: rows {c['rows']:.4f} ms, columns {c['columns']:.4f} ms, "
              f"x{out['ratio_columns_to_rows']:.3f}")
        print(f"decode alone: rows {c['rows_decode']:.4f} ms, columns {c['columns_decode']:.4f} ms, "
              f"x{out['ratio_decode']:.3f}; payload {len(rows)} -> {len(cols)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
