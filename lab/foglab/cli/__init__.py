"""The lab's `fog-agent` commands: `demo`, `chaos`, `testbed`, `dev`, and every `simulate` and
`bench`.

agent.cli.main imports this package (its one import of the lab) and calls `register` with the
same groups the node's command modules get; without the lab installed it lists these commands
with a line saying how to install it. Each module below owns one area, as the node's modules in
agent.cli do, and imports its heavy libraries inside its handlers.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

# One entry per area; order is the order in `--help`, after the node's commands.
COMMAND_MODULES = (
    "foglab.cli.demo_cmd",            # demo, bench rescale|spawn|move|dataplane|keyed|handover|fleet
    "foglab.cli.scaling_cmd",         # simulate scaling, bench sim
    "foglab.cli.gme_cmd",             # simulate gme, bench gme
    "foglab.cli.instance_check_cmd",  # simulate instance
    "foglab.cli.policies_cmd",        # simulate policies, bench policies, bench latency
    "foglab.cli.spill_bench_cmd",     # bench spill, bench analytics
    "foglab.cli.chaos_cmd",           # chaos
    "foglab.cli.fuzz_cmd",            # bench fuzz
    "foglab.cli.testbed_cmd",         # testbed up/down/ssh/...
    "foglab.cli.dev_cmd",             # dev up/status/down
)

def register(groups: Any) -> None:
    """Add every lab command to `groups` (agent.cli.main.Groups)."""
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(groups)


def json_schemas() -> Dict[str, Any]:
    """The JSON Schemas of the lab commands' `--json` output, by command (foglab.cli.schemas);
    `fog-agent schema` lists them with the node's."""
    from foglab.cli.schemas import SCHEMAS

    return SCHEMAS
