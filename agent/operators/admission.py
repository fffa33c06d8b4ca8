"""What a node admits from a spec: which operator functions it may import, which paths it may write.

Why (docs/security.md, "No code from the bus"): a spec arrives from the bus (a spawn request, a
retained hosted record that a re-home reads) or from the state dir, and its pipeline text names
the function the worker imports. A name taken as it comes lets any identity on the bus run any
code on any node (`function = "builtins:exec"`). So the functions a node may import are fixed on
the node, never by a request:

- the built-in operators (`BUILTIN`: `agent.operators.builtin`, the keyed ones of
  `agent.operators.keyed`, `agent.operators.windows`, the file sink and the taxi sources);
- the operators installed packages register in the entry-point group `fog_agent.operators`
  (`name = "module:attr"`): exactly those "module:attr" values (the lab, fog-agent-lab, registers
  the demo's DEBS operators and the benchmarks' source, `foglab.operators`, this way);
- the public functions of the modules the node's own agent.toml lists
  (`[operators] modules = ["mylab.ops"]`): a name that does not start with "_" and that is
  defined in that module (not one it imported from elsewhere, e.g. `from os import system`).

Pipelines keep naming a function as "module:name"; the allow-list decides. `check` looks only at
the name and never imports anything, so a refused module is never imported; `resolve` imports only
after `check` passed. The agent checks every spec where it enters (agent.node.daemon) without
importing user code into the daemon; the worker checks again before it imports (defence in depth)
and then, for a configured module, that the object is defined there.

Paths: a spec's `extra.sink_dir` (and a source's `params.csv`) must resolve, after `..` and
symbolic links, inside the node's own directories (`NodeDirs`); everything else a spec could name
(state_dir, the spool dir) is replaced by the node's own settings when the spec enters.

Steering fields of `extra` (`check_epochs`, `fault_injection_enabled`): an instance's epoch floor
`min_epoch` (and a hand-over's `handover_state.epoch`) derive from a wall clock, so one far ahead
of this node's clock is refused; the fault-injection hook `crash_at` is honoured only on a node
that enables fault injection (`FOG_AGENT_FAULT_INJECTION=1`, set by the reliability tests only).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from agent.refs import MAX_REF, check_module_name, parse_ref
from agent.topics import filter_problem


__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "ENV_FAULT_INJECTION",
    "ENV_MODULES",
    "FROM_STATE_DIR",
    "MAX_EPOCH_AHEAD",
    "AllowList",
    "NodeDirs",
    "OperatorRefused",
    "PATH_PARAMS",
    "PathRefused",
    "check_epochs",
    "check_module_name",
    "check_mqtt_topics",
    "check_spec_paths",
    "fault_injection_enabled",
    "filter_covers",
    "filter_problem",
    "node_allow_list",
    "parse_ref",
    "spec_paths",
    "suggest",
]

ENTRY_POINT_GROUP = "fog_agent.operators"
# The node's `[operators] modules`, comma-separated, as the agent hands them to its workers (the
# worker reads no agent.toml; the environment is the agent's, not the request's).
ENV_MODULES = "FOG_AGENT_OPERATOR_MODULES"
# The entry points the agent read at its start, as a JSON object {name: "module:attr"}: a worker
# takes them from there instead of reading every installed package's metadata itself, which
# imports importlib.metadata with email, zipfile and shutil (1.1-1.3 MB resident in the fork
# server and so in every worker; docs/runtime.md, "Memory"). Absent (a worker started by hand)
# or not such an object: the worker reads the metadata, as the agent did.
ENV_ENTRY_POINTS = "FOG_AGENT_OPERATOR_ENTRY_POINTS"

BUILTIN: FrozenSet[str] = frozenset({
    "agent.operators.builtin:validate",
    "agent.operators.builtin:in_zone",
    "agent.operators.builtin:identity",
    "agent.operators.builtin:counting_sink",
    "agent.operators.builtin:null_sink",
    "agent.operators.builtin:mqtt_sink",
    "agent.operators.filesink:file_sink",
    "agent.operators.keyed:keyed_count",
    "agent.operators.keyed:keyed_sum",
    "agent.operators.keyed:keyed_mean",
    "agent.operators.keyed:tumbling_window",
    "agent.operators.keyed:sliding_window",
    "agent.operators.keyed:top_k",
    "agent.operators.windows:window",
    "agent.operators.windows:late_split_sink",
    "agent.operators.taxi:source",
    "agent.operators.taxi:mqtt_source",
})

# Operator params that are paths the operator opens (checked like extra.sink_dir).
PATH_PARAMS: Dict[str, Tuple[str, ...]] = {
    "agent.operators.taxi:source": ("csv",),
}



class OperatorRefused(ValueError):
    """The function a spec names is not on this node's allow-list (or its name is malformed)."""

    def __init__(self, ref: Any, why: str, allowed: str) -> None:
        self.ref, self.why, self.allowed = ref, why, allowed
        super().__init__(f"operator function {str(ref)[:MAX_REF]!r} refused: {why} (allowed here: {allowed})")


