"""The `fog-agent` command: daemon, tools, simulators and benchmarks as subcommands.

Each area of the project owns one module in `agent.cli` with a `register(groups)` function that
adds its subcommands; this file only wires them together, so that areas never edit each other's
command code. A subcommand handler takes the parsed namespace and returns the exit status.
Modules are imported lazily-by-listing: a module missing from a partial install (for example the
analytics commands on a Pi without PySpark) must still register; it imports heavy libraries inside
its handler, not at module level.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from agent import __version__
from agent.exitcodes import ERROR as EXIT_ERROR, OK as EXIT_OK, USAGE as EXIT_USAGE

# One entry per area; order is the order in `--help`.
COMMAND_MODULES = (
    "agent.cli.config_cmd",    # check-config
    "agent.cli.runtime_cmd",   # run, deploy, demo, bench dataplane
    "agent.cli.scaling_cmd",   # simulate scaling, bench sim
    "agent.cli.gme_cmd",       # simulate gme, bench gme
    "agent.cli.instance_check_cmd",  # simulate instance
    "agent.cli.measure_cmd",   # calibrate, netem, simulate policies
    "agent.cli.spill_cmd",     # collector, analytics
    "agent.cli.chaos_cmd",     # chaos
    "agent.cli.fuzz_cmd",      # bench fuzz
    "agent.cli.testbed_cmd",   # testbed up/down/ssh
    "agent.cli.dev_cmd",       # dev up/status/down
    "agent.cli.rollout_cmd",   # rollout-gate (the fog_agent role's health gate)
)

# `fog-agent run`, the daemon, gets a parser with `run` alone: it runs for days on a node whose
# memory is budgeted (every process under 40 MB, docs/runtime.md "Memory"), and importing every
# area's commands (simulators, benchmarks, lab tools, for their choices lists) kept about 10 MB of
# modules it never uses resident in it for its whole life.
DAEMON = ("run", "agent.cli.runtime_cmd", "register_run")

LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports it


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C.

    Why: Python's default SIGTERM action kills the process without running a `finally`, so a
    `fog-agent demo`, `chaos` or `bench` stopped by `timeout`, systemd or a CI cancel left its
    private Mosquitto, agents and workers running. As a KeyboardInterrupt it unwinds through
    the same cleanup as Ctrl-C. Commands with a SIGTERM plan of their own (the daemon `run`,
    the collector) install their handler later, which replaces this one."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


@dataclass
class Groups:
    """The subparser collections an area may add commands to."""

    root: "argparse._SubParsersAction"
    simulate: "argparse._SubParsersAction"
    bench: "argparse._SubParsersAction"


Handler = Callable[[argparse.Namespace], int]


def _command_of(argv: Sequence[str]) -> Optional[str]:
    """The subcommand `argv` names, if only `--log-level` comes before it; else None."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-level":
            i += 2
        elif arg.startswith("--log-level="):
            i += 1
        else:
            return None if arg.startswith("-") else arg
    return None


def build_parser(daemon: bool = False) -> argparse.ArgumentParser:
    """The whole command line, or with `daemon` the `run` command alone (see `DAEMON`)."""
    parser = argparse.ArgumentParser(
        prog="fog-agent",
        description="Fog node agent: hosts operator instances that scale themselves "
        "(decentralized protocol of Belkhiria & Tedeschi) and talk over MQTT.",
    )
    parser.add_argument("--version", action="version", version=f"fog-agent {__version__}")
    parser.add_argument(
        "--log-level", default=None, type=str.lower, choices=LOG_LEVELS,
        help="debug, info, warning or error (default: info, or $FOG_AGENT_LOG_LEVEL)",
    )
    root = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = root.add_parser("simulate", help="run a simulator (scaling, gme, policies)")
    bench = root.add_parser("bench", help="run a benchmark that prints figures")
    groups = Groups(
        root=root,
        simulate=sim.add_subparsers(dest="simulation", metavar="SIMULATION"),
        bench=bench.add_subparsers(dest="benchmark", metavar="BENCHMARK"),
    )
    for parent in (sim, bench):
        parent.set_defaults(func=lambda args, p=parent: _usage(p))
    if daemon:
        getattr(importlib.import_module(DAEMON[1]), DAEMON[2])(groups)
        return parser
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module: do not hide it
                raise
            continue
        module.register(groups)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def main(argv: Optional[Sequence[str]] = None) -> int:
    from agent.log import setup_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(daemon=_command_of(argv) == DAEMON[0])
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    func: Optional[Handler] = getattr(args, "func", None)
    if func is None:
        return _usage(parser)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return int(func(args) or 0)
    except Terminated:
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
