"""`fog-agent simulate gme`, `fog-agent bench gme` and `fog-agent bench gme-check`: 2-FGME vs
Joung's RA1/RA2, simulated, on the real broker, and model-checked exhaustively."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Tuple, Union

ALGORITHMS = ("2fgme", "ra1", "ra2")


def register(groups: Any) -> None:
    from agent.protocol.gme_fgme import DAMPING_DEFAULT

    p = groups.simulate.add_parser("gme", help="discrete-event simulation of 2-FGME / RA1 / RA2")
    # published by default: this command reproduces the thesis's message counts (docs/gme.md,
    # "Message counts"), which are the published algorithm's
    _common(p, entries=10, think=1000.0, cs=1000.0, damping=False)
    p.add_argument("--delay-ms", type=float, default=1.0, help="mean one-way link delay (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--send-ms", type=float, default=0.0,
                   help="per-message time of each node's one outgoing queue (a publisher on MQTT)")
    p.add_argument("--max-messages", type=int, default=1_000_000,
                   help="stop after this many messages (the rest counts as unserved)")
    p.add_argument("--plot", metavar="FILE.png", help="figure 5.2 style occupancy plot")
    p.set_defaults(func=run_simulate)

    b = groups.bench.add_parser("gme", help="2-FGME / RA1 / RA2 through a real Mosquitto broker")
    _common(b, entries=25, think=50.0, cs=50.0, damping=DAMPING_DEFAULT)
    b.add_argument("--broker", default=None,
                   help="HOST:PORT of Mosquitto (default: a private broker on a free loopback port)")
    b.add_argument("--timeout", type=float, default=300.0,
                   help="end the run after this many seconds: partial report with every node's state, exit 3")
    b.add_argument("--procs", type=int, default=1,
                   help="processes to spread the nodes over (one process tops out near 24 nodes, docs/gme.md)")
    b.set_defaults(func=run_bench)

    c = groups.bench.add_parser(
        "gme-check",
        help="exhaustive model check of 2-FGME / RA1 / RA2 (every delivery order, small sizes)",
    )
    c.add_argument("--algorithm", choices=ALGORITHMS, default="2fgme")
    c.add_argument("--groups", default="2,2", help="group sizes, e.g. 2,2 (nodes 0-1 and 2-3)")
    c.add_argument("--requests", type=_requests, default=2,
                   help="CS requests per node, or one number per node (2,2,2,1)")
    c.add_argument("--no-reduction", action="store_true", help="explore every interleaving (no POR)")
    c.add_argument("--no-symmetry", action="store_true", help="no symmetry reduction (2-FGME only)")
    c.add_argument("--hash-states", action="store_true",
                   help="store 128-bit digests of the states (hash compaction; reports the collision bound)")
    c.add_argument("--no-merge", action="store_true",
                   help="no dead-variable merging (states equal but for variables never read again; 2-FGME)")
    c.add_argument("--digest-slots-log2", type=int, default=None, metavar="K",
                   help="with --hash-states: one table of 2^K 12-byte slots, sized once (for runs that fill the memory)")
    c.add_argument("--fast", action="store_true",
                   help="the same search compiled (lab/foglab/sim/gme_fast.c, needs cc): ~10x faster, 8-byte fingerprints, no trace")
    c.add_argument("--table-bits", type=int, default=27, metavar="K",
                   help="with --fast: 2^K 8-byte slots for the visited set (27 = 1 GB, ~120 M states)")
    c.add_argument("--sweep", default=None, metavar="DIR",
                   help="with --fast: explore in the order of a progress measure and forget what is passed "
                        "(memory holds the states ahead only; states waiting for later sub-layers go to files in DIR)")
    c.add_argument("--memory-gb", type=float, default=16.0,
                   help="with --sweep: memory for the sub-layer tables, in all")
    c.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="save the search here now and then (PATH and PATH.table.N), and resume from it when it exists")
    c.add_argument("--checkpoint-every", type=int, default=50_000_000, metavar="STATES")
    c.add_argument("--fault", default=None, help="seeded bug in the protocol (2-FGME: skip_acks_to_ign)")
    c.add_argument("--damping", action="store_true",
                   help="2-FGME: check the damped variant (DEVIATIONS 4 and 5, `bench gme`'s default) instead of "
                        "the published algorithm (the transcription, the default here)")
    c.add_argument("--max-states", type=int, default=500_000_000)
    c.add_argument("--progress", action="store_true", help="print a line per million states on stderr")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=run_check)


def _requests(text: str) -> Union[int, Tuple[int, ...]]:
    parts = tuple(int(x) for x in text.split(","))
    return parts[0] if len(parts) == 1 else parts


def _common(p: argparse.ArgumentParser, entries: int, think: float, cs: float, damping: bool) -> None:
    p.add_argument("--algorithm", choices=ALGORITHMS, default="2fgme")
    p.add_argument("--nodes", type=int, default=12, help="total nodes, split in two equal groups")
    p.add_argument("--entries", type=int, default=entries, help="CS entries per node")
    p.add_argument("--think-ms", type=float, default=think, help="P: think time between requests")
    p.add_argument("--cs-ms", type=float, default=cs, help="inCS: time spent in the CS")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--damping", action=argparse.BooleanOptionalAction, default=damping,
                   help="2-FGME: an End ends only the authorization granted for its sender, and a request "
                        "yields to the other group at most once (DEVIATIONS 4 and 5, docs/gme.md); "
                        "--no-damping: the published algorithm (default: %s)"
                        % ("damped" if damping else "published, the thesis's figures"))


def _print(report: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        print()
        return
    for k, v in report.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):  # timeline, node_states: a row per line
            print(k)
            for row in v:
                print(f"  {json.dumps(row, sort_keys=True)}")
        else:
            print(f"{k:22s} {v}")


def run_simulate(args: argparse.Namespace) -> int:
    from foglab.sim.gme_sim import GmeSimConfig, plot, simulate

    cfg = GmeSimConfig(
        algorithm=args.algorithm, nodes=args.nodes, entries=args.entries,
        think_ms=args.think_ms, cs_ms=args.cs_ms, delay_ms=args.delay_ms, seed=args.seed,
        send_ms=args.send_ms, damping=args.damping, max_messages=args.max_messages,
    )
    res = simulate(cfg)
    _print(res.summary(), args.json)
    if args.plot:
        plot(res, args.plot)
    return 0 if res.safety_violations == 0 and res.unserved_requests == 0 else 1


def run_bench(args: argparse.Namespace) -> int:
    """Exit 0 when the run finished safe and served; 1 on a violation or error; 2 when the broker
    is unreachable or does not start; 3 when `--timeout` ended the run (report still printed)."""
    import socket
    import tempfile

    from foglab.tools.broker import BrokerError, start_private_broker
    from foglab.tools.gme_bench import BenchConfig, run_bench as bench

    broker = None
    tmp = None
    if args.broker is None:
        tmp = tempfile.TemporaryDirectory(prefix="gme-bench-")
        try:
            broker = start_private_broker(tmp.name, max_queued=100000)
        except BrokerError as exc:
            print(f"bench gme: {exc}", file=sys.stderr)
            tmp.cleanup()
            return 2
        host, port = broker.host, broker.port
    else:
        h, _, p = args.broker.rpartition(":")
        host = h or "127.0.0.1"
        try:
            port = int(p)
            socket.create_connection((host, port), timeout=5).close()
        except (ValueError, OSError) as exc:
            print(f"bench gme: broker {args.broker} unreachable: {exc}", file=sys.stderr)
            return 2
    try:
        report = bench(BenchConfig(
            algorithm=args.algorithm, nodes=args.nodes, entries=args.entries,
            think_ms=args.think_ms, cs_ms=args.cs_ms, host=host, port=port,
            timeout_s=args.timeout, procs=args.procs, damping=args.damping,
        ))
    except OSError as exc:  # the broker went away while the clients connected
        print(f"bench gme: broker {host}:{port}: {exc}", file=sys.stderr)
        return 2
    finally:
        if broker is not None:
            broker.stop()
        if tmp is not None:
            tmp.cleanup()
    _print(report, args.json)
    if report["timed_out"]:
        print(f"bench gme: timed out after {args.timeout:g} s with {report['unserved_requests']} "
              "requests unserved (node_states has every node's state)", file=sys.stderr)
        return 3
    ok = not report["errors"] and report["safety_violations"] == 0 and report["unserved_requests"] == 0
    return 0 if ok else 1


def run_check(args: argparse.Namespace) -> int:
    """Exit 0 when every explored state is safe and every terminal state served every request.
    `--damping` turns DEVIATIONS 4 and 5 on in every 2-FGME core for the search, as the tests do."""
    from agent.protocol.gme_fgme import FgmeNode

    if not args.damping:
        return _run_check(args)
    saved = FgmeNode.damped, FgmeNode.yield_once
    FgmeNode.damped = FgmeNode.yield_once = True
    try:
        return _run_check(args)
    finally:
        FgmeNode.damped, FgmeNode.yield_once = saved


def _run_check(args: argparse.Namespace) -> int:
    import resource
    import time

    from foglab.sim.gme_check import exhaustive_check

    sizes = tuple(int(x) for x in args.groups.split(","))
    t0, w0 = time.process_time(), time.monotonic()

    def progress(r: Any) -> None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        where = f", layer {r.layer}, {r.held} fingerprints held" if args.fast and args.sweep else ""
        print(f"{r.states} states, {r.transitions} transitions, {r.schedules} terminal{where}, "
              f"{time.process_time() - t0:.0f} s CPU, peak RSS {rss:.0f} MB", file=sys.stderr, flush=True)

    if args.fast:
        from foglab.sim.gme_fast import fast_check

        try:
            r = fast_check(
                args.algorithm, sizes, args.requests, fault=args.fault, max_states=args.max_states,
                symmetry=not args.no_symmetry, reduction=not args.no_reduction, merge_dead=not args.no_merge,
                table_bits=args.table_bits, progress=progress if args.progress else None,
                sweep_dir=args.sweep, memory_gb=args.memory_gb,
            )
        except (RuntimeError, MemoryError) as exc:  # no verdict: say why in one line, not a traceback
            hint = "--memory-gb" if args.sweep else "--table-bits (or --sweep DIR)"
            print(f"gme-check: {exc}; no verdict (raise {hint})", file=sys.stderr)
            return 2
    else:
        r = exhaustive_check(
            args.algorithm, sizes, args.requests, fault=args.fault, max_states=args.max_states,
            symmetry=not args.no_symmetry, reduction=not args.no_reduction,
            hash_states=args.hash_states, progress=progress if args.progress else None,
            merge_dead=not args.no_merge, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
            digest_slots=1 << args.digest_slots_log2 if args.hash_states and args.digest_slots_log2 else None,
        )
    report: Dict[str, Any] = {
        "algorithm": args.algorithm,
        "damping": args.damping if args.algorithm == "2fgme" else None,
        "groups": list(sizes),
        "requests": args.requests,
        "fault": args.fault,
        "verdict": "ok" if r.ok else "violation",
        "reduction": r.reduced,
        "symmetry": r.symmetry,
        "merge_dead": r.merged,
        "hash_states": r.hashed,
        "compiled": args.fast,
        "sweep": bool(args.fast and args.sweep),
        "fingerprints_held_peak": r.held if args.fast else None,
        "collision_bound": r.collision_bound,
        "states": r.states,
        "transitions": r.transitions,
        "terminal_states": r.schedules,
        "full_expansions": r.full_expansions,
        "local_states": r.local_states,
        "safety_violations": r.safety_violations,
        "deadlocks": r.deadlocks,
        "protocol_errors": r.protocol_errors,
        "cpu_s": round(time.process_time() - t0, 2),
        "wall_s": round(time.monotonic() - w0, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "first_failure": r.first_failure,
        "trace": r.trace[-40:],
    }
    _print(report, args.json)
    return 0 if r.ok else 1
