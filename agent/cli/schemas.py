"""The `--json` shapes of `fog-agent`'s commands: one JSON Schema (draft 2020-12) per command.

The node's commands are here: `calibrate`, and `check-config` and `deploy`, whose shapes fogctl
shares (agent/fogctl/schemas.py, where they are defined with the error shape). The lab's commands
(`dev up`, `chaos`, `bench ...`, `simulate ...`, `testbed ...`) keep theirs in the lab
(lab/foglab/cli/schemas.py): the node's package carries no lab code, so `all_schemas()` lists
them only where the lab is installed, through the one hook that finds the lab's commands
(agent.cli.main._lab_cli).

A schema is named as the command is typed after `fog-agent` ("calibrate", "dev status", "bench
fuzz"); `fog-agent schema COMMAND` prints one. The section "JSON output" of docs/measurement.md
is generated from them (`python -m agent.cli.schemas`), and tests/test_json_shapes.py and
tests/test_lab_json_shapes.py validate each against its command's output. The conventions are
fogctl's: every key listed is printed unless the row says "optional"; an object the command
builds itself has no other key.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any, Dict, Optional, Sequence

from agent.fogctl.schemas import BOOL, DIALECT, INT, NUM, S, SCHEMAS as FOGCTL_SCHEMAS, _d, _list, _obj, markdown

__all__ = ["SCHEMAS", "all_schemas", "schema", "main"]

CALIBRATE = _obj({
    "node": _d(S, "the node the capacity is stored for"),
    "operator": S,
    "capacity": _d(NUM, "records/s one instance sustains here (the store's value)"),
    "saturated": _d(BOOL, "false: --max-rate was reached without lag, capacity is a lower bound"),
    "steps": _list(_obj({
        "rate": _d(NUM, "input rate offered, records/s"), "offered": INT, "processed": INT,
        "elapsed": _d(NUM, "seconds"), "lagging": _d(BOOL, "the output fell behind at this rate"),
    }), "the rising input rates, in order"),
})

_NODE: Dict[str, Dict[str, Any]] = {
    "calibrate": {"$schema": DIALECT, "title": "fog-agent calibrate --json", **CALIBRATE},
}

# The node's schemas: its own, and the ones it shares with fogctl (documented in docs/fogctl.md).
SHARED = ("check-config", "deploy", "error")
SCHEMAS: Dict[str, Dict[str, Any]] = dict(_NODE, **{name: FOGCTL_SCHEMAS[name] for name in SHARED})


def all_schemas() -> Dict[str, Dict[str, Any]]:
    """The node's schemas, and the lab's where the lab is installed."""
    from agent.cli.main import _lab_cli

    lab = _lab_cli()
    return dict(SCHEMAS, **(lab.json_schemas() if lab is not None else {}))


def schema(command: str) -> Dict[str, Any]:
    """The schema of `command` ("calibrate", "dev status", "check-config", ...), a copy."""
    known = all_schemas()
    try:
        return copy.deepcopy(known[command])
    except KeyError:
        raise KeyError(f"no JSON schema for {command!r} (known: {', '.join(known)})") from None


def documented() -> Dict[str, Dict[str, Any]]:
    """The schemas the section of docs/measurement.md shows: all but those of docs/fogctl.md."""
    return {name: s for name, s in all_schemas().items() if name not in SHARED}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m agent.cli.schemas`: the generated docs section; with a name, that schema."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args:
        print(json.dumps(schema(" ".join(args)), indent=2))
    else:
        print(markdown(documented()), end="")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
