"""What the standby copy of keyed state costs (agent.node.replicas), against the save alone, in the
same run, the variants alternated round by round so the machine's load falls on both alike.

One process: a keyed 1-second tumbling window (`agent.operators.keyed:tumbling_window`) applies
batches of `--batch` records over `--keys` keys and saves after each batch, as a worker does:

    save     KeyedState.save (the snapshot now and then, else one log line)
    standby  the save, then what the host agent and the standby agent do for it: read the files
             (`open_saved`), build the request (`Shipper.requests`), encode it as on the wire,
             decode and append it (`ReplicaStore.apply`), and take the reply (`Shipper.answered`)

Per variant: the median CPU per save and per record; for `standby`, the bytes on the wire per
record and per save, and the median ratio of its CPU to the save alone. The broker hop itself
(one request and one reply per save, batched while one is in flight) is not in these figures.

Run: `python benchmarks/bench_standby.py [--rounds 8] [--saves 300] [--batch 100] [--keys 1000] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from agent.instance.keyed_state import KeyedState
from agent.node.replicas import ReplicaStore, Shipper, open_saved
from agent.operators import OperatorContext
from agent.operators.keyed import tumbling_window


def _window() -> KeyedState:
    op = tumbling_window(OperatorContext("win-a", "win", "n1", "map",
                                         params={"time_field": "t", "time_unit": "ms", "size_ms": 1000}))
    return KeyedState(op, "win", "k", 128)


def _run(variant: str, root: Path, saves: int, batch: int, keys: int, start: int) -> Dict[str, float]:
    ks = _window()
    path = root / "host" / "win-a.keyed.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    store, sh = ReplicaStore(root / "standby"), Shipper("win-a", standby="s")
    wire = 0
    t0 = time.process_time()
    n = start
    for i in range(saves):
        ks.apply("src", [("src", j, {"k": j % keys, "t": j * 10, "v": 1}) for j in range(n, n + batch)], i)
        n += batch
        ks.save(path)
        if variant == "standby":
            saved = open_saved(path)
            assert saved is not None
            reply = None
            with saved:
                bodies = sh.requests(saved, float(i))
            for body in bodies:
                payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                wire += len(payload)
                reply = store.apply("host", json.loads(payload))
            if reply is not None:
                sh.answered(reply, float(i))
    cpu = time.process_time() - t0
    return {"cpu_per_save_us": cpu / saves * 1e6, "cpu_per_record_us": cpu / (saves * batch) * 1e6,
            "wire_bytes_per_save": wire / saves, "wire_bytes_per_record": wire / (saves * batch)}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--saves", type=int, default=300)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    runs: Dict[str, List[Dict[str, float]]] = {"save": [], "standby": []}
    ratios: List[float] = []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            got = {v: _run(v, Path(tmp) / v, a.saves, a.batch, a.keys, r * a.saves * a.batch) for v in ("save", "standby")}
        for v, m in got.items():
            runs[v].append(m)
        ratios.append(got["standby"]["cpu_per_save_us"] / got["save"]["cpu_per_save_us"])
        print(f"round {r + 1}/{a.rounds}: save {got['save']['cpu_per_save_us']:.0f} us, "
              f"standby {got['standby']['cpu_per_save_us']:.0f} us per save", file=sys.stderr)
    out: Dict[str, Any] = {v: {k: round(statistics.median(m[k] for m in ms), 2) for k in ms[0]} for v, ms in runs.items()}
    out["standby_over_save"] = round(statistics.median(ratios), 3)
    out["params"] = vars(a)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for v in ("save", "standby"):
            m = out[v]
            print(f"{v:8s} {m['cpu_per_save_us']:8.0f} us/save {m['cpu_per_record_us']:6.2f} us/record "
                  f"{m['wire_bytes_per_record']:7.1f} B/record on the wire")
        print(f"standby / save (CPU, median of rounds): {out['standby_over_save']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
