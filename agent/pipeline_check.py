"""One validation of a pipeline, for `fog-agent check-config`, `fog-agent deploy` and `fogctl deploy`.

Why one module: deploy used to run only the TOML loader, so a pipeline that check-config refused
(`params.feild: unknown key`) was deployed anyway and its worker failed on the node
(`worker exited before ready ('field')`), after the sink keeper had started and had to be rolled
back. Every command now runs `check_pipeline`, and prints the same lines.

What is checked, in order (each problem one `Problem`: file, key, what was expected, what was given):
1. every `function` against the node's allow-list, by name only (a refused module is never
   imported; agent.operators.admission);
2. only when all are allowed: each function imported as a worker imports it, its form (what
   docs/operators.md section 1 allows, as `load_operator` builds it), its params against its
   `params_schema`, the keyed-operator rules, and the paths it opens against the node's directories;
3. the scaling policies the agent runs;
4. MQTT feedback loops: an `mqtt_sink` topic that an `mqtt_source` filter of the same pipeline
   matches (MQTT wildcard rules). Deployed, such a pipeline reads back what it writes, each
   message wrapping the last, without end.

The node whose allow-list applies is `NodeConfig.find`: the agent.toml given, else
$FOG_AGENT_CONFIG or /etc/fog-agent/agent.toml when it exists. A deploy may run where no node's
agent.toml is (an admin's machine, which need not have the operator package): `lenient=True`
then leaves a function of a module no allow-list here knows to the nodes, which check it again at
spawn (the Report names it among its warnings; the deploys print errors only), instead of
refusing it; check-config, which is asked about one node, refuses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.schema import ConfigError, _show

__all__ = ["MQTT_SINKS", "MQTT_SOURCES", "NodeConfig", "Problem", "Report", "check_pipeline", "check_text",
           "feedback_loops", "form_problem", "module_problems"]

MQTT_SOURCES = ("agent.operators.taxi:mqtt_source",)  # params.topic: a topic filter it subscribes to
# the params naming the topics each publishes to
MQTT_SINKS = {"agent.operators.builtin:mqtt_sink": ("topic",),
              "agent.operators.windows:late_split_sink": ("topic", "late_topic")}


class _Missing:
    """No value was given (a missing key): distinct from a given None."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a file: `message` is the line every command prints (after `error: `).

    `note` is said after the given value, in brackets (e.g. the import error); `text`, when set,
    is the whole line (a message whose wording predates this class)."""

    file: str
    key: str
    expected: str
    given: Any = _MISSING
    note: str = ""
    text: str = ""

    @property
    def message(self) -> str:
        if self.text:
            return self.text
        line = f"{self.file}: {self.key}: {self.expected}" if self.key else f"{self.file}: {self.expected}"
        if self.given is not _MISSING:
            line += f", got {_show(self.given)}"
        return line + (f" ({self.note})" if self.note else "")

    def to_json(self) -> Dict[str, Any]:
        """The problem as a JSON object (`given`: null when no value was given; a value JSON
        cannot hold, a TOML date or an infinity, as text)."""
        import json

        given = None if self.given is _MISSING else self.given
        try:
            json.dumps(given, allow_nan=False)
        except (TypeError, ValueError):
            given = str(given)
        return {"file": self.file, "key": self.key, "expected": self.expected, "given": given,
                "message": self.message}

    @classmethod
    def of(cls, exc: ConfigError) -> "Problem":
        got = getattr(exc, "got", dataclasses.MISSING)
        return cls(exc.file, exc.key, exc.expected, _MISSING if got is dataclasses.MISSING else got, text=str(exc))


@dataclass
class Report:
    errors: List[Problem] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class NodeConfig:
    """The node a pipeline is checked against: its agent.toml (None: none here) and allow-list."""

    path: Path
    config: Any
    allowed: Any
    named: bool  # the agent.toml was named (an option), not found at the default place

    @classmethod
    def find(cls, agent_config: Optional[str]) -> "NodeConfig":
        """`agent_config`, else the default agent.toml if it exists (ConfigError if unusable)."""
        from agent.config import default_config_path, load_agent_config
        from agent.operators.admission import AllowList

        path = Path(agent_config) if agent_config else default_config_path()
        node = load_agent_config(path) if agent_config or path.exists() else None
        return cls(path, node, AllowList.for_node(node.operators.modules if node is not None else ()),
                   bool(agent_config))


def check_pipeline(cfg: Any, file: str, node: NodeConfig, lenient: bool = False) -> Report:
    """Every check of the module docstring, on a loaded PipelineConfig."""
    report = Report(warnings=list(cfg.scaling_notes()))
    refused, unknown = _refused(cfg, file, node, lenient)
    report.errors += refused
    for i in sorted(unknown):
        op = cfg.operators[i]
        report.warnings.append(f'{file}: [operator[{i}]].function: "{op.function}" not checked here: module '
                               f"{op.function.partition(':')[0]!r} is on no allow-list of this machine (no node "
                               f"agent.toml found at {node.path}); each node checks it when asked to start it")
    if not refused:  # import only what the allow-list admits
        report.errors += _operator_problems(cfg, file, node, skip=unknown)
    report.errors += [Problem(file, "", e) for e in cfg.runtime_policy_errors()]
    report.errors += feedback_loops(cfg, file)
    report.errors += _topic_problems(cfg, file, node)
    return report


def _topic_problems(cfg: Any, file: str, node: NodeConfig) -> List[Problem]:
    """MQTT operators on the fleet's topics, or off the pipeline's `[pipeline] mqtt_topics`
    (required when the node's agent.toml requires signed pipelines): what each node's admission
    refuses (docs/security.md, "Signed pipeline specs"), said before anything is deployed."""
    from agent.operators.admission import MQTT_TOPIC_PARAMS, check_mqtt_topics, topic_refusal

    required = bool(node.config is not None and node.config.security.admin_keys)
    out: List[Problem] = []
    for i, op in enumerate(cfg.operators):
        keys = MQTT_TOPIC_PARAMS.get(op.function, ())
        # a topic that is no topic or reaches the fleet's own is the params check's to say
        usable = {k: op.params[k] for k in keys if isinstance(op.params.get(k), str) and not topic_refusal(op.params[k])}
        if not keys or "topic" not in usable:
            continue
        try:
            check_mqtt_topics(op.function, usable, cfg.pipeline.mqtt_topics, required=required)
        except ValueError as exc:
            out.append(Problem(file, f"[operator[{i}]].params", "MQTT topics this node admits", text=f"{file}: {exc}"))
    return out


def _refused(cfg: Any, file: str, node: NodeConfig, lenient: bool) -> Tuple[List[Problem], set]:
    """(one Problem per function this node's allow-list refuses, the operators left to the nodes)."""
    from agent.operators.admission import OperatorRefused

    modules: Tuple[str, ...] = node.config.operators.modules if node.config is not None else ()
    out: List[Problem] = []
    unknown = set()
    for i, op in enumerate(cfg.operators):
        try:
            node.allowed.check(op.function)
        except OperatorRefused as exc:
            if lenient and node.config is None and not node.allowed.knows_module(op.function):
                unknown.add(i)
                continue
            where = node.path if modules or node.named else "none"
            key = f"[operator[{i}]].function"
            out.append(Problem(file, key, f"a function this node allows ({exc.why})", op.function,
                               text=f'{file}: {key}: "{op.function}" is not allowed on this node: {exc.why} '
                                    f"(allowed: {exc.allowed}; node config: {where})"))
    return out, unknown


def _operator_problems(cfg: Any, file: str, node: NodeConfig, skip: Any = ()) -> List[Problem]:
    """Import, form, params, keyed rules and paths of every operator (all allowed by now)."""
    from agent.operators.admission import NodeDirs, PathRefused, spec_paths
    from agent.operators.builtin import check_params
    from agent.operators.keyed import keyed_config_problems

    out: List[Problem] = []
    for i, op in enumerate(cfg.operators):
        if i in skip:
            continue
        where = f"[operator[{i}]]"
        try:
            obj = node.allowed.resolve(op.function)
        except Exception as exc:  # noqa: BLE001 - the user's module may raise anything on import
            why = getattr(exc, "why", None) or (str(exc) if isinstance(exc, ValueError)
                                                else f"importing it raised {type(exc).__name__}: {exc}")
            out.append(Problem(file, f"{where}.function", "expected an importable operator function", op.function,
                               note=why))
            continue
        form = form_problem(obj, op.kind)
        if form:
            out.append(Problem(file, f"{where}.function", f"expected {form}", op.function))
            continue
        try:
            problems = check_params(obj, op.params)
        except Exception as exc:  # noqa: BLE001 - a user's check_params
            problems = [("", f"its check_params raised {type(exc).__name__}: {exc}", None)]
        for key, expected, got in problems:
            key_ = f"{where}.params.{key}" if key else f"{where}.params"
            out.append(Problem(file, key_, expected, _MISSING if got is None else got))
        out += [Problem(file, where, line) for line in keyed_config_problems(cfg, i, obj)]
        if node.config is not None:  # the paths the node's agent would refuse at deploy (admission.py)
            dirs = NodeDirs.of(node.config)
            for what, value in spec_paths({}, op.function, op.params):
                try:
                    dirs.check(what, value)
                except PathRefused as exc:
                    out.append(Problem(file, f"{where}.{what}", f"expected a path inside the node's directories "
                                                                f"(agent config {node.path}): {exc}"))
    return out


def form_problem(obj: Any, kind: str) -> str:
    """What `obj` should have been, if `load_operator` cannot build it as an operator of `kind`
    (docs/operators.md, "The three forms"), else ''. Looks at the object only: builds nothing."""
    from agent.operators.builtin import Operator, SinkOperator, constructor_takes_ctx

    if callable(getattr(obj, "build", None)):
        return ""  # a factory (also a KeyedOperator class): what build returns is its business
    if isinstance(obj, type) and issubclass(obj, Operator):
        if kind == "sink" and not issubclass(obj, SinkOperator):
            return f"a SinkOperator class for a sink ({obj.__name__} is an Operator that is not a sink)"
        if kind != "sink" and issubclass(obj, SinkOperator):
            return (f'an operator of kind "{kind}", not the SinkOperator class {obj.__name__} (a sink is the last '
                    'operator, kind = "sink")')
        try:
            constructor_takes_ctx(obj)
        except TypeError as exc:
            return f"an Operator class built as {obj.__name__}(ctx) or {obj.__name__}() ({exc})"
        return ""
    if not callable(obj):
        return (f"a function, a factory with build(ctx) or an Operator class (found {type(obj).__name__}, "
                "which is none of them)")
    return ""


def feedback_loops(cfg: Any, file: str) -> List[Problem]:
    """One Problem per topic an MQTT sink publishes to (`MQTT_SINKS`) that an mqtt_source filter of
    the same pipeline matches
    (MQTT rules: `+` one level, `#` this level and all below, `$` topics not matched by a leading
    wildcard; paho's `topic_matches_sub`)."""
    sources = [(i, op.params.get("topic")) for i, op in enumerate(cfg.operators)
               if op.function in MQTT_SOURCES and isinstance(op.params.get("topic"), str)]
    out: List[Problem] = []
    for j, op in enumerate(cfg.operators):
        for param in MQTT_SINKS.get(op.function, ()):
            out += _loops(cfg, file, j, param, sources)
    return out


def _loops(cfg: Any, file: str, j: int, param: str, sources: List[Tuple[int, Any]]) -> List[Problem]:
    from paho.mqtt.client import topic_matches_sub

    op = cfg.operators[j]
    topic = op.params.get(param)
    out: List[Problem] = []
    if not isinstance(topic, str) or not topic:
        return out
    for i, filt in sources:
        try:
            loops = topic_matches_sub(filt, topic)
        except ValueError:  # a malformed filter: its own check says so
            continue
        if loops:
            out.append(Problem(
                file, f"[operator[{j}]].params.{param}",
                f"expected a topic that no mqtt_source of this pipeline reads, but [operator[{i}]].params.topic "
                f'"{filt}" matches it: an MQTT feedback loop (every message {op.name!r} publishes comes back '
                f"in through {cfg.operators[i].name!r}, wrapped again, without end)", topic))
    return out


def module_problems(modules: Sequence[str], file: str) -> List[Problem]:
    """One Problem per `[operators] modules` entry that does not import here (the import error):
    every operator of it would fail on this node when a worker imports it."""
    import importlib

    out: List[Problem] = []
    for k, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a user's module may raise anything on import
            out.append(Problem(Path(file).name, f"[operators].modules[{k}]", "expected a module this node can import",
                               name, note=f"{type(exc).__name__}: {exc}"))
    return out


def check_text(text: str, file: str, agent_config: Optional[str]) -> Tuple[Any, Report]:
    """What `fog-agent deploy` and `fogctl deploy` run before they connect to anything:
    (the PipelineConfig or None, the Report), with check-config's checks and lines, `lenient`
    about modules no allow-list here knows (the module docstring says why)."""
    from agent.config import load_pipeline_text

    try:
        cfg = load_pipeline_text(text, Path(file).name)  # the loader names the file as check-config's does
        return cfg, check_pipeline(cfg, file, NodeConfig.find(agent_config), lenient=True)
    except ConfigError as exc:
        return None, Report(errors=[Problem.of(exc)])