class PathRefused(ValueError):
    """A path a spec names resolves outside the node's own directories."""


def _entry_points(group: str) -> Dict[str, str]:
    """{entry-point name: "module:attr"} of the group, read from the installed packages'
    metadata (nothing is imported). A malformed value is skipped."""
    from importlib import metadata

    eps: Any = metadata.entry_points()
    found = eps.select(group=group) if hasattr(eps, "select") else eps.get(group, ())  # Python 3.9
    out: Dict[str, str] = {}
    for ep in found:
        value = ep.value.split("[", 1)[0].replace(" ", "")  # "module:attr [extra]" -> "module:attr"
        try:
            parse_ref(value)
        except ValueError:
            continue
        out[ep.name] = value
    return out


def _entry_points_given(raw: Optional[str]) -> Optional[Dict[str, str]]:
    """The entry points of ENV_ENTRY_POINTS; None if absent or not {name: "module:attr"}."""
    if raw is None:
        return None
    try:
        eps = json.loads(raw)
        if isinstance(eps, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in eps.items()):
            for v in eps.values():
                parse_ref(v)
            return eps
    except ValueError:
        pass
    return None


@dataclass(frozen=True)
class AllowList:
    """The operator functions this node may import (see the module docstring)."""

    modules: Tuple[str, ...] = ()
    entry_points: Mapping[str, str] = field(default_factory=dict)  # name -> "module:attr"

    @classmethod
    def for_node(cls, modules: Iterable[str] = (), group: str = ENTRY_POINT_GROUP,
                 entry_points: Optional[Dict[str, str]] = None) -> "AllowList":
        """`entry_points`: as read already (a worker's, from its agent); None: read from `group`."""
        mods = tuple(m for m in modules if check_module_name(m) is None)
        return cls(modules=mods, entry_points=_entry_points(group) if entry_points is None else entry_points)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "AllowList":
        """A worker's allow-list: the modules and entry points its agent put into the environment."""
        env = os.environ if env is None else env
        raw = env.get(ENV_MODULES, "")
        return cls.for_node((m.strip() for m in raw.split(",") if m.strip()),
                            entry_points=_entry_points_given(env.get(ENV_ENTRY_POINTS)))

    def env(self) -> Dict[str, str]:
        """The environment entries that give a worker this allow-list."""
        return {ENV_MODULES: ",".join(self.modules),
                ENV_ENTRY_POINTS: json.dumps(dict(sorted(self.entry_points.items())), separators=(",", ":"))}

    def describe(self) -> str:
        """What is allowed, in one line (for errors and logs)."""
        by_module: Dict[str, List[str]] = {}
        for ref in sorted(BUILTIN):
            module, _, name = ref.partition(":")
            by_module.setdefault(module, []).append(name)
        parts = ["built-in " + ", ".join(f"{m}:{{{','.join(names)}}}" for m, names in sorted(by_module.items()))]
        eps = sorted(set(self.entry_points.values()))
        parts.append(f"entry points ({ENTRY_POINT_GROUP}): {', '.join(eps) if eps else 'none'}")
        mods = ", ".join(f"{m}:*" for m in self.modules)
        parts.append(f"[operators] modules: {mods or 'none'}")
        return "; ".join(parts)

    def _listed(self, ref: str) -> bool:
        """Named exactly: a built-in or an installed entry point (not by a configured module)."""
        return ref in BUILTIN or ref in self.entry_points.values()

    def _listed_names(self, module: str) -> List[str]:
        """The names of `module` allowed by name (built-ins and entry points)."""
        return [r.partition(":")[2] for r in (*BUILTIN, *self.entry_points.values()) if r.partition(":")[0] == module]

    def knows_module(self, ref: Any) -> bool:
        """Whether `ref`'s module is one this allow-list names (built in, an entry point's, or
        configured): a refusal of a name in it is a wrong name, not a module unknown here."""
        module = str(ref).partition(":")[0]
        return module in self.modules or bool(self._listed_names(module))

    def check(self, ref: Any) -> Tuple[str, str]:
        """("module", "name") if `ref` may be imported here, else OperatorRefused. Looks at the
        name only: never imports anything."""
        try:
            module, name = parse_ref(ref)
        except ValueError as exc:
            raise OperatorRefused(ref, str(exc), self.describe()) from None
        if self._listed(ref):
            return module, name
        if module in self.modules:
            if name.startswith("_"):
                raise OperatorRefused(ref, "a name starting with '_' is private", self.describe())
            return module, name
        listed = self._listed_names(module)
        if listed:  # a known module, a wrong name (a misspelling, or a function it does not register)
            raise OperatorRefused(ref, f"module {module!r} has no operator {name!r}{suggest(name, listed)}",
                                  self.describe())
        raise OperatorRefused(ref, f"module {module!r} is not an operator module of this node", self.describe())

    def resolve(self, ref: str) -> Any:
        """The object `ref` names, imported only after `check` allowed it. For a configured
        module, the object must be defined in that module (its own function or class, or a
        factory whose `build` is), not imported into it from elsewhere."""
        module, name = self.check(ref)
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"operator function {ref!r}: cannot import ({exc})") from None
        try:
            obj = getattr(mod, name)
        except AttributeError:
            own = [n for n, v in vars(mod).items() if not n.startswith("_") and _defined_in(v, module)]
            raise ValueError(f"module {module!r} has no operator {name!r}{suggest(name, own)}") from None
        if not self._listed(ref) and not _defined_in(obj, module):
            raise OperatorRefused(ref, f"{name!r} is not defined in {module!r}", self.describe())
        return obj


