"""`fog-agent simulate scaling` and `fog-agent bench sim` (issue 3)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from typing import Any, Tuple

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _delays(text: str) -> Tuple[int, int]:
    """`N` (every message takes N steps) or `A-B` (uniform random in [A, B], FIFO kept per link)."""
    try:
        lo, _, hi = text.partition("-")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or A-B (steps), found {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, found {text!r}")
    return a, b


def register(groups: Any) -> None:
    p = groups.simulate.add_parser(
        "scaling", help="simulate the decentralized scaling protocol (thesis 3.4 set-up)",
        description="Seeded discrete-time simulation driving the real protocol core. Defaults are "
        "the paper's: 5 operators x 14 instances, C=500, r=0.7, up=0.8, down=0.6, period 5, 200 steps.",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--operators", type=int, default=5)
    p.add_argument("--instances", type=int, default=14, help="initial instances per operator")
    p.add_argument("--pipelines", type=int, default=1, help="independent pipelines simulated together")
    p.add_argument("--capacity", type=float, default=500.0)
    p.add_argument("--ratio", type=float, default=0.7, help="target load ratio r")
    p.add_argument("--up", type=float, default=0.8)
    p.add_argument("--down", type=float, default=0.6)
    p.add_argument("--period", type=int, default=5)
    p.add_argument("--delays", type=_delays, default=(1, 1), metavar="N|A-B",
                   help="message delay in steps, fixed or uniform random (default 1)")
    p.add_argument("--load", choices=("brownian", "sinusoidal", "monotonic"), default="brownian")
    p.add_argument("--volatility", type=float, default=0.08, help="Brownian log-load std-dev per step")
    p.add_argument("--baseline", choices=("decentralized", "centralized"), default="decentralized")
    p.add_argument("--r-secure", action="store_true", help="use the r_secure guarantee (thesis 3.3.3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--csv", metavar="FILE", help="write the per-step series")
    p.add_argument("--plot", metavar="FILE.png", help="load vs instances, accuracy, messages")
    p.set_defaults(func=_simulate)

    b = groups.bench.add_parser("sim", help="steps/s of the scaling simulator at 70, 10k and 100k instances")
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("--sizes", default="70,10000,100000", help="total initial instances, comma-separated")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--volatility", type=float, default=0.08,
                   help="Brownian volatility (the work is proportional to the scaling it causes)")
    b.set_defaults(func=_bench)


def _config(args: argparse.Namespace) -> Any:
    from foglab.sim.scaling_sim import SimConfig

    return SimConfig(
        seed=args.seed, steps=args.steps, operators=args.operators, instances=args.instances,
        pipelines=args.pipelines, capacity=args.capacity, target_ratio=args.ratio, up=args.up,
        down=args.down, period=args.period, delay_min=args.delays[0], delay_max=args.delays[1],
        load=args.load, volatility=args.volatility, baseline=args.baseline, r_secure=args.r_secure,
    )


def _simulate(args: argparse.Namespace) -> int:
    from foglab.sim.scaling_sim import simulate

    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"fog-agent simulate scaling: {exc}", file=sys.stderr)
        return EXIT_USAGE
    res = simulate(cfg)
    summary = res.summary()
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["step", "load", "instances", "ideal", "accuracy", "throughput_pct", "messages",
                        "stale_routes", "op0_load", "op0_instances"])
            for i in range(len(res.load)):
                w.writerow([i, res.load[i], res.instances[i], res.ideal[i], round(res.accuracy[i], 6),
                            round(res.throughput_pct[i], 6), res.messages[i], res.stale_routes[i],
                            res.op0_load[i], res.op0_instances[i]])
    if args.plot:
        from foglab.sim.plot import plot_run

        plot_run(res, args.plot)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        for k, v in summary.items():
            print(f"{k:34} {v}")
    bad = summary["stale_route_deliveries"] or summary["inconsistent_views_at_quiescence"] or \
        summary["protocol_errors"] or summary["messages_to_terminated"] or summary["rounds_open_at_end"]
    return EXIT_ERROR if bad else EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    """CPU seconds (process time, robust to a shared machine) per run; the work is dominated by
    protocol messages, so messages/s is the figure that transfers between load profiles."""
    from foglab.sim.scaling_sim import SimConfig, simulate

    print(f"{'instances':>10} {'pipelines x 5 x 14':>19} {'steps':>6} {'cpu_s':>8} {'wall_s':>8} "
          f"{'steps/s':>9} {'messages':>10} {'msgs/cpu_s':>11}")
    for total in (int(x) for x in args.sizes.split(",")):
        pipelines = max(1, round(total / 70))
        cfg = SimConfig(seed=args.seed, steps=args.steps, pipelines=pipelines, volatility=args.volatility)
        c0, t0 = time.process_time(), time.perf_counter()
        res = simulate(cfg)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        msgs = sum(res.messages)
        print(f"{pipelines * 70:>10} {pipelines:>19} {args.steps:>6} {cpu:>8.2f} {wall:>8.2f} "
              f"{args.steps / cpu:>9.1f} {msgs:>10} {msgs / cpu:>11.0f}")
        sys.stdout.flush()
    return EXIT_OK
