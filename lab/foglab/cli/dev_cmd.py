"""`fog-agent dev up|status|down`: a local dev fleet (private broker, N agents) that outlives the command.

The work is in lab/foglab/tools/devfleet.py; this module only parses and prints. `--json` prints one
JSON document alone on stdout; without it, what a person reads (the next commands to type) goes
to stdout and progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict


def register(groups: Any) -> None:
    dev = groups.root.add_parser(
        "dev", help="a local dev fleet: private Mosquitto and N agents in the background (up, status, down)",
        description="A private Mosquitto (plain MQTT on a free loopback port) and N local agents that keep "
        "running after the command; every file (configs, logs, pid files, state) under one directory: "
        "--dir, else $FOG_DEV_DIR, else /tmp/fog-dev-<user>.")
    sub = dev.add_subparsers(dest="dev_command", metavar="up|status|down")
    dev.set_defaults(func=lambda args: _usage(dev))

    u = sub.add_parser("up", help="start the broker and the agents, wait until fogctl sees every agent online")
    u.add_argument("--agents", type=int, default=None, help="how many agents, n1..nN (default 3)")
    u.add_argument("--cluster", default=None, help="cluster name (default dev)")
    u.add_argument("--allow", action="append", default=[], metavar="MODULE",
                   help="also allow this operator module on every agent (on your PYTHONPATH); repeatable")
    u.set_defaults(func=up_cmd)
    s = sub.add_parser("status", help="which processes run and what fogctl says of each agent")
    s.set_defaults(func=status_cmd)
    d = sub.add_parser("down", help="stop the agents, then the broker; logs and configs stay")
    d.add_argument("--purge", action="store_true", help="also remove the directory and everything in it")
    d.set_defaults(func=down_cmd)
    for p in (u, s, d):
        p.add_argument("--dir", default=None, help="the fleet's directory (default $FOG_DEV_DIR or /tmp/fog-dev-<user>)")
        p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _dir(args: argparse.Namespace) -> Path:
    from foglab.tools.devfleet import default_dir

    return Path(args.dir) if args.dir else default_dir()


def _print_json(doc: Dict[str, Any]) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=True)
    print()


def _fail(exc: Exception) -> int:
    print(f"fog-agent dev: error: {exc}", file=sys.stderr)
    return 1


def up_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import devfleet

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        doc = devfleet.up(_dir(args), agents=args.agents, cluster=args.cluster, allow=args.allow, say=say)
    except devfleet.DevError as exc:
        return _fail(exc)
    if args.json:
        _print_json(doc)
        return 0
    nodes = " ".join(n["node"] for n in doc["nodes"])
    head = (f"dev fleet up in {doc['seconds']:.1f} s" if doc["state"] == "up" else "dev fleet already up")
    print(f"{head}: broker {doc['broker']} (cluster {doc['cluster']}), agents {nodes} online; files in {doc['dir']}")
    print("next:")
    print(devfleet.next_steps(doc, default=args.dir is None))
    return 0


def status_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import devfleet

    try:
        doc = devfleet.status(_dir(args))
    except devfleet.DevError as exc:
        return _fail(exc)
    if args.json:
        _print_json(doc)
    else:
        bpid = doc["broker_pid"]
        print(f"dev fleet in {doc['dir']}: {doc['state']}; broker {doc['broker']} "
              f"{'pid ' + str(bpid) if bpid else 'stopped'}, cluster {doc['cluster']}")
        for row in doc["nodes"]:
            print(f"  {row['node']:<4} {('pid ' + str(row['pid'])) if row['pid'] else 'no process':<12} "
                  f"{row['status']:<8} log {row['log']}")
        if doc.get("error"):
            print(f"  fogctl: {doc['error']}")
    return 0 if doc["state"] == "up" else 1


def down_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import devfleet

    try:
        doc = devfleet.down(_dir(args), purge=args.purge)
    except devfleet.DevError as exc:
        return _fail(exc)
    if args.json:
        _print_json(doc)
    elif doc.get("note"):
        print(f"{doc['note']} ({doc['dir']}): nothing to stop")
    else:
        what = f"stopped {', '.join(doc['stopped'])}" if doc["stopped"] else "nothing was running"
        killed = f"; killed after the grace time: {', '.join(doc['killed'])}" if doc["killed"] else ""
        kept = "removed" if doc["purged"] else "logs and configs kept"
        print(f"dev fleet down: {what}{killed}; no process left; {doc['dir']} {kept}")
    return 0
