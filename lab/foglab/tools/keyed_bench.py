"""`fog-agent bench keyed`: what keeping keyed state costs on the data path.

Three pipelines on one private broker, each `source -> X -> null sink`, the source keyed by "k"
(`bench_source` with `record = "keyed"`: `{"k": n mod keys, "t": n ms, "v": 1}`), as fast as flow
control lets it run, X in turn:
- `identity`: a stateless map (the baseline, same routing by key);
- `keyed_count`: a running count per key, one output per record (state and write-ahead outputs
  saved before every upstream ack);
- `tumbling_window`: a count per key per 1 s event-time window (few outputs, state saved as above).
Reported per pipeline: X's input records/s over `seconds` after a 1 s warm-up, its state saves
per second, and the size of its state file; the ratio of each keyed rate to the stateless one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional

from agent.mqtt.settings import BrokerSpec
from foglab.tools.dataplane_bench import LocalRunner, initial_specs, pipeline_toml

__all__ = ["run_keyed_bench", "register_bench"]

VARIANTS = {
    "stateless_map": ("agent.operators.builtin:identity", {}),
    "keyed_count": ("agent.operators.keyed:keyed_count", {}),
    "keyed_window": ("agent.operators.keyed:tumbling_window",
                     {"time_field": "t", "time_unit": "ms", "size_ms": 1000}),
}


def _measure(runner: LocalRunner, broker: Any, tmp: Path, name: str, function: str, params: Dict[str, Any],
             seconds: float, batch_size: int, keys: int) -> Dict[str, Any]:
    ops = [
        {"name": "source", "kind": "source", "function": "foglab.operators.bench:bench_source", "key": "k",
         "batch_size": batch_size, "params": {"profile": "constant", "rate": 5e6, "record": "keyed", "keys": keys}},
        {"name": "x", "function": function, "batch_size": batch_size, **({"params": params} if params else {})},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:null_sink", "batch_size": batch_size},
    ]
    toml = pipeline_toml(f"k{name.replace('_', '')}", ops, scaling={"policy": "none"})
    state = tmp / name
    specs = initial_specs(toml, BrokerSpec(broker.host, broker.port), str(state), cluster=name,
                          extra={"sink_dir": str(tmp / "sink")})
    # sink and x start together (a worker's start is seconds on a loaded Pi), the source once
    # both are subscribed
    procs = [runner.start(s, wait=False) for s in reversed(specs[1:])]
    for w in procs:
        if not w.ready.wait(runner.ready_timeout):
            raise TimeoutError(f"worker {w.instance} not ready after {runner.ready_timeout}s; see {w.log_path}")
    procs.append(runner.start(specs[0]))
    try:
        x = procs[1]  # procs: sink, x, source
        time.sleep(1.0)
        a, t0 = dict(x.stats), time.monotonic()
        time.sleep(seconds)
        b, t1 = dict(x.stats), time.monotonic()
        dt = t1 - t0
        path = state / "x-0.keyed.json"
        out = {
            "records_per_s": round((b.get("records_in", 0) - a.get("records_in", 0)) / dt, 1),
            "outputs_per_s": round((b.get("records_out", 0) - a.get("records_out", 0)) / dt, 1),
            "state_saves_per_s": round((b.get("state_saves", 0) - a.get("state_saves", 0)) / dt, 1),
            "state_file_bytes": path.stat().st_size if path.exists() else 0,
            "keys_held": b.get("keys_held"),
        }
    finally:
        # Source first, sink last: each drains into a successor that still acks (all at once, the
        # sink left first and the others waited out their drain timeout).
        for w in reversed(procs):
            w.send("stop")
            w.stop(15.0)
    return out


def run_keyed_bench(seconds: float = 5.0, batch_size: int = 100, keys: int = 100,
                    workdir: Optional[str] = None) -> Dict[str, Any]:
    from foglab.tools.broker import start_private_broker

    tmp = Path(workdir or tempfile.mkdtemp(prefix="fog-keyed-bench-"))
    broker = start_private_broker(tmp / "broker")
    runner = LocalRunner(tmp)
    res: Dict[str, Any] = {"seconds": seconds, "batch_size": batch_size, "keys": keys}
    try:
        for name, (function, params) in VARIANTS.items():
            print(f"bench keyed: {name} ({seconds:g} s)", file=sys.stderr, flush=True)
            res[name] = _measure(runner, broker, tmp, name, function, params, seconds, batch_size, keys)
    finally:
        runner.stop_all()
        broker.stop()
    base = res["stateless_map"]["records_per_s"]
    for name in ("keyed_count", "keyed_window"):
        res[name]["ratio_vs_stateless"] = round(res[name]["records_per_s"] / base, 3) if base else None
    return res


def _cmd(args: argparse.Namespace) -> int:
    res = run_keyed_bench(args.seconds, args.batch_size, args.keys)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    print(f"batch size {res['batch_size']}, {res['keys']} keys, {res['seconds']:g} s per pipeline")
    for name in VARIANTS:
        r = res[name]
        ratio = f"  ({r['ratio_vs_stateless']:.2f} of stateless)" if "ratio_vs_stateless" in r else ""
        print(f"{name:14s} {r['records_per_s']:10.0f} records/s in, {r['state_saves_per_s']:6.0f} saves/s, "
              f"state file {r['state_file_bytes']} B{ratio}")
    return 0


def register_bench(groups: Any) -> None:
    p = groups.bench.add_parser("keyed", help="throughput of keyed stateful operators vs a stateless map")
    p.add_argument("--seconds", type=float, default=5.0, help="measurement time of each pipeline")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--keys", type=int, default=100, help="distinct keys in the stream")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress on stderr)")
    p.set_defaults(func=_cmd)
