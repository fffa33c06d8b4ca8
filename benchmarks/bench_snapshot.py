"""CPU of a keyed state's full snapshot (`KeyedState.save`, written in pieces) against encoding the
whole document at once with json.dumps and writing it (how it was written before), alternated in
one process. The state: 3,000 records over 400 keys of a tumbling window, and 3,000 outputs not
yet acked (about 0.96 MB of JSON).

Run: `python benchmarks/bench_snapshot.py [--rounds 3] [--saves 20]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from agent.files import write_atomic  # noqa: E402
from agent.operators.keyed import tumbling_window  # noqa: E402
from test_keyed_state import state_of, stream  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--saves", type=int, default=20)
    args = ap.parse_args()
    ks = state_of(tumbling_window, time_field="t", size_ms=5000)
    ks.apply("p", stream(3000, 7, keys=400), 1)
    ks.outputs += [(i, ["src", i, {"k": f"k{i % 40}", "pad": "x" * 200, "v": None, "f": 0.1 * i}])
                   for i in range(2, 3000)]
    path = Path(tempfile.mkdtemp()) / "k.keyed.json"

    def whole() -> None:
        doc = {"format": 2, "gen": ks._gen, "operator": ks.operator, "key_groups": ks.groups,
               "applied": {s: a.to_json() for s, a in ks.applied.items()}, "max_time": ks.max_time,
               "outputs": [it for _, it in ks.outputs],
               "groups": {str(g): ks._group_json(g) for g in sorted(set(ks.states) | set(ks.emitted) | set(ks.floors))}}
        write_atomic(path, json.dumps(doc, separators=(",", ":")))

    def pieces() -> None:
        ks._full_next = True
        ks.save(path)

    for _ in range(args.rounds):
        for name, f in (("whole", whole), ("pieces", pieces)):
            t = time.process_time()
            for _ in range(args.saves):
                f()
            ms = (time.process_time() - t) / args.saves * 1000
            print(f"{name:7} {ms:6.2f} ms CPU per snapshot of {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
