"""The `fog-agent` command: the node's commands, and the lab's where the lab is installed.

Each area of the project owns one module in `agent.cli` with a `register(groups)` function that
adds its subcommands; this file only wires them together, so that areas never edit each other's
command code. A subcommand handler takes the parsed namespace and returns the exit status.
Modules are imported lazily-by-listing: a module missing from a partial install (for example the
analytics commands on a Pi without PySpark) must still register; it imports heavy libraries inside
its handler, not at module level.

The lab (simulators, checkers, benchmarks, demo, chaos, testbed: the `fog-agent-lab`
distribution in lab/, package `foglab`) is not in the node's wheel or .deb. `_lab_cli` is the one
place the `agent` package imports it (tests/test_layout.py holds every other module to that):
where it is installed, `foglab.cli.register` adds its commands to the same groups; where it is
not, `simulate`, `bench` and the lab's top-level commands each say how to install it.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional, Sequence

from agent import __version__
from agent.exitcodes import ERROR as EXIT_ERROR, OK as EXIT_OK, USAGE as EXIT_USAGE

# One entry per area; order is the order in `--help`.
COMMAND_MODULES = (
    "agent.cli.config_cmd",    # check-config
    "agent.cli.runtime_cmd",   # run, deploy
    "agent.cli.measure_cmd",   # calibrate, netem
    "agent.cli.spill_cmd",     # collector, analytics
    "agent.cli.rollout_cmd",   # rollout-gate (the fog_agent role's health gate)
    "agent.cli.schema_cmd",    # schema (the JSON Schemas of every --json output)
)

# The lab's command package, and its top-level commands (the others are under `simulate` and
# `bench`), named here so that a node without the lab still answers `fog-agent demo` with what to
# install (tests/test_cli_lab.py checks the list against what foglab.cli registers).
LAB_CLI = "foglab.cli"
LAB_COMMANDS = ("demo", "chaos", "testbed", "dev")
LAB_MISSING = ("this command is in the lab, which is not installed here: install fog-agent-lab "
               "(pip install ./lab from a fog-agent checkout; `make setup` installs both)")
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
    """The subparser collections an area may add commands to. `simulate` and `bench` hold lab
    commands only: None where the lab is not installed."""

    root: "argparse._SubParsersAction"
    simulate: "Optional[argparse._SubParsersAction]"
    bench: "Optional[argparse._SubParsersAction]"


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
    if daemon:
        groups = Groups(root=root, simulate=None, bench=None)
        getattr(importlib.import_module(DAEMON[1]), DAEMON[2])(groups)
        return parser
    lab = _lab_cli()
    missing = "" if lab is not None else " (fog-agent-lab: not installed)"
    sim = root.add_parser("simulate", help="run a simulator (scaling, gme, policies)" + missing, add_help=lab is not None)
    bench = root.add_parser("bench", help="run a benchmark that prints figures" + missing, add_help=lab is not None)
    if lab is None:
        # Whatever follows the command, these answer with LAB_MISSING (main() lets them have it).
        stubs = [sim, bench] + [root.add_parser(name, help="a lab command" + missing, add_help=False)
                                for name in LAB_COMMANDS]
        for stub in stubs:
            stub.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            stub.set_defaults(func=_lab_missing)
        groups = Groups(root=root, simulate=None, bench=None)
    else:
        groups = Groups(
            root=root,
            simulate=sim.add_subparsers(dest="simulation", metavar="SIMULATION"),
            bench=bench.add_subparsers(dest="benchmark", metavar="BENCHMARK"),
        )
        for parent in (sim, bench):
            parent.set_defaults(func=lambda args, p=parent: _usage(p))
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module: do not hide it
                raise
            continue
        module.register(groups)
    if lab is not None:
        lab.register(groups)
    return parser


def _lab_cli() -> Optional[ModuleType]:
    """`foglab.cli`, or None where fog-agent-lab is not installed (a node's .deb).

    Why here and nowhere else: the node's package must run without the lab, so no other module
    of `agent` imports `foglab` (tests/test_layout.py); this hook only finds the lab's commands."""
    try:
        import foglab.cli
    except ModuleNotFoundError as exc:
        if exc.name not in ("foglab", LAB_CLI):  # a broken lab install: do not hide it
            raise
        return None
    return foglab.cli


def _lab_missing(args: argparse.Namespace) -> int:
    print(f"fog-agent {args.command}: {LAB_MISSING}", file=sys.stderr)
    return EXIT_USAGE


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def main(argv: Optional[Sequence[str]] = None) -> int:
    from agent.log import setup_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(daemon=_command_of(argv) == DAEMON[0])
    args, unknown = parser.parse_known_args(argv)
    if unknown and getattr(args, "func", None) is not _lab_missing:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # as parse_args: exit 2
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
