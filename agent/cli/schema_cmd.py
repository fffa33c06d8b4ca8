"""`fog-agent schema [COMMAND ...]`: the JSON Schema of a command's `--json` output.

The schemas are agent/cli/schemas.py's (the node's commands) and, where the lab is installed,
lab/foglab/cli/schemas.py's; docs/measurement.md, "JSON output", shows them as tables. No broker;
always JSON. The command is named as it is typed: `fog-agent schema dev status`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agent.exitcodes import ERROR, OK


def register(groups: Any) -> None:
    p = groups.root.add_parser("schema", help="the JSON Schema of a command's --json output "
                               "(docs/measurement.md, \"JSON output\"); without COMMAND, all of them by name")
    p.add_argument("name", nargs="*", metavar="COMMAND", help="e.g. calibrate, dev status, bench fuzz")
    p.set_defaults(func=cmd_schema)


def cmd_schema(args: argparse.Namespace) -> int:
    from agent.cli.schemas import all_schemas, schema

    try:
        doc = schema(" ".join(args.name)) if args.name else all_schemas()
    except KeyError as exc:
        print(f"fog-agent schema: {exc.args[0]}", file=sys.stderr)
        return ERROR
    print(json.dumps(doc, indent=2))
    return OK
