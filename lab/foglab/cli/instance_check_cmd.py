"""`fog-agent simulate instance`: the interleaving checker of whole instances (foglab.sim.instance_check)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE = 0, 1, 2

FAULT_HELP = ("seeded fault to switch on (repeatable): retry_only_with_data, drain_holds_protocol, "
              "rehome_rounds_from_one, replay_to_departed, route_afresh (with --rounds sink-1-2), rehome_stays "
              "(with --rehome-copy), resync_at_first_seen (with --brokers), rehome_idle_active (with --rehome-copy "
              "--rehomes 2 --slow sink-0), replay_clock_at_drop (every move: --rehome-copy --rehomes 2 --brokers 1 "
              "--cuts 1 --spawn-refusals 1 --slow sink-0, seed 9230), leave_before_adoption (a fixed schedule of "
              "the tests only: op-0, the only creator here, is a keeper), resend_pending_only (--keyed --records 8 "
              "--brokers 1, seed 200008), wait_for_leaver, route_past_departed, start_without_leavers, ack_behind_drain and empty_ack_held (fixed schedules of the tests: op "
              "and the sink scaling at once), marks_unacked and marks_own_max (--keyed --event-time --records 8 "
              "--crashes 1 --dups 1 --refusals 1); the checker should then report a "
              "violation, in some schedules")


def register(groups: Any) -> None:
    from foglab.sim.instance_check import FAULTS

    p = groups.simulate.add_parser(
        "instance", help="check whole instances (source -> op 1->2->1 -> sink) over a broker model",
        description="Random schedules (default) or every schedule up to --depth moves, each run to its end "
        "and checked: every record exactly once at the sink, none lost to a terminated instance, every "
        "round ended, views agree. Faults are moves: crash + restart from the last persisted state, "
        "re-homing of op-0 (and of its copy with --rehome-copy), a refused publish, a duplicated delivery, "
        "a broker restart (sessions kept, lost, or rolled back), a node cut off the broker for a while, "
        "a refused createNode().")
    p.add_argument("--schedules", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depth", type=int, default=0, help="explore every schedule up to this depth instead")
    p.add_argument("--records", type=int, default=4)
    p.add_argument("--crashes", type=int, default=1)
    p.add_argument("--rehomes", type=int, default=None,
                   help="re-homings of op-0 (default 1; 0 and the only choice with --rounds sink-1-2: a re-homed "
                   "op-0's route memory went with its node, so what it had sent may reach the sink's copy "
                   "twice, a known gap: docs/reliability.md, \"Not covered yet\")")
    p.add_argument("--refusals", type=int, default=1)
    p.add_argument("--dups", type=int, default=1)
    p.add_argument("--brokers", type=int, default=0, help="broker restarts (restart, lost, rollback)")
    p.add_argument("--cuts", type=int, default=0, help="nodes cut off the broker for up to 12 s")
    p.add_argument("--spawn-refusals", type=int, default=0, help="createNode() refused by the agent")
    p.add_argument("--rehome-copy", action="store_true", help="the re-homing may take op-0's copy instead of op-0")
    p.add_argument("--slow", action="append", default=[], metavar="INSTANCE",
                   help="deliver to this instance rarely in random schedules (repeatable)")
    p.add_argument("--rounds", choices=("1-2-1", "1-2-1-2", "sink-1-2"), default="1-2-1-2",
                   help="the forced rounds: op 1 -> 2 -> 1 (-> 2), or the sink 1 -> 2 (each sink "
                   "instance keeps its own ids: a record recorded by both is a duplicate)")
    p.add_argument("--keyed", action="store_true",
                   help="the keyed pipeline instead: source -> op -> cnt (keyed, 8 key groups) -> sink, cnt 1 -> 2 "
                   "while op goes 1 -> 2, then both copies leave (key groups move out and back); checked besides: "
                   "each key's state holds each of its records once and in order, no output id twice (--rounds "
                   "and --rehomes do not apply; --keys keys over --records records)")
    p.add_argument("--keys", type=int, default=3, help="keys of the keyed pipeline's records")
    p.add_argument("--event-time", action="store_true",
                   help="with --keyed: watermarks that flow from the source (the record number as event time, "
                   "no disorder); checked besides: no record judged late, the last mark reaches the keeper")
    p.add_argument("--coordination", choices=("ack", "fgme"), default="ack",
                   help="the pipeline's coordination: fgme runs every round inside 2-FGME's locks")
    p.add_argument("--fault", action="append", default=[], choices=FAULTS, help=FAULT_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from foglab.sim.instance_check import Config, describe, explore, random_runs

    plans: Any = (("op-0", "duplicate"), ("copy", "terminate"))
    if args.rounds == "1-2-1-2":
        plans += (("op-0", "duplicate"),)
    elif args.rounds == "sink-1-2":
        plans = (("sink-0", "duplicate"),)
    rehomes = args.rehomes if args.rehomes is not None else (0 if args.rounds == "sink-1-2" or args.keyed else 1)
    if args.keyed and rehomes:
        # a re-homed predecessor deals its group table again over its rebuilt successors, wrong once
        # groups moved (docs/operators.md, "Key groups that move": not covered yet)
        print("error: --keyed takes --rehomes 0", file=sys.stderr)
        return EXIT_USAGE
    if args.event_time and not args.keyed:
        print("error: --event-time needs --keyed", file=sys.stderr)
        return EXIT_USAGE
    if rehomes and args.rounds == "sink-1-2":
        print("error: --rounds sink-1-2 takes --rehomes 0 (see --help)", file=sys.stderr)
        return EXIT_USAGE
    cfg = Config(records=args.records, crashes=args.crashes, rehomes=rehomes, refusals=args.refusals,
                 dups=args.dups, plans=plans, slow=tuple(args.slow), faults=frozenset(args.fault),
                 brokers=args.brokers, cuts=args.cuts, spawn_refusals=args.spawn_refusals,
                 rehome_targets=("op-0", "copy") if args.rehome_copy else ("op-0",), keyed=args.keyed, keys=args.keys,
                 coordination=args.coordination, event_time=args.event_time)
    if args.keyed:
        cfg = replace(cfg, plans=Config.plans)  # the keyed plans (KEYED_PLANS)
    if args.depth:
        rep = explore(cfg, depth=args.depth)
    else:
        rep = random_runs(cfg, schedules=args.schedules, seed=args.seed)
    if args.json:
        v = rep.violations[0] if rep.violations else None
        print(json.dumps({"ok": rep.ok, "states": rep.states, "terminal_states": rep.terminal_states,
                          "schedules": rep.schedules, "steps": rep.steps, "seconds": round(rep.seconds, 2),
                          "seed": rep.seed, "handover": rep.handover, "violation": None if v is None else
                          {"kind": v.kind, "detail": v.detail, "trace": list(v.trace)}}, sort_keys=True))
    else:
        print(describe(rep))
    return EXIT_OK if rep.ok else EXIT_VIOLATION
