"""`fog-agent calibrate`, `fog-agent netem apply|clear`, `fog-agent simulate policies`.

calibrate: drives the pipeline's operator function in-process at rising input rates, with the
worker's per-record service-time emulation, until its output lags (thesis 4.3.1), and stores the
capacity per (node, operator) in `<state_dir>/capacity.json`. The function is imported through the
node's allow-list (docs/security.md, "No code from the bus"): with `--config`, the agent.toml's
`[operators] modules` count, as they do for that node's workers.
netem: turns a latency matrix into tc commands (see agent.measure.netem); exit 3 when the kernel
lacks sch_netem, with one line saying so.
simulate policies: runs every policy on the same synthetic taxi trace and latency matrix over
several seeds and prints the SPEC elasticity table next to Gesscale's Table III.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any, Callable, List

EXIT_OK, EXIT_ERROR, EXIT_NO_NETEM = 0, 1, 3


def register(groups: Any) -> None:
    p = groups.root.add_parser("calibrate", help="measure the records/s one operator instance sustains here")
    p.add_argument("--pipeline", required=True, help="pipeline TOML")
    p.add_argument("--operator", required=True, help="operator name, e.g. in_zone")
    p.add_argument("--config", default=None, help="agent.toml (node name, state_dir, [operators] modules)")
    p.add_argument("--node", default=None, help="node name (default: agent.toml's, else the host name)")
    p.add_argument("--state-dir", default=None, help="where capacity.json goes (default: agent.toml's)")
    p.add_argument("--window", type=float, default=0.5, help="seconds per input rate step")
    p.add_argument("--start-rate", type=float, default=50.0)
    p.add_argument("--growth", type=float, default=1.5)
    p.add_argument("--max-rate", type=float, default=1e6)
    p.add_argument("--service-time-ms", type=float, default=None, help="override the operator's service_time_ms")
    p.add_argument("--dry-run", action="store_true", help="measure, print, do not store")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_calibrate)

    n = groups.root.add_parser("netem", help="emulate a latency matrix with tc netem")
    sub = n.add_subparsers(dest="netem_command", metavar="ACTION")
    a = sub.add_parser("apply", help="apply the matrix for this node (idempotent)")
    a.add_argument("--matrix", required=True, help="latency TOML ([nodes], [rtt_ms])")
    a.add_argument("--node", default=None, help="this node's name in the matrix (default: by local address)")
    a.add_argument("--dev", default=None, help="interface (default: the matrix's dev for the node, else eth0)")
    a.add_argument("--root", choices=("htb", "prio"), default="htb")
    a.add_argument("--one-way", action="store_true", help="values are one-way delays, not RTTs")
    a.add_argument("--leaf", choices=("netem", "pfifo", "tbf"), default="netem",
                   help=argparse.SUPPRESS)  # tests on kernels without netem
    a.add_argument("--dry-run", action="store_true", help="print the tc commands, run nothing")
    a.set_defaults(func=cmd_netem_apply)
    c = sub.add_parser("clear", help="remove the emulation from the interface")
    c.add_argument("--dev", required=True)
    c.add_argument("--dry-run", action="store_true")
    c.set_defaults(func=cmd_netem_clear)
    n.set_defaults(func=lambda args: (n.print_help(sys.stderr), 2)[1])

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


# ---- calibrate ------------------------------------------------------------------------------------


def record_factory(seed: int, pipe: Any = None, operator: str = "", n: int = 4000,
                   allowed: Any = None) -> Callable[[int], Any]:
    """Records i = 0, 1, ... as the operator sees them: taxi records through the upstream maps
    (imported through `allowed`, the node's allow-list: see `operator_under_test`)."""
    from agent.operators.taxi import sample

    recs: List[Any] = sample(seed, n, "calibrate")
    if pipe is not None:
        from agent.operators.builtin import OperatorContext, load_operator

        for op in pipe.operators[1:pipe.index(operator)]:
            if op.kind != "map":
                continue
            up = load_operator(op.function, OperatorContext("calibrate", op.name, "calibrate", op.kind, dict(op.params)),
                               allowed)
            recs = [r for (_, _, r) in up.process([("c", i, r) for i, r in enumerate(recs)])]
        if not recs:
            raise ValueError(f"the operators before {operator!r} filter out every generated record")
    return lambda i: recs[i % len(recs)]


def operator_under_test(pipe: Any, operator: str, node: str, service_time_ms: Any = None,
                        allowed: Any = None) -> Any:
    """The operator's function, imported in this process through `allowed` (an
    admission.AllowList: the node's own, so that calibrate imports exactly what the node's
    workers may; None: this process's, from its environment)."""
    from agent.measure.capacity import OperatorUnderTest
    from agent.operators.builtin import OperatorContext, load_operator

    op = pipe.operator(operator)
    if op.kind != "map":
        raise ValueError(f"operator {operator!r} is a {op.kind}: calibrate measures map operators")
    impl = load_operator(op.function, OperatorContext(f"calibrate-{operator}", operator, node, op.kind, dict(op.params)),
                         allowed)
    st = op.service_time_ms if service_time_ms is None else service_time_ms
    return OperatorUnderTest(lambda batch: impl.process([("c", i, r) for i, r in enumerate(batch)]), st)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from agent.config import load_agent_config, load_pipeline
    from agent.operators.admission import AllowList
    from agent.measure.capacity import Calibrator, CapacityRecord, CapacityStore, calibrate
    from agent.measure.resources import read_frequency
    from agent.schema import ConfigError

    try:
        pipe = load_pipeline(args.pipeline)
        node, state_dir, allowed = args.node, args.state_dir, None
        if args.config:
            cfg = load_agent_config(args.config)
            node = node or cfg.agent.node
            state_dir = state_dir or cfg.agent.state_dir
            # the node's allow-list, as its agent builds it: its `[operators] modules` too
            allowed = AllowList.for_node(cfg.operators.modules)
        node = node or socket.gethostname().split(".")[0]
        state_dir = state_dir or "/var/lib/fog-agent"
        op = operator_under_test(pipe, args.operator, node, args.service_time_ms, allowed)
        make = record_factory(1, pipe, args.operator, allowed=allowed)
    except (ConfigError, KeyError, ValueError) as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return EXIT_ERROR
    cal = Calibrator(args.start_rate, args.growth, args.max_rate)
    res = calibrate(op.process, make, cal, window=args.window, busy_until=op.busy_until)
    service_ms = 1000.0 / res.capacity if res.capacity > 0 else None
    rec = CapacityRecord(node, args.operator, round(res.capacity, 3), service_ms, time.time(),
                         read_frequency()["current"], "calibrate",
                         [{"rate": round(s.rate, 2), "offered": s.offered, "processed": s.processed,
                           "elapsed": round(s.elapsed, 4), "lagging": s.lagging} for s in res.steps])
    if not args.dry_run:
        try:
            CapacityStore(state_dir).put(rec)
        except OSError as exc:
            print(f"calibrate: cannot write {state_dir}/capacity.json ({exc.strerror})", file=sys.stderr)
            return EXIT_ERROR
    if args.json:
        print(json.dumps({"node": node, "operator": args.operator, "capacity": rec.capacity,
                          "saturated": res.saturated, "steps": rec.steps}, indent=2))
    else:
        for s in res.steps:
            print(f"  rate {s.rate:10.1f}/s  offered {s.offered:7d}  processed {s.processed:7d}  "
                  f"-> {s.throughput:9.1f}/s{'  LAG' if s.lagging else ''}")
        bound = "" if res.saturated else " (lower bound: max rate reached without lag)"
        where = "" if args.dry_run else f", stored in {state_dir}/capacity.json"
        print(f"{node}/{args.operator}: capacity {res.capacity:.1f} records/s{bound}{where}")
    return EXIT_OK


# ---- netem -------------------------------------------------------------------------------------------


def _local_node(matrix: Any) -> Any:
    import psutil

    mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    hits = [n for n, addr in matrix.addresses.items() if addr in mine]
    return hits[0] if len(hits) == 1 else None


def cmd_netem_apply(args: argparse.Namespace) -> int:
    from agent.measure import netem

    try:
        matrix = netem.load_matrix(args.matrix)
    except (OSError, ValueError) as exc:
        print(f"netem: {exc}", file=sys.stderr)
        return EXIT_ERROR
    node = args.node or _local_node(matrix)
    if node is None:
        print("netem: cannot tell which node this is (no single local address in [nodes]); pass --node",
              file=sys.stderr)
        return EXIT_ERROR
    try:
        if args.dry_run:
            print(netem.format_commands(netem.build_commands(matrix, node, args.dev, args.root, args.leaf,
                                                             args.one_way)))
            return EXIT_OK
        if args.leaf == "netem" and netem.netem_available() is False:
            print(netem.NETEM_MISSING_LINE, file=sys.stderr)
            return EXIT_NO_NETEM
        ran = netem.apply(matrix, node, netem.default_runner(), args.dev, args.root, args.leaf, args.one_way)
    except netem.NetemMissing as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_NO_NETEM
    except (netem.NetemError, ValueError) as exc:
        print(f"netem: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(netem.format_commands(ran))
    return EXIT_OK


def cmd_netem_clear(args: argparse.Namespace) -> int:
    from agent.measure import netem

    if args.dry_run:
        print(f"tc qdisc del dev {args.dev} root")
        return EXIT_OK
    try:
        removed = netem.clear(netem.default_runner(), args.dev)
    except netem.NetemError as exc:
        print(f"netem: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"netem: {'removed the emulation from' if removed else 'nothing to remove on'} {args.dev}")
    return EXIT_OK


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
