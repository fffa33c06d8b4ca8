"""`fog-agent simulate gme` and `fog-agent bench gme`: 2-FGME vs Joung's RA1/RA2."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict

ALGORITHMS = ("2fgme", "ra1", "ra2")


def register(groups: Any) -> None:
    p = groups.simulate.add_parser("gme", help="discrete-event simulation of 2-FGME / RA1 / RA2")
    _common(p, entries=10, think=1000.0, cs=1000.0)
    p.add_argument("--delay-ms", type=float, default=1.0, help="mean one-way link delay (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="FILE.png", help="figure 5.2 style occupancy plot")
    p.set_defaults(func=run_simulate)

    b = groups.bench.add_parser("gme", help="2-FGME / RA1 / RA2 through a real Mosquitto broker")
    _common(b, entries=25, think=50.0, cs=50.0)
    b.add_argument("--broker", default="127.0.0.1:1883", help="HOST:PORT of Mosquitto")
    b.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    b.set_defaults(func=run_bench)


def _common(p: argparse.ArgumentParser, entries: int, think: float, cs: float) -> None:
    p.add_argument("--algorithm", choices=ALGORITHMS, default="2fgme")
    p.add_argument("--nodes", type=int, default=12, help="total nodes, split in two equal groups")
    p.add_argument("--entries", type=int, default=entries, help="CS entries per node")
    p.add_argument("--think-ms", type=float, default=think, help="P: think time between requests")
    p.add_argument("--cs-ms", type=float, default=cs, help="inCS: time spent in the CS")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _print(report: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        print()
        return
    for k, v in report.items():
        print(f"{k:22s} {v}")


def run_simulate(args: argparse.Namespace) -> int:
    from agent.sim.gme_sim import GmeSimConfig, plot, simulate

    cfg = GmeSimConfig(
        algorithm=args.algorithm, nodes=args.nodes, entries=args.entries,
        think_ms=args.think_ms, cs_ms=args.cs_ms, delay_ms=args.delay_ms, seed=args.seed,
    )
    res = simulate(cfg)
    _print(res.summary(), args.json)
    if args.plot:
        plot(res, args.plot)
    return 0 if res.safety_violations == 0 and res.unserved_requests == 0 else 1


def run_bench(args: argparse.Namespace) -> int:
    from agent.runtime.gme_bench import BenchConfig, run_bench as bench

    host, _, port = args.broker.rpartition(":")
    report = bench(BenchConfig(
        algorithm=args.algorithm, nodes=args.nodes, entries=args.entries,
        think_ms=args.think_ms, cs_ms=args.cs_ms, host=host or "127.0.0.1", port=int(port),
        timeout_s=args.timeout,
    ))
    _print(report, args.json)
    ok = not report["errors"] and report["safety_violations"] == 0 and report["unserved_requests"] == 0
    return 0 if ok else 1
