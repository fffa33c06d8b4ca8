"""`fog-agent rollout-gate snapshot|wait`: the fog_agent role's health gate between serial batches.

`snapshot` (before the role's handlers may restart the agent) prints what the node hosts now and
the time; `wait --snapshot JSON` (after a restart the role made) returns once the node is online
again with those instances running, or fails after `--timeout` naming the node and what is
missing (agent.fogctl.rollout_gate). Both read the broker's retained records as the node itself,
with `fogctl --agent-config`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from agent.exitcodes import ERROR, OK


def register(groups: Any) -> None:
    p = groups.root.add_parser("rollout-gate", help="health gate of a rolling change: snapshot what a node "
                               "hosts, then wait until it is online with those instances running again")
    sub = p.add_subparsers(dest="gate_step", metavar="STEP")
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])
    for name, help_ in (("snapshot", "print {node, at, before} as JSON: the node's instances now"),
                        ("wait", "wait until the node of --snapshot is back (exit 1 after --timeout)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--node", required=True, help="the node's name (agent.toml [agent] node)")
        s.add_argument("--agent-config", default=os.environ.get("FOG_AGENT_CONFIG", "/etc/fog-agent/agent.toml"),
                       help="the node's agent.toml: broker, cluster and credentials to read with")
        s.add_argument("--fogctl", default=None, help="fogctl to run (default: the one beside this fog-agent)")
        s.set_defaults(func=_cmd, step=name)
        if name == "wait":
            s.add_argument("--snapshot", required=True, help="the JSON `snapshot` printed before the restart")
            s.add_argument("--timeout", type=float, default=300.0, help="seconds before the rollout fails")
            s.add_argument("--period", type=float, default=2.0, help="seconds between two reads")


def _fogctl(given: str | None) -> str:
    if given:
        return given
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "fogctl")
    return beside if os.path.exists(beside) else (shutil.which("fogctl") or "fogctl")


def _cmd(args: argparse.Namespace) -> int:
    from agent.fogctl import rollout_gate as gate

    read = gate.fogctl_reader(_fogctl(args.fogctl), args.agent_config)
    if args.step == "snapshot":
        at = time.time()
        print(json.dumps({"node": args.node, "at": at, "before": gate.hosted_before(read(), args.node)}))
        return OK
    try:
        snap = json.loads(args.snapshot)
        before, at = [str(i) for i in snap["before"]], float(snap["at"])
    except (ValueError, KeyError, TypeError) as exc:
        print(f"rollout-gate: --snapshot: expected the JSON of `rollout-gate snapshot` ({exc})", file=sys.stderr)
        return ERROR
    # A state counts only if published after this command started, not after the snapshot: the
    # old process can still publish while it drains (its instances listed, status online), after
    # the snapshot; the role runs this after systemd's restart returned, when the old process is
    # gone. The price: up to one state period of the agent's (5 s by default) waiting for a state.
    since = max(at, time.time())
    started = time.monotonic()
    result = gate.wait(read, args.node, before, since, args.timeout, period=args.period)
    took = time.monotonic() - started
    if result.ready:
        print(f"{result.reason} ({took:.1f} s)")
        return OK
    print(f"rollout-gate: {args.node} not healthy after {args.timeout:g} s: {result.reason}", file=sys.stderr)
    return ERROR
