"""The two configuration files: one `agent.toml` per node, one pipeline description per pipeline.

Both load into frozen dataclasses (see `agent.schema` for the error contract). Defaults are the
papers' values where a paper gives one (r = 0.7, up = 0.8, down = 0.6) so that an example config
reproduces the published set-up without tuning.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from agent.refs import check_module_name, current_ref, parse_ref
from agent.schema import (
    ConfigError,
    identifier,
    in_range,
    load_dataclass,
    non_negative,
    positive,
    read_toml,
)

DEFAULT_AGENT_CONFIG = Path("/etc/fog-agent/agent.toml")


def _module_function(v: Any) -> Optional[str]:
    try:
        parse_ref(v)
    except ValueError as exc:
        return str(exc)
    return None


def _operator_modules(v: Any) -> Optional[str]:
    for m in v:
        why = check_module_name(m)
        if why:
            return f"{m!r}: {why}"
    return None


def _absolute_paths(v: Any) -> Optional[str]:
    bad = [p for p in v if not os.path.isabs(p)]
    return f"expected absolute paths ({bad[0]!r} is not)" if bad else None


def node_slots_problem(v: Any) -> Optional[str]:
    bad = [k for k, n in v.items() if isinstance(n, bool) or not isinstance(n, int) or n < 0]
    return f"expected a table of node name = slots (a whole number >= 0; {bad[0]!r} is not)" if bad else None


def _topic_filters(v: Any) -> Optional[str]:
    from agent.topics import filter_problem

    for t in v:
        why = filter_problem(t)
        if why:
            return f"expected MQTT topic names or filters ({t!r}: {why})"
    return None


# ---- agent.toml ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentSection:
    node: str = field(metadata={"check": identifier})
    cluster: str = field(default="default", metadata={"check": identifier})
    slots: int = field(default=4, metadata={"check": in_range(1, 1024, "an integer")})
    state_dir: str = "/var/lib/fog-agent"
    state_period: float = field(default=5.0, metadata={"check": positive("seconds")})
    heartbeat_period: float = field(default=1.0, metadata={"check": positive("seconds")})
    shutdown_timeout: float = field(default=10.0, metadata={"check": positive("seconds")})
    # A node offline this long is gone: the lowest-named online agent starts its instances
    # elsewhere with the same identity (agent.node.rehome), keyed ones on the standby that holds
    # a copy of their state (`keyed_standby`). Longer than a reboot (a Pi boots and its agent is
    # online again well within it: docs/reliability.md). 0 never re-homes: the dead node's
    # routes wait for it, losing nothing while it comes back.
    dead_after: float = field(default=60.0, metadata={"check": non_negative("seconds")})
    # A keyed instance's saved state is copied to a standby agent on another node, and its inputs
    # are acked upstream only once the standby holds them (agent.node.replicas): a re-home after
    # the node is lost for good starts from that copy. Off: the state lives on its node only.
    keyed_standby: bool = True
    # Directories besides state_dir (and the spool dir) where a spec's `extra.sink_dir` may point,
    # e.g. shared storage for the sinks' id files (docs/security.md: paths in requests).
    sink_dirs: Tuple[str, ...] = field(default=(), metadata={"check": _absolute_paths})


@dataclass(frozen=True)
class TlsSection:
    ca_file: str
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file (the client certificate)")


def _host(v: Any) -> Optional[str]:
    # "" would make paho connect to nothing and fail only at `run`
    ok = bool(v.strip()) and not any(c.isspace() for c in v)
    return None if ok else "expected a host name or address"


@dataclass(frozen=True)
class MqttSection:
    host: str = field(default="127.0.0.1", metadata={"check": _host})
    port: int = field(default=1883, metadata={"check": in_range(1, 65535, "an integer")})
    keepalive: int = field(default=10, metadata={"check": in_range(1, 65535, "an integer")})
    username: Optional[str] = None
    password: Optional[str] = None
    password_file: Optional[str] = None
    qos: int = field(default=1, metadata={"check": in_range(1, 2, "an integer")})
    max_inflight: int = field(default=100, metadata={"check": in_range(1, 65535, "an integer")})
    tls: Optional[TlsSection] = None
    # The site secret that makes the workers' client ids unguessable (docs/security.md, "Client
    # ids"); the same file on every node of the site.
    client_id_secret_file: Optional[str] = None
    # Per-node inboxes (docs/security.md, "Who may read an inbox"): the workers read
    # `inbox/<this node>/<instance>/+`, so the role's ACL can let a node read only its own
    # instances' records. false = the shared format of before (every node reads every inbox),
    # for a fleet whose broker still has the ACL of before; the whole site must agree.
    inbox_per_node: bool = True

    def __post_init__(self) -> None:
        if self.password is not None and self.password_file is not None:
            raise ValueError("set password or password_file, not both")


@dataclass(frozen=True)
class LogSection:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "human", "kv", "journal"] = "auto"


@dataclass(frozen=True)
class MetricsSection:
    port: int = field(default=0, metadata={"check": in_range(0, 65535, "an integer")})
    address: str = "127.0.0.1"


@dataclass(frozen=True)
class SpillSection:
    enabled: bool = False
    spool_dir: str = "/var/lib/fog-agent/spool"
    max_bytes: int = field(default=512 * 1024 * 1024, metadata={"check": positive("bytes")})
    rotate_bytes: int = field(default=4 * 1024 * 1024, metadata={"check": positive("bytes")})
    rotate_seconds: float = field(default=60.0, metadata={"check": positive("seconds")})
    ship: Literal["mqtt", "path", "none"] = "mqtt"
    ship_path: Optional[str] = None
    # When a spilling sink acks upstream: once written to its spool, or once its spool files
    # landed at the centre (agent.spill.ackhold; docs/reliability.md, "Re-homing and a sink").
    ack: Literal["written", "landed"] = "written"

    def __post_init__(self) -> None:
        if self.enabled and self.ack == "landed" and self.ship == "none":
            raise ValueError('ack = "landed" needs a shipper (ship = "mqtt" or "path"): with ship = "none" '
                             "nothing lands and the sinks would never ack")


@dataclass(frozen=True)
class LatencySection:
    period: float = field(default=5.0, metadata={"check": positive("seconds")})
    smoothing: float = field(default=0.3, metadata={"check": in_range(0.0, 1.0)})
    echo_port: int = field(default=0, metadata={"check": in_range(0, 65535, "an integer")})


@dataclass(frozen=True)
class OperatorsSection:
    """The node's own operator modules: their public functions may run here, beside the built-in
    operators and those installed packages register (entry points `fog_agent.operators`).
    Fixed on the node, never by a request (docs/security.md, "No code from the bus")."""

    modules: Tuple[str, ...] = field(default=(), metadata={"check": _operator_modules})


def _hook(v: Any) -> Optional[str]:
    if not v:
        return None
    if not all(isinstance(a, str) and a and "\0" not in a for a in v):
        return "expected a list of non-empty strings (the command and its arguments; no shell)"
    return None


@dataclass(frozen=True)
class SiteManagerSection:
    """Node-level elasticity (docs/site-manager.md). The hooks are argv lists run with the node's
    name appended; they come from this file only, never from the bus (docs/security.md)."""

    enabled: bool = False
    target: float = field(default=0.3, metadata={"check": in_range(0.0, 0.95)})
    min_nodes: int = field(default=1, metadata={"check": in_range(1, 10000, "an integer")})
    max_nodes: int = field(default=64, metadata={"check": in_range(1, 10000, "an integer")})
    cooldown: float = field(default=60.0, metadata={"check": non_negative("seconds")})
    timeout: float = field(default=300.0, metadata={"check": positive("seconds")})
    lease: float = field(default=15.0, metadata={"check": in_range(1.0, 3600.0, "seconds")})
    period: float = field(default=5.0, metadata={"check": positive("seconds")})
    release_hook: Tuple[str, ...] = field(default=(), metadata={"check": _hook})
    acquire_hook: Tuple[str, ...] = field(default=(), metadata={"check": _hook})

    def __post_init__(self) -> None:
        if self.min_nodes > self.max_nodes:
            raise ValueError("min_nodes must not exceed max_nodes")
        if self.period * 2 >= self.lease:
            raise ValueError(f"lease ({self.lease}) must exceed two periods ({self.period}): the leader renews every period")


@dataclass(frozen=True)
class SecuritySection:
    """Who may say which pipelines this node runs (docs/security.md, "Signed pipeline specs"),
    and how many slots each node may offer (`node_slots`).

    `admin_keys`: absolute paths of the admins' Ed25519 public keys (PEM). Set (the Ansible role
    always sets one): every spec this node runs, spawns, re-homes or re-adopts must carry a valid
    signature of one of them, and MQTT operators must be on their pipeline's `mqtt_topics`. Empty:
    signatures are not required (a fleet without admin keys)."""

    admin_keys: Tuple[str, ...] = field(default=(), metadata={"check": _absolute_paths})
    # The slots the admin gave each node (the role writes every inventory host's
    # fog_agent_slots): a node's state may offer no more, so a node that lies about its free slots
    # does not draw every placement to itself. A node not listed is taken at its word; empty: all.
    node_slots: Dict[str, Any] = field(default_factory=dict, metadata={"check": node_slots_problem})


@dataclass(frozen=True)
class AgentConfig:
    agent: AgentSection
    operators: OperatorsSection = OperatorsSection()
    mqtt: MqttSection = MqttSection()
    log: LogSection = LogSection()
    metrics: MetricsSection = MetricsSection()
    spill: SpillSection = SpillSection()
    latency: LatencySection = LatencySection()
    site_manager: SiteManagerSection = SiteManagerSection()
    security: SecuritySection = SecuritySection()
    source: str = field(default="<memory>", init=False, compare=False)


def load_agent_config(path: Union[str, Path]) -> AgentConfig:
    path = Path(path)
    data = read_toml(path)
    cfg = load_dataclass(AgentConfig, data, path.name)
    return _with_source(cfg, path)


def _with_source(cfg: Any, path: Path) -> Any:
    object.__setattr__(cfg, "source", str(path))
    return cfg


# ---- pipeline.toml ------------------------------------------------------------------------------


# What the worker's scaling driver runs: the paper's protocol core decides for "decentralized";
# the Gesscale policies run through agent.policy.live (docs/measurement.md, "Policies in the daemon").
RUNTIME_POLICIES = ("decentralized", "threshold", "model", "sized", "seasonal", "planned", "none")


MAX_PROFILE_SLOTS = 10080  # a week of minutes


def _profile(v: Any) -> Optional[str]:
    if len(v) > MAX_PROFILE_SLOTS or not all(math.isfinite(x) and x >= 0 for x in v):
        return f"expected at most {MAX_PROFILE_SLOTS} finite numbers >= 0 (records/s per slot)"
    return None


def _finite(v: Any) -> Optional[str]:
    return None if math.isfinite(v) else "expected a finite number"


@dataclass(frozen=True)
class ScalingSection:
    """Parameters of the scaling decision (paper section 3.3 defaults)."""

    policy: Literal["decentralized", "threshold", "model", "sized", "seasonal", "planned", "none"] = "decentralized"
    target_ratio: float = field(default=0.7, metadata={"check": in_range(0.01, 1.0)})
    up: float = field(default=0.8, metadata={"check": in_range(0.01, 10.0)})
    down: float = field(default=0.6, metadata={"check": in_range(0.0, 10.0)})
    period: float = field(default=5.0, metadata={"check": positive("seconds")})
    capacity: Union[float, Literal["calibrate"]] = field(
        # finite: an infinite capacity makes every load ratio 0, so the operator never scales out
        default=500.0, metadata={"check": lambda v: None if v == "calibrate" or (v > 0 and math.isfinite(v))
                                 else 'expected a finite number > 0 or "calibrate"'}
    )
    r_secure: bool = False
    # Runtime (docs/scaling.md, "max_instances and min_instances"): max_instances bounds every
    # instance that exists (starting, active, terminating), refused at the agents' createNode():
    # hard on one agent, as fresh as the retained states across agents. min_instances is for the
    # simulator's baselines: instances terminate alone, only the keeper is always kept.
    min_instances: int = field(default=1, metadata={"check": in_range(1, 100000, "an integer")})
    max_instances: int = field(default=64, metadata={"check": in_range(1, 100000, "an integer")})
    cooldown: float = field(default=0.0, metadata={"check": non_negative("seconds")})
    # `seasonal` and `planned` only (docs/measurement.md, "A profile for a live seasonal or planned operator"): the
    # operator's mean input per slot of the day, learned from earlier days; slot j covers the
    # `profile_slot` seconds from profile_start + j x profile_slot (unix time) on, repeating
    # every len(profile) slots. Bounded: the section arrives over the bus with a deployment.
    profile: Tuple[float, ...] = field(default=(), metadata={"check": _profile})
    profile_slot: float = field(default=60.0, metadata={"check": positive("seconds")})
    profile_start: float = field(default=0.0, metadata={"check": _finite})

    def __post_init__(self) -> None:
        if self.profile and self.policy not in ("seasonal", "planned"):
            raise ValueError(f'profile is read by policy = "seasonal" or "planned" only, not {self.policy!r}')
        if self.down >= self.up:
            raise ValueError(f"down ({self.down}) must be lower than up ({self.up})")
        if self.min_instances > self.max_instances:
            raise ValueError("min_instances must not exceed max_instances")


@dataclass(frozen=True)
class WatermarkSection:
    """`[operator.watermark]` of the source: its records' event time and how far out of order its
    own data comes. With it, watermarks flow with the batches through every stage and keyed
    operators fire and judge lateness by them (agent.dataplane.watermarks; docs/operators.md,
    "Watermarks that flow"); without it each keyed instance keeps its own watermark."""

    time_field: str = field(metadata={"check": lambda v: None if v else "expected a field name"})
    time_unit: Literal["s", "ms"] = "s"
    disorder_ms: float = field(default=0.0, metadata={"check": in_range(0.0, 2.0 ** 53, "milliseconds")})
    # no record for this long: the source is idle and stops holding watermarks back
    idle_after: Optional[float] = field(default=None, metadata={"check": positive("seconds")})
    # the field naming each record's channel (e.g. the sensor): each channel comes in order, not
    # with the others; the source's mark is the least over the channels (agent.dataplane.watermarks)
    channel_field: Optional[str] = field(default=None,
                                         metadata={"check": lambda v: None if v else "expected a field name"})
    # the channels it keeps at most (their values come from the data): at the bound idle ones are
    # forgotten first, and a channel that finds no room holds the mark of no other back
    max_channels: int = field(default=4096, metadata={"check": in_range(1, 1_000_000, "an integer")})


@dataclass(frozen=True)
class OperatorSection:
    name: str = field(metadata={"check": identifier})
    function: str = field(metadata={"check": _module_function})
    kind: Literal["source", "map", "sink"] = "map"
    key: Optional[str] = None
    # The number of key groups of THIS operator's input (its predecessor's `key` routes records to
    # its instances by group; a keyed operator keeps its state per group): fixed for the life of a
    # deployment (agent.dataplane.keygroups).
    key_groups: int = field(default=128, metadata={"check": in_range(1, 65536, "an integer")})
    batch_size: int = field(default=100, metadata={"check": in_range(1, 100000, "an integer")})
    linger_ms: float = field(default=20.0, metadata={"check": non_negative("milliseconds")})
    service_time_ms: float = field(default=0.0, metadata={"check": non_negative("milliseconds")})
    max_inflight_batches: int = field(default=8, metadata={"check": in_range(1, 10000, "an integer")})
    scaling: Optional[ScalingSection] = None
    params: Dict[str, Any] = field(default_factory=dict)
    watermark: Optional[WatermarkSection] = None  # a source only

    def __post_init__(self) -> None:
        object.__setattr__(self, "function", current_ref(self.function))


@dataclass(frozen=True)
class PipelineSection:
    name: str = field(metadata={"check": identifier})
    coordination: Literal["ack", "fgme"] = "ack"
    # coordination = "fgme" only: the lock nodes use 2-FGME's DEVIATION 4 damping (docs/gme.md,
    # "Damping in lock-guarded scaling"); on unless set to false (the published line 79), the
    # default of every entry point that runs the lock: agent.protocol.gme_fgme.DAMPING_DEFAULT, a
    # layer above this module, so written out here (tests/test_config checks that they agree)
    fgme_damping: bool = True
    # Host consecutive keepers placed on one node in one worker process, batches between them
    # handed over in memory (docs/runtime.md, "Chaining"). Off: one process per instance.
    chain: bool = False
    # The MQTT topics (names or filters) this pipeline's mqtt_source / mqtt_sink operators may use:
    # part of the text an admin signs, checked on every node before such an operator starts
    # (agent.operators.admission.check_mqtt_topics; required on a node that requires signatures).
    mqtt_topics: Tuple[str, ...] = field(default=(), metadata={"check": _topic_filters})


@dataclass(frozen=True)
class PipelineConfig:
    pipeline: PipelineSection
    operators: Tuple[OperatorSection, ...] = field(metadata={"key": "operator"})
    scaling: ScalingSection = ScalingSection()
    source: str = field(default="<memory>", init=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.operators) < 2:
            raise ValueError("a pipeline needs at least two [[operator]] tables (a source and a sink)")
        names = [op.name for op in self.operators]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"operator name {dupes[0]!r} is used twice")
        if self.operators[0].kind != "source":
            raise ValueError('the first operator must have kind = "source"')
        if self.operators[-1].kind != "sink":
            raise ValueError('the last operator must have kind = "sink"')
        for op in self.operators[1:]:
            if op.watermark is not None:
                raise ValueError(f"operator {op.name!r}: [operator.watermark] belongs to the source (the first operator)")

    def runtime_policy_errors(self) -> List[str]:
        """Operators whose policy the agent cannot run (every policy the config accepts runs today;
        kept so that deploy and check-config refuse, naming the operator, any policy added to the
        config before the worker honours it)."""
        return [
            f'operator {op.name!r}: [scaling] policy = "{self.scaling_for(op.name).policy}": the agent runs '
            f'"{" or ".join(RUNTIME_POLICIES)}"'
            for op in self.operators if self.scaling_for(op.name).policy not in RUNTIME_POLICIES
        ]

    def scaling_notes(self) -> List[str]:
        """What the agent makes of the [scaling] instance bounds, said where it differs from a
        reading of the names (check-config prints these as warnings; docs/scaling.md,
        "max_instances and min_instances")."""
        notes = []
        default = ScalingSection().max_instances
        for op in self.operators:
            sc = self.scaling_for(op.name)
            if sc.policy != "decentralized" or op.kind == "source":
                continue  # "none": no automatic decision; a source never scales
            if sc.min_instances > 1:
                notes.append(f"operator {op.name!r}: min_instances = {sc.min_instances} is not enforced by the "
                             "agent (instances terminate alone; only the keeper is always kept, so >= 1)")
            if sc.max_instances < default:
                notes.append(f"operator {op.name!r}: max_instances = {sc.max_instances} bounds every instance "
                             "(starting ones included) and is exact when copies are requested through one agent; "
                             "agents placing copies within one state period of each other may exceed it")
        return notes

    def scaling_for(self, operator: str) -> ScalingSection:
        """The operator's own [operator.scaling] table, else the pipeline-wide [scaling] table."""
        op = self.operator(operator)
        return op.scaling if op.scaling is not None else self.scaling

    def operator(self, name: str) -> OperatorSection:
        for op in self.operators:
            if op.name == name:
                return op
        raise KeyError(name)

    def index(self, name: str) -> int:
        return [op.name for op in self.operators].index(name)


