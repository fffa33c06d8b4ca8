"""`fog-agent chaos`: the demo fleet under seeded fault injection, verified by record-id accounting."""

from __future__ import annotations

import argparse
from typing import Any


def register(groups: Any) -> None:
    from agent.protocol.gme_fgme import DAMPING_DEFAULT
    from foglab.tools.chaos import DEFAULT_FAULTS, FAULTS

    p = groups.root.add_parser(
        "chaos", help="run the demo fleet while injecting faults at random (seeded), then verify every record id")
    p.add_argument("--duration", type=float, default=120.0,
                   help="seconds of changing load at least (default 120); the load goes on past it until "
                        "--min-faults and --min-records are met")
    p.add_argument("--min-faults", type=int, default=0,
                   help="inject at least this many faults before the load ends (default 0: those of the duration)")
    p.add_argument("--min-records", type=int, default=0,
                   help="end the load only once the source generated this many records (default 0)")
    p.add_argument("--load-cap", type=float, default=None,
                   help="seconds of load at most (default 3 x --duration): a run whose conditions are not met "
                        "by then fails (exit 4) saying what it waited for")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and the data (default 1)")
    p.add_argument("--faults", default=None,
                   help=f"comma-separated faults to draw from, of {','.join(FAULTS)} "
                        f"(default {','.join(DEFAULT_FAULTS)}, with --testbed kill-node,partition, and lose-node if asked for; kill-node turns re-homing on (opt-in), partition cuts a "
                        "node off the broker for 3-30 s, kill-broker loses what the broker received since its last autosave)")
    p.add_argument("--rehoming", choices=("auto", "on", "off"), default="auto",
                   help="the agents re-home the instances of a node offline for 6 s (auto: only when kill-node "
                        "may be drawn)")
    p.add_argument("--coordination", choices=("ack", "fgme"), default="ack",
                   help="the pipeline's coordination: ack (the paper) or fgme (rounds inside 2-FGME locks)")
    p.add_argument("--fgme-damping", action=argparse.BooleanOptionalAction, default=DAMPING_DEFAULT,
                   help="with --coordination fgme: the lock nodes use DEVIATION 4 (docs/gme.md; the default, as "
                        "[pipeline] fgme_damping); --no-fgme-damping: the published algorithm")
    p.add_argument("--pipeline", choices=("demo", "stateful", "stateful-scaling", "mqtt-ingest"), default="demo",
                   help="demo: the demo pipeline, in_zone scaling; stateful: a keyed 10-minute window per pickup cell "
                        "before the sink, each window compared with a fault-free reference; stateful-scaling: that "
                        "window scaling out and in, its key groups moving with their state; mqtt-ingest: readings "
                        "published by the chaos process itself (QoS 1) through mqtt_source and a keyed 5-second "
                        "window per sensor, every published reading checked against the windows (default demo)")
    p.add_argument("--spill-ack", choices=("written", "landed"), default="written",
                   help="stateful pipelines and mqtt-ingest: the agents' [spill] ack; landed: a sink acks its "
                        "records upstream only once their spool files landed (default written)")
    p.add_argument("--chain", action="store_true",
                   help="the demo pipeline with [pipeline] chain = true: its keepers share worker processes "
                        "(docs/runtime.md, \"Chaining\"); kill-worker then kills a whole chain")
    p.add_argument("--runs", type=int, default=1, help="runs with seeds seed, seed+1, ... (default 1)")
    p.add_argument("--workdir", default=None, help="work directory of the first run (default: a new temporary one)")
    p.add_argument("--testbed", action="store_true",
                   help="act on the running container testbed instead of the demo's processes: kill-node powers a "
                        "container off (and boots it again), partition cuts its veth; the pipeline runs across the "
                        "containers (fog-agent testbed up + ansible/site.yml first; faults: kill-node,partition,lose-node: "
                        "lose-node also wipes its disk and has the role install a replacement)")
    p.add_argument("--count", type=int, default=2, help="--testbed: number of faults (default 2)")
    p.add_argument("--rate", type=float, default=300.0, help="--testbed: records/s of the load step (default 300)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (a list for several runs)")
    p.set_defaults(func=chaos_cmd)


def chaos_cmd(args: argparse.Namespace) -> int:
    if args.testbed:
        return testbed_chaos_cmd(args)
    from foglab.tools import chaos

    return chaos.main(args)


def testbed_chaos_cmd(args: argparse.Namespace) -> int:
    import json
    import sys

    from foglab.tools import testbed
    from foglab.tools.chaos import EXIT_LOSS, EXIT_OK, EXIT_SETUP, EXIT_UNRECOVERED
    from foglab.tools.chaos_testbed import FAULTS, run_testbed_chaos

    faults = [f.strip() for f in str(args.faults or ",".join(FAULTS)).split(",") if f.strip()]
    try:
        summary = run_testbed_chaos(faults, count=args.count, seed=args.seed, duration=args.duration, rate=args.rate)
    except testbed.TestbedError as exc:
        print(f"fog-agent chaos: {exc}", file=sys.stderr)
        return EXIT_SETUP
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        for f in summary["testbed_faults"]:
            print(json.dumps(f))
        print(f"records generated {summary['generated']}, expected {summary['expected']}, received "
              f"{summary['received']}, lost {summary['lost']}, duplicated {summary['duplicated']}")
        print("verdict: " + ("OK" if summary["ok"] else "FAILED"))
    if summary["lost"] or summary["duplicated"]:
        return EXIT_LOSS
    return EXIT_OK if summary["ok"] else EXIT_UNRECOVERED

