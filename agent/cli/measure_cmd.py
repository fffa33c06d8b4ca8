"""`fog-agent calibrate`, `fog-agent netem apply|clear`: measurements a node takes of itself.

calibrate: drives the pipeline's operator function in-process at rising input rates, with the
worker's per-record service-time emulation, until its output lags (thesis 4.3.1), and stores the
capacity per (node, operator) in `<state_dir>/capacity.json`. The function is imported through the
node's allow-list (docs/security.md, "No code from the bus"): with `--config`, the agent.toml's
`[operators] modules` count, as they do for that node's workers.
netem: turns a latency matrix into tc commands (see agent.measure.netem); exit 3 when the kernel
lacks sch_netem, with one line saying so.
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