def load_pipeline(path: Union[str, Path]) -> PipelineConfig:
    path = Path(path)
    data = read_toml(path)
    cfg = load_dataclass(PipelineConfig, data, path.name)
    return _with_source(cfg, path)


def load_pipeline_text(text: str, name: str = "pipeline.toml") -> PipelineConfig:
    """Parse a pipeline description received over MQTT (retained deploy message)."""
    from agent.schema import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(name, "", f"invalid TOML ({exc})") from None
    return load_dataclass(PipelineConfig, data, name)


def resolve_password(mqtt: MqttSection) -> Optional[str]:
    """Read a password file lazily so that secrets never sit in the TOML or in `check-config`."""
    if mqtt.password_file:
        try:
            return Path(mqtt.password_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(mqtt.password_file, "", f"cannot read password file ({exc.strerror})") from None
    return mqtt.password


def check_tls(mqtt: MqttSection, config_file: Optional[str] = None) -> None:
    """Load the [mqtt.tls] files now: a missing, unreadable or invalid CA, certificate or key is
    one ConfigError (exit 78 for `fog-agent run` and `fog-agent collector`), not a traceback at
    connect.

    With `config_file` (the TOML that names the files) the line names that file, the key and what
    was expected: `central.toml: [mqtt.tls].key_file: expected a readable PEM file (No such file
    or directory), got "/etc/x.key"`; without it, `<TLS file>: <what is wrong>`."""
    if mqtt.client_id_secret_file is not None:
        try:
            secret = Path(mqtt.client_id_secret_file).read_bytes().strip()
        except OSError as exc:
            secret, why = b"", str(exc.strerror)
        else:
            why = "empty"
        if len(secret) < 16:
            why = why if not secret else "shorter than 16 bytes"
            if config_file is None:
                raise ConfigError(mqtt.client_id_secret_file, "", f"unusable client id secret ({why})")
            raise ConfigError(Path(config_file).name, "[mqtt].client_id_secret_file",
                              f"expected a readable file of at least 16 bytes ({why})",
                              got=mqtt.client_id_secret_file)
    tls = mqtt.tls
    if tls is None:
        return
    import ssl

    def error(key: str, path: str, expected: str, short: str, why: str) -> ConfigError:
        if config_file is None:
            return ConfigError(path, "", f"{short} ({why})")
        return ConfigError(Path(config_file).name, f"[mqtt.tls].{key}", f"expected {expected} ({why})", got=path)

    for key, path in (("ca_file", tls.ca_file), ("cert_file", tls.cert_file), ("key_file", tls.key_file)):
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise error(key, path, "a readable PEM file", "cannot read TLS file", str(exc.strerror)) from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=tls.ca_file)
    except ssl.SSLError as exc:
        raise error("ca_file", tls.ca_file, "a PEM CA certificate", "not a PEM CA certificate",
                    str(exc.reason or exc)) from None
    if tls.cert_file:
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        except ssl.SSLError as exc:
            raise error("cert_file", tls.cert_file, "a PEM client certificate that loads with key_file",
                        "client certificate and key do not load", str(exc.reason or exc)) from None


def default_config_path() -> Path:
    return Path(os.environ.get("FOG_AGENT_CONFIG", str(DEFAULT_AGENT_CONFIG)))
