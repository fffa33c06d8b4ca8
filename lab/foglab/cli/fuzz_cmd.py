"""`fog-agent bench fuzz`: hostile-input fuzzing of the decoder, the channel and every protocol core.

Why a bench and not only a test: the issue asks for at least 100,000 inputs per run, which is
too long for the test suite on a shared 2-core machine; the tests run the same targets with a
small budget (tests/test_fuzz_hostile_input.py). Exit status 1 when any input crashed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def register(groups: Any) -> None:
    b = groups.bench.add_parser("fuzz", help="fuzz the inbox decoder, channel and protocol cores with hostile input")
    b.add_argument("--inputs", type=int, default=100_000, help="total inputs, split over the targets (default 100000)")
    b.add_argument("--each", type=int, default=None, metavar="N",
                   help="N inputs for every selected target (overrides --inputs)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--target", action="append", default=None, metavar="NAME",
                   help="only this target (repeatable); default: all")
    b.add_argument("--hang-seconds", type=float, default=5.0, help="an input running longer is a hang (a crash)")
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    b.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from foglab.sim.fuzz import TARGETS, TargetStats, run_all

    targets = tuple(args.target or TARGETS)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        print(f"unknown target(s) {unknown}; expected some of {list(TARGETS)}", file=sys.stderr)
        return 2

    def progress(s: TargetStats) -> None:
        print(f"  {s.target}: {s.inputs} inputs, {s.crashes} crashes, {s.rate:,.0f}/s", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    total_inputs = args.each * len(targets) if args.each else args.inputs
    results = run_all(total_inputs, args.seed, targets=targets, hang_seconds=args.hang_seconds,
                      progress=progress if not args.json else None)
    total = time.perf_counter() - t0
    inputs = sum(r.inputs for r in results)
    crashes = sum(r.crashes for r in results)
    if args.json:
        json.dump({"seed": args.seed, "inputs": inputs, "crashes": crashes, "seconds": round(total, 2),
                   "inputs_per_s": round(inputs / total, 1) if total else 0.0,
                   "targets": [r.to_dict() for r in results]}, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        print(f"{'target':14s} {'inputs':>8s} {'accepted':>9s} {'rejected':>9s} {'crashes':>8s} {'inputs/s':>9s}")
        for r in results:
            print(f"{r.target:14s} {r.inputs:8d} {r.accepted:9d} {r.rejected:9d} {r.crashes:8d} {r.rate:9,.0f}")
        print(f"{'total':14s} {inputs:8d} {'':9s} {'':9s} {crashes:8d} {inputs / total if total else 0:9,.0f}"
              f"   ({total:.1f} s, seed {args.seed})")
        for r in results:
            for f in r.failures:
                print(f"\n{f.kind} in {f.target} input #{f.index} (replay: foglab.sim.fuzz.replay({f.target!r}, "
                      f"{args.seed}, {f.index})): {f.error}\n  input: {f.input}\n{f.trace}")
    return 0 if crashes == 0 else 1
