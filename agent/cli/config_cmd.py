"""`fog-agent check-config FILE`: validate a configuration file and print the effective values.

The file's kind is told from its tables (`--kind` to say it): an agent file has `[agent]`, a
pipeline `[pipeline]` / `[[operator]]`, the central collector's file `[collector]` /
`[analytics]`, a latency matrix `[nodes]` (examples/ has one of each). Each kind is loaded by the
loader its command uses (`run`, `deploy`, `collector`, `netem apply`), so a file that passes here
loads there. The effective configuration is printed as TOML (or `--json`) with the file's own
key names and every default filled in; it loads again as the same configuration (passwords are
shown as "***").

A pipeline is checked by agent.pipeline_check, the checks `fog-agent deploy` and `fogctl deploy`
run too: against THIS node's operator allow-list (docs/security.md, "No code from the bus"):
built-ins, installed entry points, and the `[operators] modules` of the node's agent.toml
(`--agent-config`, default $FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml when it exists). A
function the node would refuse is one error line naming file, key and what is allowed. Only when
every function is allowed are they imported (a refused module is never imported), their form
checked, and each operator's params checked against the `params_schema` its function declares
(the built-ins do: agent.operators.builtin.check_params; docs/operators.md, "Declaring params");
then the policies and MQTT feedback loops. An agent file's `[operators] modules` must import.

With `--json`, stdout holds one JSON document either way: the effective configuration, or
`{"ok": false, "errors": [{file, key, expected, given, message}], "warnings": [...]}`.

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

from agent import exitcodes
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
    """Exit 0 (valid; the effective values on stdout) or 1 (one `error:` line per problem on
    stderr; with --json also `{"ok": false, "errors": [{file, key, expected, given, message}],
    "warnings": [...]}` on stdout, so a script reads one document either way)."""
    from agent.pipeline_check import NodeConfig, Problem, Report, check_pipeline, module_problems

    path = Path(args.file)
    report = Report()
    cfg: Any = None
    kind: Optional[str] = None
    try:
        kind = args.kind or detect_kind(read_toml(path))
        if kind is None:
            tells = "; ".join(f"{k}: " + " or ".join(f"[{t}]" for t in ts) for k, ts in _TELLS)
            raise ConfigError(path.name, "", f"cannot tell what kind of file this is (a {tells} table); "
                                             f"say it with --kind {{{','.join(KINDS)}}}")
        cfg = load(kind, path)
        if kind == "pipeline":
            report = check_pipeline(cfg, args.file, NodeConfig.find(args.agent_config))
        elif kind in ("agent", "central"):
            problems, warnings = mqtt_file_problems(cfg.mqtt, args.file)
            report.errors += problems
            report.warnings += warnings
            if kind == "agent":  # every module a worker of this node would import
                report.errors += module_problems(cfg.operators.modules, args.file)
    except ConfigError as exc:
        report.errors.append(Problem.of(exc))
    return _print(args, kind, cfg, report)


def _print(args: argparse.Namespace, kind: Optional[str], cfg: Any, report: Any) -> int:
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    for problem in report.errors:
        print(f"error: {problem.message}", file=sys.stderr)
    if not report.ok:
        if args.json:
            doc = {"ok": False, "errors": [p.to_json() for p in report.errors], "warnings": report.warnings}
            json.dump(_json_safe(doc), sys.stdout, indent=2, sort_keys=True, allow_nan=False, default=str)
            print()
        return exitcodes.ERROR
    data = _redact(effective(cfg))
    if args.json:
        json.dump(_json_safe(data), sys.stdout, indent=2, sort_keys=True, allow_nan=False)
        print()
    else:
        print(f"# {args.file}: valid {kind} configuration; effective values:")
        print(to_toml(data), end="")
    return exitcodes.OK


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


def mqtt_file_problems(mqtt: Any, file: str) -> Tuple[List[Any], List[str]]:
    """(errors, warnings) about the files an [mqtt] table names: the password file must be
    readable (the agent reads it at `run`); a missing TLS file is a warning (see the module doc)."""
    from agent.config import check_tls
    from agent.pipeline_check import Problem

    errors: List[Any] = []
    warnings: List[str] = []
    if mqtt.password_file is not None:
        try:
            with open(mqtt.password_file, "rb"):
                pass
        except OSError as exc:
            errors.append(Problem.of(ConfigError(Path(file).name, "[mqtt].password_file",
                                                 f"expected a readable file ({exc.strerror})", mqtt.password_file)))
    try:
        check_tls(mqtt, file)
    except ConfigError as exc:
        if "readable PEM file" in exc.expected:
            warnings.append(str(exc))
        else:
            errors.append(Problem.of(exc))
    return errors, warnings
