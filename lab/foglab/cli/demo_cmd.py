"""`fog-agent demo` and the benchmarks of the runtime: `bench rescale`, `bench spawn`, `bench move`,
and those the data-path tools register themselves (`bench dataplane`, `bench keyed`, `bench handover`,
`bench fleet`). Lab commands: they start private brokers and local fleets, never run on a node."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any


def register(groups: Any) -> None:
    m = groups.root.add_parser("demo", help="three agents on a private broker scale a taxi pipeline live")
    m.add_argument("--duration", type=float, default=None, help="seconds of load profile (default from the pipeline)")
    m.add_argument("--pipeline", default=None, help="pipeline file (default examples/demo-pipeline.toml)")
    m.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    m.add_argument("--plot", default=None, help="PNG path of the plot (default demo-<time>.png in the work dir)")
    m.add_argument("--workdir", default=None, help="keep broker, agent logs and sink files here")
    m.add_argument("--quiet", action="store_true", help="no live table")
    m.add_argument("--no-analytics", action="store_true", help="skip the final analytics step (PySpark)")
    m.set_defaults(func=demo_cmd)

    b = groups.bench.add_parser("rescale", help="decision -> first record of the new instance through the real "
                                "daemon, workers forked from the fork server and started cold")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.add_argument("--rate", type=float, default=500.0, help="records/s of the load step")
    b.set_defaults(func=bench_rescale_cmd)

    sp = groups.bench.add_parser("spawn", help="start -> ready of a burst of workers forked from the agent's "
                                 "fork server vs started cold (same run)")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    sp.add_argument("--burst", type=int, default=3, help="workers started at once (default 3)")
    sp.add_argument("--rounds", type=int, default=5, help="bursts per mode (default 5)")
    sp.set_defaults(func=bench_spawn_cmd)

    mv = groups.bench.add_parser("move", help="move a node's instances (drain, re-home): seconds to the first "
                                 "record through each moved instance, per-node inboxes against the shared format")
    mv.add_argument("--json", action="store_true", help="print the result as JSON")
    mv.add_argument("--runs", type=int, default=2, help="moves of each kind in each format (alternated)")
    mv.add_argument("--kinds", default="drain,rehome", help="comma-separated: drain, rehome")
    mv.add_argument("--rate", type=float, default=200.0, help="records/s of the source")
    mv.add_argument("--workdir", default=None, help="keep broker, agent logs and sink files here")
    mv.set_defaults(func=bench_move_cmd)

    for name in ("foglab.tools.dataplane_bench", "foglab.tools.keyed_bench", "foglab.tools.handover_bench",
                 "foglab.tools.fleet_bench"):
        importlib.import_module(name).register_bench(groups)


def demo_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import demo

    return demo.main(args)


def bench_rescale_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import demo

    from agent.log import stdout_to_stderr

    with stdout_to_stderr() if args.json else contextlib.nullcontext():  # --json: stdout is the JSON alone
        result = demo.bench_rescale(rate=args.rate)
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        for mode in ("warm", "cold"):
            r = result[mode]
            d = r["decision_to_first_record_s"]
            sr = r["start_to_ready_s"]
            print(f"{mode:<5} start -> ready: median {sr['median']} s, max {sr['max']} s | scale-outs "
                  f"{r['scale_outs']:>3}, decision -> first record: median {d['median']} s, max {d['max']} s "
                  f"(lost {r['lost']}, duplicated {r['duplicated']})")
    ok = all(result[m]["lost"] == 0 and result[m]["duplicated"] == 0 for m in ("warm", "cold"))
    return 0 if ok else 3


def bench_spawn_cmd(args: argparse.Namespace) -> int:
    from agent.log import stdout_to_stderr
    from foglab.tools import demo

    if args.burst < 1 or args.rounds < 1:
        print("fog-agent bench spawn: --burst and --rounds take 1 or more", file=sys.stderr)
        return 2
    with stdout_to_stderr() if args.json else contextlib.nullcontext():
        result = demo.bench_spawn(burst=args.burst, rounds=args.rounds)
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        for mode in ("forked", "cold"):
            r = result[mode]["start_to_ready_s"]
            print(f"{mode:<6} bursts of {result['burst']}: start -> ready median {r['median']} s, max {r['max']} s "
                  f"({r['n']} starts)")
        print(f"cold / forked: median x{result['cold_over_forked']['median']}, max x{result['cold_over_forked']['max']}")
    return 0


def bench_move_cmd(args: argparse.Namespace) -> int:
    from agent.log import stdout_to_stderr
    from foglab.tools import move_bench

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad = [k for k in kinds if k not in ("drain", "rehome")]
    if bad or args.runs < 1:
        print(f"fog-agent bench move: --kinds takes drain and/or rehome (got {args.kinds!r}), --runs >= 1",
              file=sys.stderr)
        return 2
    with stdout_to_stderr() if args.json else contextlib.nullcontext():
        result = move_bench.bench_move(args.runs, kinds, args.rate, Path(args.workdir) if args.workdir else None)
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        for key, r in sorted(result["summary"].items()):
            print(f"{key:<18} move -> first record through every moved instance: median {r['all_moved_s_median']} s "
                  f"(runs {r['all_moved_s']}); lost {r['lost']}, duplicated {r['duplicated']}")
    ok = all(r["lost"] == 0 and r["duplicated"] == 0 for r in result["summary"].values())
    return 0 if ok else 3
