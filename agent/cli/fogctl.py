"""`fogctl`: inspect and steer a fog-agent fleet over MQTT (docs/fogctl.md).

Exit statuses (agent.exitcodes, shared with `fog-agent deploy`): 0 ok, 1 error (refused, timed
out, bad config or pipeline), 2 usage, 3 broker unreachable; deploy also 4 (a keeper failed to
start: rolled back) and 5 (rolled back incompletely).
Every error is one line on stderr naming what failed and where; no traceback reaches a person.
Option names mirror mosquitto_sub where it has one (-u/--username, -P/--pw, --cafile, --cert,
--key, --insecure, -i/--id, -k/--keepalive).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, Optional, Sequence

from agent.exitcodes import ERROR as EXIT_ERROR, OK as EXIT_OK, UNREACHABLE as EXIT_UNREACHABLE, USAGE as EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    from agent.fogctl.commands import parse_delta

    parser = argparse.ArgumentParser(prog="fogctl", description="Inspect and steer a fog-agent fleet over MQTT.")
    g = parser.add_argument_group("connection (defaults: ~/.config/fogctl.toml, then FOGCTL_* variables)")
    g.add_argument("--broker", help="host:port of the MQTT broker (default 127.0.0.1:1883)")
    g.add_argument("--host", help="broker host (mosquitto_sub -h); overrides the host of --broker")
    g.add_argument("-p", "--port", type=int, help="broker port (mosquitto_sub -p)")
    g.add_argument("--site", help="talk to this site's broker, from the settings' [sites] table")
    g.add_argument("--cluster", help="cluster name (topic prefix fog/<cluster>), default 'default'")
    g.add_argument("-u", "--username", help="MQTT user name")
    g.add_argument("-P", "--pw", dest="password", help="MQTT password (prefer --pw-file)")
    g.add_argument("--pw-file", dest="password_file", help="file holding the MQTT password")
    g.add_argument("--cafile", help="CA certificate file: enables TLS")
    g.add_argument("--cert", help="client certificate file (TLS)")
    g.add_argument("--key", help="client key file (TLS)")
    g.add_argument("--insecure", action="store_true", default=None, help="do not check the server host name (TLS)")
    g.add_argument("-i", "--id", dest="client_id", help="MQTT client id (default fogctl-<random>)")
    g.add_argument("-k", "--keepalive", type=int, help="MQTT keepalive in seconds")
    g.add_argument("--sign-key", dest="sign_key", metavar="PRIVATE_KEY",
                   help="the admin's Ed25519 private key (PEM): deploy signs the pipeline with it")
    g.add_argument("--timeout", type=float, help="seconds to wait for the broker and for replies (default 5)")
    g.add_argument("--config", help="settings file (default $FOGCTL_CONFIG or ~/.config/fogctl.toml)")
    g.add_argument("--agent-config", dest="agent_config", metavar="AGENT_TOML",
                   help="take broker, cluster, credentials and TLS files from an agent.toml instead")
    parser.add_argument("--json", action="store_true", help="machine-readable JSON output")

    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("status", help="one row per node: online/offline, CPU, memory, temperature, capacity, instances")
    p = sub.add_parser("topology", help="operators and their instances: node, keeper, phase, load, capacity, ratio")
    p.add_argument("pipeline", nargs="?", help="only this pipeline")
    p.add_argument("--tree", action="store_true", help="a tree instead of a table")
    sub.add_parser("latency", help="measured latency matrix (and the configured emulated one)")
    sub.add_parser("locks", help="2-FGME state per boundary: who requests, who is in the CS")
    sub.add_parser("pipelines", help="deployed pipelines and their instance counts")
    sub.add_parser("site", help="the site manager: leader, target, spare, pending action, its last actions and why")
    p = sub.add_parser("watch", help="live scaling and lock events, one line each, with their reason")
    p.add_argument("--filter", action="append", metavar="KEY=VALUE[,VALUE]",
                   help="keep events whose type/node/instance/operator/pipeline matches (repeatable)")
    p.add_argument("--instance", help="shorthand for --filter instance=ID")
    p.add_argument("--all", action="store_true",
                   help="also the periodic 'nothing to do' decisions (default: only events that change something)")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--count", type=int, help="stop after this many events")
    p = sub.add_parser("why", help="the last scaling decisions of one instance, with their reasons")
    p.add_argument("instance")
    p.add_argument("--last", type=int, default=10, help="how many decisions (default 10)")
    p.add_argument("--wait", type=float, default=0.0, help="also listen this many seconds for new decisions")
    p = sub.add_parser("scale", help="manual scaling through the protocol: OPERATOR +N or -N (pins the count)")
    p.add_argument("operator")
    p.add_argument("delta", type=parse_delta, nargs="?", help="+N (duplicate) or -N (scale in)")
    p.add_argument("--pipeline", help="when the operator name exists in several pipelines")
    p.add_argument("--for", dest="for_", metavar="DURATION",
                   help="pin the count this long (90s, 10m, 2h); default: until --release")
    p.add_argument("--release", action="store_true", help="end the pin: the policy decides again")
    p.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the new count")
    p = sub.add_parser("drain", help="empty a node: its instances leave by scale-in, keepers migrate to other nodes")
    p.add_argument("node")
    p.add_argument("--undo", action="store_true", help="accept instances again (undrain)")
    p.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the node to be empty")
    p = sub.add_parser("deploy", help="publish a pipeline (retained) and start its keepers (= fog-agent deploy)")
    p.add_argument("file", metavar="PIPELINE.toml")
    p.add_argument("--keeper-timeout", dest="keeper_timeout", type=float, default=30.0,
                   help="seconds to wait for each keeper to be ready")
    p.add_argument("--agent-config", dest="agent_config", metavar="AGENT_TOML",
                   help="check the pipeline against this node's [operators] modules, as check-config "
                        "--agent-config does (default: $FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml if it exists)")
    p = sub.add_parser("keygen", help="write a new admin key pair for signing pipelines (PRIVATE, PRIVATE.pub)")
    p.add_argument("private", metavar="PRIVATE_KEY", help="where to write the private key (never overwritten)")
    p = sub.add_parser("undeploy", help="stop a pipeline's instances (sources first); every agent forgets them")
    p.add_argument("pipeline", metavar="PIPELINE|PIPELINE.toml")
    p.add_argument("--force", action="store_true",
                   help="also without a description (lost by the broker): stop what the agents' states list")
    p = sub.add_parser("schema", help="the JSON Schema of a command's --json output (docs/fogctl.md, \"JSON output\")")
    p.add_argument("name", nargs="?", metavar="COMMAND",
                   help="a command (status, ..., check-config) or `error`; default: all, by name")
    for choice in sub.choices.values():  # `fogctl status --json` works as well as `fogctl --json status`
        choice.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON output")
    return parser


def _overrides(args: argparse.Namespace) -> Dict[str, Any]:
    from agent.fogctl.config import parse_broker

    broker = args.broker
    if args.host or args.port:
        host, port = parse_broker(broker) if broker else ("127.0.0.1", 1883)
        broker = f"{args.host or host}:{args.port or port}"
    keys = ("cluster", "username", "password", "password_file", "cafile", "cert", "key", "insecure",
            "client_id", "keepalive", "timeout", "sign_key")
    out = {k: getattr(args, k) for k in keys}
    out["broker"] = broker
    return out


def main(argv: Optional[Sequence[str]] = None, connect: Optional[Callable[..., Any]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for usage errors
        return int(exc.code or 0)
    if not args.command:
        parser.print_usage(sys.stderr)
        print("fogctl: error: no command given (see fogctl --help)", file=sys.stderr)
        return EXIT_USAGE

    from pathlib import Path

    from agent.fogctl.client import BrokerUnreachable, Connection, FogctlError
    from agent.fogctl.commands import COMMANDS, Context
    from agent.fogctl.config import load_config
    from agent.control.rpc_schema import RequestError
    from agent.schema import ConfigError

    try:
        # A settings file named on the command line or in $FOGCTL_CONFIG must exist: silently
        # falling back to the defaults would talk to another broker than the one the user chose.
        import os

        if args.config and args.agent_config:
            raise ConfigError("--config", "", "give either --config (a fogctl.toml) or --agent-config "
                              "(an agent.toml), not both")
        named = args.agent_config or args.config or os.environ.get("FOGCTL_CONFIG")
        if named and not Path(named).is_file():
            where = "--agent-config" if args.agent_config else "--config" if args.config else "$FOGCTL_CONFIG"
            raise ConfigError(named, "", f"no such settings file (named by {where})")
        cfg = load_config(_overrides(args), path=Path(args.config) if args.config else None,
                          agent_config=Path(args.agent_config) if args.agent_config else None)
        if args.site is not None:
            from agent.fogctl.config import for_site

            if args.broker or args.host or args.port:
                raise ConfigError("--site", "", "give either --site or --broker/--host/--port, not both")
            cfg = for_site(cfg, args.site)
        ctx = Context(cfg, connect or Connection)
        return COMMANDS[args.command](args, ctx)
    except BrokerUnreachable as exc:
        print(f"fogctl: error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (FogctlError, RequestError, ConfigError, ValueError) as exc:
        print(f"fogctl: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "status", EXIT_ERROR))  # deploy: 4 rolled back, 5 rollback incomplete
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
