"""The exit statuses of the fleet commands: `fogctl` (every command), `fog-agent deploy` and
`fog-agent check-config` (docs/fogctl.md, "Exit statuses").

Why one module: `fog-agent deploy` and `fogctl deploy` run the same transaction
(agent.node.deploy.run_deploy) and a script must not have to know which of the two ran it to
tell "nothing happened, fix the file" from "the broker is away" from "it started half-way and
was rolled back". Both used to differ (a rollback was 1 for one and 4 for the other).

The commands that verify records (`fog-agent chaos`, `demo`, the benches) keep their own verdict
statuses (3: a record lost or duplicated); the daemon (`fog-agent run`) keeps the sysexits codes
systemd acts on (78, 69).
"""

from __future__ import annotations

OK = 0
ERROR = 1  # invalid input (a pipeline or settings file, an argument's value), a refusal, a reply timeout
USAGE = 2  # the command line itself (argparse)
UNREACHABLE = 3  # no connection to the MQTT broker
ROLLED_BACK = 4  # deploy: a keeper could not start; the started ones were stopped, the record is a tombstone
ROLLBACK_INCOMPLETE = 5  # deploy: as 4, but a stop failed too (the message names what still runs)

# The table docs/fogctl.md prints, in order (tests compare the two).
TABLE = (
    (OK, "ok"),
    (ERROR, "error: invalid input (a pipeline or settings file), a refused request, a reply timeout"),
    (USAGE, "usage: the command line itself"),
    (UNREACHABLE, "the MQTT broker is unreachable"),
    (ROLLED_BACK, "deploy: a keeper could not start, the started ones were stopped (rolled back)"),
    (ROLLBACK_INCOMPLETE, "deploy: rolled back, but a stop failed (the message names what still runs)"),
)

__all__ = ["ERROR", "OK", "ROLLBACK_INCOMPLETE", "ROLLED_BACK", "TABLE", "UNREACHABLE", "USAGE"]
