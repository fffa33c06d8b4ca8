"""`fog-agent run` (the node's daemon) and `fog-agent deploy`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List


# The placement policies of agent/node/placement.py (POLICIES), listed here so that `--help`
# and argparse check the name without importing the runtime for every command.
PLACEMENTS = ("free-slots-then-latency", "spread", "local-only", "nd-max")


def register(groups: Any) -> None:
    register_run(groups)
    _register_tools(groups)


def register_run(groups: Any) -> None:
    """`run` alone: what the daemon's parser needs (agent.cli.main, `DAEMON`)."""
    p = groups.root.add_parser("run", help="run the per-node agent daemon (hosts operator instances)")
    p.add_argument("--config", "-c", default=None, help="agent.toml (default: $FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml)")
    p.add_argument("--placement", default=None, choices=PLACEMENTS, help="placement policy (default free-slots-then-latency)")
    p.add_argument("--no-warm-worker", action="store_true",
                   help="start every worker cold instead of forking it from the fork server")
    # Tests replace the worker program (a fake speaking the control contract): JSON list of argv.
    p.add_argument("--worker-command", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run_cmd)


def _register_tools(groups: Any) -> None:
    d = groups.root.add_parser("deploy", help="publish a pipeline and start its keepers through placement")
    d.add_argument("pipeline", help="pipeline .toml file")
    d.add_argument("--config", "-c", default=None,
                   help="agent.toml to take the broker and cluster from, and whose [operators] modules the "
                        "pipeline is checked against, as check-config --agent-config does (default: "
                        "$FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml if it exists)")
    d.add_argument("--host", default=None, help="broker host (overrides the config)")
    d.add_argument("--port", type=int, default=None, help="broker port (overrides the config)")
    d.add_argument("--cluster", default=None, help="cluster name (overrides the config)")
    d.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="extra value passed to every instance's spec (e.g. sink_dir=/tmp/sink)")
    d.add_argument("--placement", default="free-slots-then-latency", choices=PLACEMENTS,
                   help="placement policy for the keepers")
    d.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each keeper")
    d.add_argument("--sign-key", dest="sign_key", default=os.environ.get("FOG_AGENT_SIGN_KEY") or None,
                   metavar="PRIVATE_KEY",
                   help="the admin's Ed25519 private key (PEM) to sign the pipeline with; agents with "
                        "[security] admin_keys run only signed pipelines (default $FOG_AGENT_SIGN_KEY)")
    d.add_argument("--json", action="store_true",
                   help="print the result as fogctl deploy --json does (docs/fogctl.md, \"JSON output\")")
    d.set_defaults(func=deploy_cmd)



def _load_cfg(path: Any) -> Any:
    from agent.config import default_config_path, load_agent_config

    return load_agent_config(path or default_config_path())


def run_cmd(args: argparse.Namespace) -> int:
    from agent.log import setup_logging
    from agent.node import daemon
    from agent.node.placement import DEFAULT_POLICY
    from agent.schema import ConfigError

    try:
        cfg = _load_cfg(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return daemon.EXIT_CONFIG
    setup_logging(args.log_level or cfg.log.level, cfg.log.format)
    try:
        command = json.loads(args.worker_command) if args.worker_command else None
        return daemon.run_agent(cfg, args.placement or DEFAULT_POLICY, worker_command=command,
                                warm_worker=not args.no_warm_worker)
    except ValueError as exc:  # unknown placement policy
        print(f"error: {exc}", file=sys.stderr)
        return daemon.EXIT_CONFIG


def _parse_extra(items: List[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, found {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def deploy_cmd(args: argparse.Namespace) -> int:
    """Check the pipeline as check-config does (agent.pipeline_check, the same lines; nothing is
    started on a problem), then deploy. Exit statuses: agent.exitcodes, shared with fogctl."""
    from agent import exitcodes
    from agent.config import resolve_password
    from agent.mqtt.requester import BrokerUnreachable
    from agent.node.deploy import DeployError, deploy
    from agent.node.deploy import RpcError
    from agent.pipeline_check import check_text
    from agent.schema import ConfigError

    try:  # first, before any broker: a missing file is one line naming it, not an errno
        text = Path(args.pipeline).read_text()
    except OSError as exc:
        print(f"error: cannot read pipeline file {args.pipeline}: {exc.strerror or exc}", file=sys.stderr)
        return exitcodes.ERROR
    checked, report = check_text(text, args.pipeline, args.config)
    for problem in report.errors:  # warnings (scaling notes, functions left to the nodes): check-config's
        print(f"error: {problem.message}", file=sys.stderr)
    if not report.ok:
        if args.json:  # the error shape, as fogctl deploy --json and check-config --json print it
            print(json.dumps({"ok": False, "errors": [p.to_json() for p in report.errors]}, indent=2, sort_keys=True))
        return exitcodes.ERROR
    host, port, cluster, user, password, tls = "127.0.0.1", 1883, "default", None, None, None
    node_slots = None
    signer = None
    if args.sign_key:  # before any broker: a bad key file starts nothing
        from agent.signing import load_signer

        try:
            signer = load_signer(args.sign_key)
        except ValueError as exc:
            print(f"error: --sign-key {args.sign_key}: {exc}", file=sys.stderr)
            return exitcodes.ERROR
    try:
        if args.config or (args.host is None and args.port is None):
            try:
                cfg = _load_cfg(args.config)
                host, port, cluster = cfg.mqtt.host, cfg.mqtt.port, cfg.agent.cluster
                user, password, tls = cfg.mqtt.username, resolve_password(cfg.mqtt), cfg.mqtt.tls
                node_slots = cfg.security.node_slots
            except ConfigError:
                if args.config:
                    raise
        host = args.host or host
        port = args.port or port
        cluster = args.cluster or cluster
        placed = deploy(text, host, port, cluster, extra=_parse_extra(args.extra), policy_name=args.placement,
                        timeout=args.timeout, username=user, password=password, name=Path(args.pipeline).name,
                        tls=tls, signer=signer, node_slots=node_slots)
    except BrokerUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.UNREACHABLE
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(getattr(exc, "status", exitcodes.ERROR))  # 4 rolled back, 5 rollback incomplete
    except (ConfigError, RpcError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.ERROR
    if args.json:  # fogctl deploy --json's document (agent.fogctl.schemas, "deploy")
        from agent import topics

        name = checked.pipeline.name
        print(json.dumps({"ok": True, "pipeline": name, "topic": topics.pipeline(cluster, name),
                          "keepers": [{"operator": d.operator, "instance": d.instance, "node": d.node} for d in placed]},
                         indent=2, sort_keys=True))
        return exitcodes.OK
    for d in placed:
        print(f"{d.operator:<12} {d.instance:<28} on {d.node}")
    return exitcodes.OK
