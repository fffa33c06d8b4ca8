"""`fog-agent run`, `fog-agent deploy`, `fog-agent demo` (and `bench dataplane`, `bench keyed` from the data path)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
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
    d.set_defaults(func=deploy_cmd)

    m = groups.root.add_parser("demo", help="three agents on a private broker scale a taxi pipeline live")
    m.add_argument("--duration", type=float, default=None, help="seconds of load profile (default from the pipeline)")
    m.add_argument("--pipeline", default=None, help="pipeline file (default examples/demo-pipeline.toml)")
    m.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    m.add_argument("--plot", default=None, help="PNG path of the plot (default demo-<time>.png in the work dir)")
    m.add_argument("--workdir", default=None, help="keep broker, agent logs and sink files here")
    m.add_argument("--quiet", action="store_true", help="no live table")
    m.add_argument("--no-analytics", action="store_true", help="skip the final analytics step (PySpark)")
    m.set_defaults(func=demo_cmd)

    b = groups.bench.add_parser("rescale", help="decision -> first record of the new instance through the real "
                                "daemon, workers forked from the fork server and started cold")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.add_argument("--rate", type=float, default=500.0, help="records/s of the load step")
    b.set_defaults(func=bench_rescale_cmd)

    sp = groups.bench.add_parser("spawn", help="start -> ready of a burst of workers forked from the agent's "
                                 "fork server vs started cold (same run)")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    sp.add_argument("--burst", type=int, default=3, help="workers started at once (default 3)")
    sp.add_argument("--rounds", type=int, default=5, help="bursts per mode (default 5)")
    sp.set_defaults(func=bench_spawn_cmd)

    mv = groups.bench.add_parser("move", help="move a node's instances (drain, re-home): seconds to the first "
                                 "record through each moved instance, per-node inboxes against the shared format")
    mv.add_argument("--json", action="store_true", help="print the result as JSON")
    mv.add_argument("--runs", type=int, default=2, help="moves of each kind in each format (alternated)")
    mv.add_argument("--kinds", default="drain,rehome", help="comma-separated: drain, rehome")
    mv.add_argument("--rate", type=float, default=200.0, help="records/s of the source")
    mv.add_argument("--workdir", default=None, help="keep broker, agent logs and sink files here")
    mv.set_defaults(func=bench_move_cmd)

    # The benchmarks live in agent.tools, which a fog node's package may leave out.
    for name in ("agent.tools.dataplane_bench", "agent.tools.keyed_bench", "agent.tools.handover_bench",
                 "agent.tools.fleet_bench"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
        else:
            module.register_bench(groups)


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
    from agent.node.rpc import RpcError
    from agent.pipeline_check import check_text
    from agent.schema import ConfigError

    try:  # first, before any broker: a missing file is one line naming it, not an errno
        text = Path(args.pipeline).read_text()
    except OSError as exc:
        print(f"error: cannot read pipeline file {args.pipeline}: {exc.strerror or exc}", file=sys.stderr)
        return exitcodes.ERROR
    _, report = check_text(text, args.pipeline, args.config)
    for problem in report.errors:  # warnings (scaling notes, functions left to the nodes): check-config's
        print(f"error: {problem.message}", file=sys.stderr)
    if not report.ok:
        return exitcodes.ERROR
    host, port, cluster, user, password, tls = "127.0.0.1", 1883, "default", None, None, None
    try:
        if args.config or (args.host is None and args.port is None):
            try:
                cfg = _load_cfg(args.config)
                host, port, cluster = cfg.mqtt.host, cfg.mqtt.port, cfg.agent.cluster
                user, password, tls = cfg.mqtt.username, resolve_password(cfg.mqtt), cfg.mqtt.tls
            except ConfigError:
                if args.config:
                    raise
        host = args.host or host
        port = args.port or port
        cluster = args.cluster or cluster
        placed = deploy(text, host, port, cluster, extra=_parse_extra(args.extra), policy_name=args.placement,
                        timeout=args.timeout, username=user, password=password, name=Path(args.pipeline).name,
                        tls=tls)
    except BrokerUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.UNREACHABLE
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(getattr(exc, "status", exitcodes.ERROR))  # 4 rolled back, 5 rollback incomplete
    except (ConfigError, RpcError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.ERROR
    for d in placed:
        print(f"{d.operator:<12} {d.instance:<28} on {d.node}")
    return exitcodes.OK


def demo_cmd(args: argparse.Namespace) -> int:
    from agent.tools import demo

    return demo.main(args)


def bench_rescale_cmd(args: argparse.Namespace) -> int:
    from agent.tools import demo

    from agent.log import stdout_to_stderr

    with stdout_to_stderr() if args.json else contextlib.nullcontext():  # --json: stdout is the JSON alone
        result = demo.bench_rescale(rate=args.rate)
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        for mode in ("warm", "cold"):
            r = result[mode]
            d = r["decision_to_first_record_s"]
            sr = r["start_to_ready_s"]
            print(f"{mode:<5} start -> ready: median {sr['median']} s, max {sr['max']} s | scale-outs "
                  f"{r['scale_outs']:>3}, decision -> first record: median {d['median']} s, max {d['max']} s "
                  f"(lost {r['lost']}, duplicated {r['duplicated']})")
    ok = all(result[m]["lost"] == 0 and result[m]["duplicated"] == 0 for m in ("warm", "cold"))
    return 0 if ok else 3


def bench_spawn_cmd(args: argparse.Namespace) -> int:
    from agent.log import stdout_to_stderr
    from agent.tools import demo

    if args.burst < 1 or args.rounds < 1:
        print("fog-agent bench spawn: --burst and --rounds take 1 or more", file=sys.stderr)
        return 2
    with stdout_to_stderr() if args.json else contextlib.nullcontext():
        result = demo.bench_spawn(burst=args.burst, rounds=args.rounds)
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        for mode in ("forked", "cold"):
            r = result[mode]["start_to_ready_s"]
            print(f"{mode:<6} bursts of {result['burst']}: start -> ready median {r['median']} s, max {r['max']} s "
                  f"({r['n']} starts)")
        print(f"cold / forked: median x{result['cold_over_forked']['median']}, max x{result['cold_over_forked']['max']}")
    return 0


def bench_move_cmd(args: argparse.Namespace) -> int:
    from agent.log import stdout_to_stderr
    from agent.tools import move_bench

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad = [k for k in kinds if k not in ("drain", "rehome")]
    if bad or args.runs < 1:
        print(f"fog-agent bench move: --kinds takes drain and/or rehome (got {args.kinds!r}), --runs >= 1",
              file=sys.stderr)
        return 2
    with stdout_to_stderr() if args.json else contextlib.nullcontext():
        result = move_bench.bench_move(args.runs, kinds, args.rate, Path(args.workdir) if args.workdir else None)
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        for key, r in sorted(result["summary"].items()):
            print(f"{key:<18} move -> first record through every moved instance: median {r['all_moved_s_median']} s "
                  f"(runs {r['all_moved_s']}); lost {r['lost']}, duplicated {r['duplicated']}")
    ok = all(r["lost"] == 0 and r["duplicated"] == 0 for r in result["summary"].values())
    return 0 if ok else 3