def suggest(name: str, names: Iterable[str]) -> str:
    """'; did you mean X?' for the one of `names` closest to `name` (a misspelling), or ''."""
    close = difflib.get_close_matches(name, sorted(set(names)), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _defined_in(obj: Any, module: str) -> bool:
    for candidate in (obj, getattr(obj, "build", None), type(obj)):
        if candidate is not None and getattr(candidate, "__module__", None) == module:
            return True
    return False


@functools.lru_cache(maxsize=1)
def node_allow_list() -> AllowList:
    """This process's allow-list from its environment (a worker's: read once; warm workers read
    it before their spec arrives)."""
    return AllowList.from_env()


# ---- paths --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeDirs:
    """The directories of this node a spec may name: its state dir, its spool dir (when it
    spills) and the `[agent] sink_dirs` of its agent.toml (e.g. shared storage for sinks)."""

    roots: Tuple[str, ...]

    @classmethod
    def of(cls, cfg: Any) -> "NodeDirs":
        roots: List[str] = [cfg.agent.state_dir, *getattr(cfg.agent, "sink_dirs", ())]
        if cfg.spill.enabled:
            roots.append(cfg.spill.spool_dir)
        return cls(tuple(os.path.realpath(r) for r in roots))

    def check(self, what: str, path: Any) -> str:
        """`path` resolved (after `..` and symbolic links), if inside one of the roots; else
        PathRefused naming `what` and the roots."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise PathRefused(f"{what}: expected a path, got {str(path)[:100]!r}")
        if not os.path.isabs(path):
            raise PathRefused(f"{what}: {path[:200]!r} is not an absolute path")
        real = os.path.realpath(path)
        for root in self.roots:
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                return real
        raise PathRefused(f"{what}: {path[:200]!r} resolves to {real!r}, outside this node's directories "
                          f"({', '.join(self.roots)})")


def spec_paths(extra: Mapping[str, Any], function: str, params: Mapping[str, Any]) -> List[Tuple[str, Any]]:
    """Every path a spec carries that a worker would open: (what, path). `extra.spill` is the
    node's own by then (`Gate.node_local` drops a request's), checked all the same."""
    found: List[Tuple[str, Any]] = []
    if extra.get("sink_dir") is not None:
        found.append(("extra.sink_dir", extra["sink_dir"]))
    spill = extra.get("spill")
    if isinstance(spill, Mapping) and spill.get("dir") is not None:
        found.append(("extra.spill.dir", spill["dir"]))
    elif spill is not None and not isinstance(spill, Mapping):
        found.append(("extra.spill", spill))
    for key in PATH_PARAMS.get(function, ()):
        if params.get(key) is not None:
            found.append((f"params.{key}", params[key]))
    return found


def check_spec_paths(dirs: NodeDirs, extra: Mapping[str, Any], function: str, params: Mapping[str, Any]) -> None:
    for what, path in spec_paths(extra, function, params):
        dirs.check(what, path)



# ---- steering fields of extra -------------------------------------------------------------------

# How far (seconds) a spec's epoch floor may be ahead of this node's clock. Legitimate floors are
# another node's `int(time.time())` a moment ago (a re-home's plan, a drain's hand-over), so the
# margin only has to cover clock skew between NTP-synchronised nodes; a forged 2^53 would give the
# instance an absurd epoch that its receivers keep (docs/security.md, "Steering fields").
MAX_EPOCH_AHEAD = 300
# The requester `Reconciler.readopt` (agent.node.reconcile) names: a spec stored in this node's own state dir.
FROM_STATE_DIR = "the state dir"
# Fault injection (`extra.crash_at`, agent.instance.worker `crash_point`) is honoured only where
# this is "1" in the agent's environment: the reliability tests set it, nothing else does.
ENV_FAULT_INJECTION = "FOG_AGENT_FAULT_INJECTION"


def fault_injection_enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this node honours `extra.crash_at` (never by default)."""
    return (os.environ if env is None else env).get(ENV_FAULT_INJECTION, "") == "1"


