"""`fog-agent simulate policies`, `fog-agent bench policies`, `fog-agent bench latency`.

simulate policies: runs every policy on the same synthetic taxi trace and latency matrix over
several seeds and prints the SPEC elasticity table next to Gesscale's Table III.
bench policies: the same policies on a local fleet of three real agents.
bench latency: the userspace delay proxy's RTT against the direct path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXIT_OK, EXIT_ERROR = 0, 1


def register(groups: Any) -> None:
    s = groups.simulate.add_parser("policies", help="decentralized vs threshold vs model on a taxi trace (SPEC metrics)")
    s.add_argument("--trace", choices=("taxi",), default="taxi")
    s.add_argument("--seeds", type=int, default=10)
    s.add_argument("--days", type=float, default=2.0, help="trace length in real-world days (speed factor 10)")
    s.add_argument("--period", type=float, default=60.0, help="decision period, s")
    s.add_argument("--cooldown", type=float, default=120.0, help="threshold/model cooldown, s")
    s.add_argument("--stop-seconds", type=float, default=0.0,
                   help="pipeline stop per reconfiguration (Flink ~120; ours 0)")
    s.add_argument("--policies", default=None, help="comma-separated subset")
    s.add_argument("--json", action="store_true")
    s.add_argument("--plot", default=None, help="PNG of supply vs demand for seed 0")
    s.add_argument("--train-days", type=int, default=0,
                   help="days before the evaluated ones that only teach the seasonal profile")
    s.add_argument("--day-sigma", type=float, default=0.0, help="day-to-day traffic level noise (log sigma)")
    s.add_argument("--pareto", default=None, help="PNG: reconfigurations vs cost per policy and the clairvoyant "
                   "bound at several budgets (needs threshold among the policies)")
    s.set_defaults(func=cmd_simulate_policies)

    bp = groups.bench.add_parser("policies", help="every scaling policy on a local fleet of 3 real agents next to "
                                 "`simulate policies` on the same compressed taxi trace")
    bp.add_argument("--policies", default="decentralized,threshold,model,sized", help="comma-separated")
    bp.add_argument("--minutes", type=float, default=4.0, help="the two taxi days compressed into this many minutes")
    bp.add_argument("--peak", type=float, default=600.0, help="peak input, records/s")
    bp.add_argument("--capacity", type=float, default=250.0, help="in_zone records/s per instance (service time 1/C)")
    bp.add_argument("--period", type=float, default=1.0, help="decision period, s")
    bp.add_argument("--cooldown", type=float, default=2.0, help="policy cooldown, s")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--workdir", default=None, help="keep the runs' logs and sink files here")
    bp.add_argument("--consolidation", choices=("off", "on", "both"), default="off",
                    help="live runs without the site manager, with it (every agent a candidate), or both")
    bp.add_argument("--target", type=float, default=0.3, help="[site_manager] target (spare capacity kept)")
    bp.add_argument("--min-nodes", type=int, default=1, help="[site_manager] min_nodes")
    bp.add_argument("--site-cooldown", type=float, default=5.0, help="[site_manager] cooldown, s")
    bp.add_argument("--plot", default=None, help="PNG: instances and powered nodes over the run, node- and "
                    "instance-minutes per policy (with --consolidation)")
    bp.add_argument("--json", action="store_true")
    bp.set_defaults(func=cmd_bench_policies)

    b = groups.bench.add_parser("latency", help="RTT through the userspace delay proxy vs direct (baseline)")
    b.add_argument("--rtt", default="0,50,150,300", help="comma-separated emulated RTTs, ms")
    b.add_argument("--count", type=int, default=20, help="samples per configuration")
    b.set_defaults(func=cmd_bench_latency)


# ---- simulate policies --------------------------------------------------------------------------------


def cmd_simulate_policies(args: argparse.Namespace) -> int:
    from foglab.sim.policies import POLICIES, SimConfig, compare, format_table, summary

    names = [p.strip() for p in args.policies.split(",")] if args.policies else list(POLICIES)
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        print(f"simulate policies: unknown {unknown}; expected some of {', '.join(POLICIES)}", file=sys.stderr)
        return EXIT_ERROR
    cfg = SimConfig(period=args.period, cooldown=args.cooldown, stop_seconds=args.stop_seconds)
    t0 = time.perf_counter()
    results = compare(range(args.seeds), names, days=args.days, cfg=cfg, train_days=args.train_days,
                      day_sigma=args.day_sigma)
    took = time.perf_counter() - t0
    bound = forecast = None
    if args.pareto or "seasonal" in results:
        bound, forecast = _bound(results, args.pareto, args.days, args.train_days, args.day_sigma)
    if args.json:
        doc = {"seeds": args.seeds, "days": args.days, "config": {"period": cfg.period, "cooldown": cfg.cooldown,
                                                                    "stop_seconds": cfg.stop_seconds},
               "summary": {p: {k: {"mean": m, "sd": sd} for k, (m, sd) in s.items()} for p, s in summary(results).items()},
               "runs": {p: [dict(r.metrics.as_dict(), seed=r.seed, operations=r.operations) for r in rs]
                        for p, rs in results.items()},
               "bound": [{"max_changes": k, "cost": c} for k, c in (bound or [])],
               "forecast_bound": [{"max_changes": k, "cost": c} for k, c in (forecast or [])]}
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(results))
        if bound:
            print("\nclairvoyant bound (under-provisioning <= threshold's), mean cost by reconfiguration budget: "
                  + ", ".join(f"{k}: {c:.1f}" for k, c in bound))
        if forecast:
            print("perfect-forecast bound (a plan on the smooth part of each day), mean cost by budget: "
                  + ", ".join(f"{k}: {c:.1f}" for k, c in forecast))
        print(f"\n({args.seeds} seeds x {len(names)} policies in {took:.1f} s)")
    if args.plot:
        _plot(results, args.plot)
    return EXIT_OK


def _bound(results: Any, pareto: Any, days: float, train_days: int, day_sigma: float) -> Any:
    """The clairvoyant bound at the policies' own (rounded) reconfiguration counts and, for the
    Pareto plot, at every budget 8..36 with the perfect-forecast bound beside it
    (lab/foglab/sim/policies_forecast_bound.py); (None, None) without a threshold run to take the
    under limit from."""
    from foglab.sim.policies_forecast_bound import forecast_bound_curve
    from foglab.sim.policies_pareto import bound_curve, plot_pareto, points

    if "threshold" not in results:
        return None, None
    pts = points(results)
    budgets = sorted({int(round(v[0])) for v in pts.values()} | (set(range(8, 37)) if pareto else set()))
    bound = bound_curve(results["threshold"], budgets)
    forecast = None
    if pareto:
        forecast = forecast_bound_curve(results["threshold"], budgets, days, train_days, day_sigma)
        plot_pareto(pts, bound, pareto, f"{len(results['threshold'])} seeds", forecast)
    return bound, forecast


def _plot(results: Any, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.2 * len(results)), sharex=True)
    for ax, (name, runs) in zip(axes, results.items()):
        r = runs[0]
        minutes = [t / 60 for t in range(len(r.supply))]
        ax.step(minutes, r.demand, where="post", label="demand (ideal)", color="grey")
        ax.step(minutes, r.supply, where="post", label="supply", color="C0")
        ax.set_ylabel(name, fontsize=8)
    axes[0].legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("minutes (seed 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---- bench latency --------------------------------------------------------------------------------------


def cmd_bench_latency(args: argparse.Namespace) -> int:
    import statistics

    from foglab.tools.delayproxy import DelayProxy
    from agent.measure.latency import EchoServer, tcp_rtt

    rtts = [float(x) for x in args.rtt.split(",") if x.strip()]
    echo = EchoServer().start()
    try:
        rows = [("direct (baseline)", None, tcp_rtt("127.0.0.1", echo.port, args.count))]
        for ms in rtts:
            with DelayProxy(("127.0.0.1", echo.port), ms) as proxy:
                rows.append((f"proxy {ms:g} ms", ms, tcp_rtt("127.0.0.1", proxy.port, args.count)))
    finally:
        echo.stop()
    print(f"{'path':<20} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'error ms':>9}")
    for name, ms, xs in rows:
        xs = sorted(xs)
        med = statistics.median(xs)
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        err = "" if ms is None else f"{med - ms:+9.2f}"
        print(f"{name:<20} {med:10.2f} {p90:8.2f} {xs[-1]:8.2f} {err:>9}")
    return EXIT_OK


# ---- bench policies -------------------------------------------------------------------------------


def cmd_bench_policies(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from foglab.tools.policies_bench import SiteParams, compare, format_consolidation, format_rows, plot_consolidation

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fog-bench-policies-"))

    def progress(row: Any) -> None:
        print(json.dumps({k: v for k, v in row.items() if k != "series"}, sort_keys=True), file=sys.stderr, flush=True)

    site = SiteParams(target=args.target, min_nodes=args.min_nodes, cooldown=args.site_cooldown)
    rows = compare(policies, work, minutes=args.minutes, peak=args.peak, seed=args.seed, capacity=args.capacity,
                   period=args.period, cooldown=args.cooldown, consolidation=args.consolidation, site=site,
                   progress=progress)
    if args.plot:
        plot_consolidation(rows, Path(args.plot))
    if args.json:
        print(json.dumps({"workdir": str(work), "rows": rows}, indent=2, sort_keys=True))
    else:
        print(format_rows(rows))
        if args.consolidation != "off":
            print()
            print(format_consolidation(rows))
    return EXIT_OK if all(r["records_lost"] == 0 for r in rows) else EXIT_ERROR
