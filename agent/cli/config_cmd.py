"""`fog-agent check-config FILE`: validate an agent or pipeline file and print the effective values.

A pipeline is also checked against THIS node's operator allow-list (docs/security.md, "No code
from the bus"): built-ins, installed entry points, and the `[operators] modules` of the node's
agent.toml (`--agent-config`, default $FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml when it
exists). A function the node would refuse is one error line naming file, key and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, List, Optional, Tuple

from agent.schema import ConfigError, read_toml
from pathlib import Path

SECRET_KEYS = {"password"}


def register(groups: Any) -> None:
    p = groups.root.add_parser(
        "check-config",
        help="validate agent.toml or a pipeline file and print the effective configuration",
    )
    p.add_argument("file", help="an agent.toml or a pipeline .toml (told apart by its [pipeline] table)")
    p.add_argument("--json", action="store_true", help="print the effective configuration as JSON")
    p.add_argument("--agent-config", metavar="AGENT_TOML",
                   help="for a pipeline: the agent.toml whose [operators] modules are allowed "
                        "(default: $FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml if it exists)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.config import load_agent_config, load_pipeline

    try:
        is_pipeline = "pipeline" in read_toml(Path(args.file))
        cfg = load_pipeline(args.file) if is_pipeline else load_agent_config(args.file)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if is_pipeline:
        try:
            refused = refused_functions(cfg, args.file, args.agent_config)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for line in refused:
            print(f"error: {line}", file=sys.stderr)
        if refused:
            return 1
    data = _redact(dataclasses.asdict(cfg))
    if args.json:
        json.dump(data, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        kind = "pipeline" if is_pipeline else "agent"
        print(f"# {args.file}: valid {kind} configuration; effective values:")
        _print_toml(data)
    return 0


def refused_functions(cfg: Any, file: str, agent_config: Optional[str]) -> List[str]:
    """One line per operator whose function this node's allow-list refuses."""
    from agent.config import default_config_path, load_agent_config
    from agent.runtime.admission import AllowList, OperatorRefused

    path = Path(agent_config) if agent_config else default_config_path()
    modules: Tuple[str, ...] = ()
    if agent_config or path.exists():
        modules = load_agent_config(path).operators.modules
    allowed = AllowList.for_node(modules)
    out = []
    for i, op in enumerate(cfg.operators):
        try:
            allowed.check(op.function)
        except OperatorRefused as exc:
            out.append(f'{file}: [operator[{i}]].function: "{op.function}" is not allowed on this node: '
                       f"{exc.why} (allowed: {exc.allowed}; node config: {path if modules or agent_config else 'none'})")
    return out


def _redact(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: ("***" if k in SECRET_KEYS and v else _redact(v)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_redact(v) for v in data]
    return data


def _print_toml(data: dict, prefix: str = "") -> None:
    scalars = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
    for k, v in scalars.items():
        if v is not None:
            print(f"{k} = {json.dumps(v)}")
    for k, v in data.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            print(f"\n[{name}]")
            _print_toml(v, name)
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                print(f"\n[[{name}]]")
                _print_toml(item, name)
        elif isinstance(v, list):
            print(f"{k} = {json.dumps(v)}")
