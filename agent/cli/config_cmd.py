"""`fog-agent check-config FILE`: validate a configuration file and print the effective values.

The file's kind is told from its tables (`--kind` to say it): an agent file has `[agent]`, a
pipeline `[pipeline]` / `[[operator]]`, the central collector's file `[collector]` /
`[analytics]`, a latency matrix `[nodes]` (examples/ has one of each). Each kind is loaded by the
loader its command uses (`run`, `deploy`, `collector`, `netem apply`), so a file that passes here
loads there. The effective configuration is printed as TOML (or `--json`) with the file's own
key names and every default filled in; it loads again as the same configuration (passwords are
shown as "***").

A pipeline is also checked against THIS node's operator allow-list (docs/security.md, "No code
from the bus"): built-ins, installed entry points, and the `[operators] modules` of the node's
agent.toml (`--agent-config`, default $FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml when it
exists). A function the node would refuse is one error line naming file, key and what is allowed.
Only when every function is allowed are they imported (a refused module is never imported), and
each operator's params are checked against the `params_schema` its function declares (the
built-ins do: agent.operators.builtin.check_params; docs/operators.md, "Declaring params").

Files a configuration names are opened: a pipeline's path params (`params.csv`), an agent's or
central's `[mqtt].password_file`. A missing `[mqtt.tls]` file is a warning only: packages write
agent.toml before the certificates arrive, and `fog-agent run` refuses to start without them
(exit 78). Every problem is one line naming file, key and what was expected.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.schema import ConfigError, read_toml

SECRET_KEYS = {"password"}
KINDS = ("agent", "pipeline", "central", "latency")
# The tables that tell a kind apart (first match wins; the agent file has a [latency] table too).
_TELLS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("pipeline", ("pipeline", "operator")),
    ("agent", ("agent",)),
    ("central", ("collector", "analytics")),
    ("latency", ("nodes", "rtt_ms")),
)


def register(groups: Any) -> None:
    p = groups.root.add_parser(
        "check-config",
        help="validate agent.toml, a pipeline, central.toml or a latency matrix and print the effective configuration",
    )
    p.add_argument("file", help="agent.toml, a pipeline .toml, central.toml or a latency matrix (told apart by their tables)")
    p.add_argument("--kind", choices=KINDS, default=None, help="the file's kind, when its tables do not say it")
    p.add_argument("--json", action="store_true", help="print the effective configuration as JSON")
    p.add_argument("--agent-config", metavar="AGENT_TOML",
                   help="for a pipeline: the agent.toml whose [operators] modules are allowed "
                        "(default: $FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml if it exists)")
    p.set_defaults(func=run)


def detect_kind(data: Mapping[str, Any]) -> Optional[str]:
    for kind, tables in _TELLS:
        if any(t in data for t in tables):
            return kind
    return None


def load(kind: str, path: Path) -> Any:
    """The configuration object of `kind` from `path`, by the loader its command uses."""
    if kind == "agent":
        from agent.config import load_agent_config

        return load_agent_config(path)
    if kind == "pipeline":
        from agent.config import load_pipeline

        return load_pipeline(path)
    if kind == "central":
        from agent.central_config import load_central_config

        return load_central_config(path)
    from agent.measure.netem import parse_matrix

    try:
        return parse_matrix(read_toml(path), path.name)
    except ConfigError:
        raise
    except ValueError as exc:  # the matrix parser's messages already name file and key
        raise ConfigError(str(exc), "", "invalid latency matrix") from None


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        kind = args.kind or detect_kind(read_toml(path))
        if kind is None:
            tells = "; ".join(f"{k}: " + " or ".join(f"[{t}]" for t in ts) for k, ts in _TELLS)
            raise ConfigError(path.name, "", f"cannot tell what kind of file this is (a {tells} table); "
                                             f"say it with --kind {{{','.join(KINDS)}}}")
        cfg = load(kind, path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if kind == "pipeline":
        try:
            node = _node_config(args.agent_config)
            refused = refused_functions(cfg, args.file, node, args.agent_config)
            if not refused:  # import only what the allow-list admits
                refused = operator_problems(cfg, args.file, node)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        refused += [f"{args.file}: {e}" for e in cfg.runtime_policy_errors()]  # deploy refuses these too
        for line in cfg.scaling_notes():
            print(f"warning: {args.file}: {line}", file=sys.stderr)
        for line in refused:
            print(f"error: {line}", file=sys.stderr)
        if refused:
            return 1
    elif kind in ("agent", "central"):
        problems, warnings = mqtt_file_problems(cfg.mqtt, args.file)
        for line in warnings:
            print(f"warning: {line}", file=sys.stderr)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        if problems:
            return 1
    data = _redact(effective(cfg))
    if args.json:
        json.dump(_json_safe(data), sys.stdout, indent=2, sort_keys=True, allow_nan=False)
        print()
    else:
        print(f"# {args.file}: valid {kind} configuration; effective values:")
        print(to_toml(data), end="")
    return 0


def effective(cfg: Any) -> Dict[str, Any]:
    """A configuration object as the TOML table it loads from: the file's key names (`operator`,
    not the field name `operators`), every default filled in, unset options (None) left out."""
    from agent.measure.netem import LatencyMatrix

    if isinstance(cfg, LatencyMatrix):
        nodes: Dict[str, Any] = {}
        for name, addr in cfg.addresses.items():
            dev = cfg.devices.get(name)
            nodes[name] = {"address": addr, "dev": dev} if dev else addr
        rtt: Dict[str, Any] = {}
        for a, row in cfg.links.items():
            for b, lk in row.items():
                rtt.setdefault(a, {})[b] = (lk.delay_ms if not (lk.jitter_ms or lk.loss_pct)
                                            else {"delay": lk.delay_ms, "jitter": lk.jitter_ms, "loss": lk.loss_pct})
        return {"nodes": nodes, "rtt_ms": rtt}
    return _table(cfg)


def _table(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue  # e.g. `source`: where the file was read from, not a key of it
            value = getattr(obj, f.name)
            if value is not None:
                out[f.metadata.get("key", f.name)] = _table(value)
        return out
    if isinstance(obj, Mapping):
        return {k: _table(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [_table(v) for v in obj]
    return obj


def _redact(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: ("***" if k in SECRET_KEYS and v else _redact(v)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_redact(v) for v in data]
    return data


def _json_safe(data: Any) -> Any:
    """JSON has no infinity or NaN: such a number becomes the string TOML spells it with."""
    if isinstance(data, dict):
        return {k: _json_safe(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_json_safe(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return _toml_value(data)
    return data


# ---- a small TOML writer (tomllib reads only) --------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string (same escapes)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def to_toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """TOML text for `data` (plain values first, then sub-tables and arrays of tables)."""
    lines: List[str] = []
    for k, v in data.items():
        if not isinstance(v, dict) and not _is_table_array(v):
            lines.append(f"{_key(k)} = {_toml_value(v)}")
    for k, v in data.items():
        name = f"{prefix}.{_key(k)}" if prefix else _key(k)
        if isinstance(v, dict):
            lines.append(f"\n[{name}]")
            body = to_toml(v, name)
            if body:
                lines.append(body.rstrip("\n"))
        elif _is_table_array(v):
            for item in v:
                lines.append(f"\n[[{name}]]")
                body = to_toml(item, name)
                if body:
                    lines.append(body.rstrip("\n"))
    return "\n".join(lines) + "\n" if lines else ""


def _node_config(agent_config: Optional[str]) -> Tuple[Path, Any, Any]:
    """(path, AgentConfig or None, its AllowList): the node's agent.toml that check-config checks
    a pipeline against (`--agent-config`, else the default one if it exists)."""
    from agent.config import default_config_path, load_agent_config
    from agent.operators.admission import AllowList

    path = Path(agent_config) if agent_config else default_config_path()
    node = load_agent_config(path) if agent_config or path.exists() else None
    return path, node, AllowList.for_node(node.operators.modules if node is not None else ())


def operator_problems(cfg: Any, file: str, node_config: Tuple[Path, Any, Any]) -> List[str]:
    """One line per operator function that does not import, and per bad param of each operator
    (its function's `params_schema`). Called only after `refused_functions` found nothing."""
    from agent.operators.admission import NodeDirs, PathRefused, spec_paths
    from agent.operators.builtin import check_params
    from agent.operators.keyed import keyed_config_problems

    path, node, allowed = node_config
    out: List[str] = []
    for i, op in enumerate(cfg.operators):
        where = f"[operator[{i}]]"
        try:
            obj = allowed.resolve(op.function)
        except Exception as exc:  # noqa: BLE001 - the user's module may raise anything on import
            why = getattr(exc, "why", None) or (str(exc) if isinstance(exc, ValueError)
                                                else f"importing it raised {type(exc).__name__}: {exc}")
            out.append(f"{file}: {where}.function: expected an importable operator function, "
                       f'got "{op.function}" ({why})')
            continue
        try:
            problems = check_params(obj, op.params)
        except Exception as exc:  # noqa: BLE001 - a user's check_params
            problems = [("", f"its check_params raised {type(exc).__name__}: {exc}", None)]
        for key, expected, got in problems:
            key_ = f"{where}.params.{key}" if key else f"{where}.params"
            out.append(str(ConfigError(file, key_, expected, *(() if got is None else (got,)))))
        out += [f"{file}: {where}: {line}" for line in keyed_config_problems(cfg, i, obj)]
        if node is not None:  # the paths the node's agent would refuse at deploy (admission.py)
            dirs = NodeDirs.of(node)
            for what, value in spec_paths({}, op.function, op.params):
                try:
                    dirs.check(what, value)
                except PathRefused as exc:
                    out.append(f"{file}: {where}.{what}: expected a path inside the node's directories "
                               f"(agent config {path}): {exc}")
    return out


def mqtt_file_problems(mqtt: Any, file: str) -> Tuple[List[str], List[str]]:
    """(errors, warnings) about the files an [mqtt] table names: the password file must be
    readable (the agent reads it at `run`); a missing TLS file is a warning (see the module doc)."""
    from agent.config import check_tls

    errors: List[str] = []
    warnings: List[str] = []
    if mqtt.password_file is not None:
        try:
            with open(mqtt.password_file, "rb"):
                pass
        except OSError as exc:
            errors.append(str(ConfigError(Path(file).name, "[mqtt].password_file", f"expected a readable file ({exc.strerror})",
                                          mqtt.password_file)))
    try:
        check_tls(mqtt, file)
    except ConfigError as exc:
        (warnings if "readable PEM file" in exc.expected else errors).append(str(exc))
    return errors, warnings


def refused_functions(cfg: Any, file: str, node_config: Tuple[Path, Any, Any], agent_config: Optional[str]) -> List[str]:
    """One line per operator whose function this node's allow-list refuses."""
    from agent.operators.admission import OperatorRefused

    path, node, allowed = node_config
    modules: Tuple[str, ...] = node.operators.modules if node is not None else ()
    out = []
    for i, op in enumerate(cfg.operators):
        try:
            allowed.check(op.function)
        except OperatorRefused as exc:
            out.append(f'{file}: [operator[{i}]].function: "{op.function}" is not allowed on this node: '
                       f"{exc.why} (allowed: {exc.allowed}; node config: {path if modules or agent_config else 'none'})")
    return out