def _epoch_floor(what: str, value: Any, now: float, bounded: bool) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: expected a non-negative integer, got {str(value)[:40]!r}")
    if bounded and value > now + MAX_EPOCH_AHEAD:
        raise ValueError(f"{what}: {value} is {value - now:.0f} s ahead of this node's clock (at most "
                         f"{MAX_EPOCH_AHEAD} s: epochs derive from the wall clock; is this node's clock set?)")


def check_epochs(extra: Mapping[str, Any], now: float, stored: bool = False) -> None:
    """Refuse (ValueError naming the field) an epoch floor a spec carries that no real sender can
    have: `extra.min_epoch` and a hand-over's `extra.handover_state.epoch` must be non-negative
    integers at most MAX_EPOCH_AHEAD seconds ahead of `now` (this node's wall clock).

    Refused, not clamped: a floor clamped below the one a re-home or a hand-over meant could
    number the new incarnation below its predecessor's messages (its receivers would drop them as
    old), so a node whose clock is that far behind says so and the requester tries another node.
    A `stored` spec (this node's state dir) was bounded when it arrived; only its type is checked,
    so a clock set back at boot (a Pi without a real-time clock) does not set instances aside."""
    _epoch_floor("extra.min_epoch", extra.get("min_epoch"), now, not stored)
    handover = extra.get("handover_state")
    if isinstance(handover, Mapping):
        _epoch_floor("extra.handover_state.epoch", handover.get("epoch"), now, not stored)


# The types a spec's fields must have when they arrive (a request from the bus, a stored spec):
# checked before anything reads them, so a wrong type is a refusal naming the field, never an
# exception deeper down (`extra = 1` once raised AttributeError and left the requester unanswered).
_STR_FIELDS = ("instance", "operator", "node", "cluster", "pipeline", "pipeline_toml", "state_dir")
_BOOL_FIELDS = ("keeper", "active", "restart")
_LIST_FIELDS = ("succs", "preds")


def check_spec_types(data: Any) -> None:
    """Refuse (ValueError naming the field) a spec request whose fields have the wrong types:
    an object; the text fields strings; keeper/active/restart booleans; succs/preds lists of
    strings; extra an object; heartbeat_period a number; broker an object. Absent fields are
    left to the template and the node's own values."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a spec must be an object, not {type(data).__name__}")
    for k in _STR_FIELDS:
        if k in data and data[k] is not None and not isinstance(data[k], str):
            raise ValueError(f"spec field {k!r} must be a string, not {type(data[k]).__name__}")
    for k in _BOOL_FIELDS:
        if k in data and not isinstance(data[k], bool):
            raise ValueError(f"spec field {k!r} must be true or false, not {type(data[k]).__name__}")
    for k in _LIST_FIELDS:
        if k in data and (not isinstance(data[k], (list, tuple)) or not all(isinstance(x, str) for x in data[k])):
            raise ValueError(f"spec field {k!r} must be a list of instance names")
    if "extra" in data and data["extra"] is not None and not isinstance(data["extra"], Mapping):
        raise ValueError(f"spec field 'extra' must be an object, not {type(data['extra']).__name__}")
    hb = data.get("heartbeat_period")
    if hb is not None and (isinstance(hb, bool) or not isinstance(hb, (int, float))):
        raise ValueError(f"spec field 'heartbeat_period' must be a number, not {type(hb).__name__}")
    if "broker" in data and data["broker"] is not None and not isinstance(data["broker"], Mapping):
        raise ValueError(f"spec field 'broker' must be an object, not {type(data['broker']).__name__}")


# The built-in operators that open MQTT topics of their own, and the params naming them. A
# pipeline is text any deployer (or, before peer spawns ran the admin's text only, any node) could
# write: an mqtt_source on `fog/<c>/agents/<node>/rpc/+` started on that node read what admins
# ask it, under that node's identity, and an mqtt_sink on `fog/<c>/events` handed it on.
MQTT_TOPIC_PARAMS: Dict[str, Tuple[str, ...]] = {
    "agent.operators.taxi:mqtt_source": ("topic",),
    "agent.operators.builtin:mqtt_sink": ("topic",),
    "agent.operators.windows:late_split_sink": ("topic", "late_topic"),
}
# First topic levels that belong to the fleet (its own topic space, the legacy relative form) or
# the broker: an operator's topic may not reach them.
RESERVED_TOPIC_ROOTS = ("fog", "agents")


def topic_refusal(topic: Any) -> Optional[str]:
    """Why an operator may not use the topic (name or filter) `topic`, or None. Refused: a first
    level that is the fleet's (`fog`, `agents`), the broker's (`$...`, e.g. `$SYS`), or a wildcard
    (`+`, `#`: a filter that matches the fleet's topics too); not a string; empty."""
    if not isinstance(topic, str) or not topic:
        return "not a topic"
    first = topic.split("/", 1)[0]
    if first in ("+", "#") or first.startswith("$") or first.lower() in RESERVED_TOPIC_ROOTS:
        return (f"{topic[:80]!r} reaches the fleet's own topics ({', '.join(r + '/...' for r in RESERVED_TOPIC_ROOTS)}, "
                f"$SYS, or a filter starting with a wildcard)")
    return None


def filter_covers(allowed: str, topic: str) -> bool:
    """True when every topic `topic` (a name or a filter) can match is matched by `allowed`:
    level by level, `#` covers the rest, `+` covers one level (not a `#`), a name only itself."""
    a, t = allowed.split("/"), topic.split("/")
    for i, level in enumerate(a):
        if level == "#":
            return True
        if i >= len(t) or t[i] == "#":
            return False
        if level != "+" and level != t[i]:
            return False
        if level == "+" and t[i] == "#":
            return False
    return len(a) == len(t)


def check_mqtt_topics(function: str, params: Mapping[str, Any], allowed: Iterable[str] = (),
                      required: bool = False) -> None:
    """Refuse (ValueError naming the param) an MQTT operator whose topic reaches the fleet's own
    topic space or the broker's (`topic_refusal`), or that its pipeline's signed allow-list
    (`[pipeline] mqtt_topics`, `allowed`) does not cover. `required` (a node that requires signed
    specs): an MQTT operator of a pipeline without an allow-list is refused too, so that the topics
    such an operator reads or writes with this node's identity are the ones an admin signed."""
    allowed = tuple(allowed)
    for key in MQTT_TOPIC_PARAMS.get(function, ()):
        topic = params.get(key) if isinstance(params, Mapping) else None
        if topic is None and key != "topic":
            continue  # an optional topic (late_split_sink's late_topic) left out
        why = topic_refusal(topic)
        if why:
            raise ValueError(f"{function} params.{key}: {why}")
        if not allowed and not required:
            continue
        if not allowed:
            raise ValueError(f"{function} params.{key}: {str(topic)[:80]!r}: the pipeline names no [pipeline] "
                             "mqtt_topics (this node runs MQTT operators only on topics the pipeline's signer allowed)")
        if filter_problem(topic) or not any(filter_covers(a, str(topic)) for a in allowed):
            raise ValueError(f"{function} params.{key}: {str(topic)[:80]!r} is not on the pipeline's [pipeline] "
                             f"mqtt_topics ({', '.join(repr(a[:80]) for a in allowed[:8])})")
