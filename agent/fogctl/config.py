"""fogctl settings: defaults < ~/.config/fogctl.toml (or an agent.toml) < FOGCTL_* environment < options.

Why three layers: an operator's laptop keeps the broker and TLS files in the TOML file once, a CI
job sets environment variables, and a one-off look at another cluster uses options. The file is
checked with `agent.schema.load_dataclass`, so a misspelt key is an error that names file and key
instead of a silent fallback to localhost.

An agent.toml can stand in for the file (`fogctl --agent-config agent.toml`): a node's file (or the
one a newcomer wrote for a local agent) already names the broker, the cluster and the credentials,
and copying them into a second file in another format is how the two drift apart.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from agent.config import node_slots_problem as _node_slots
from agent.schema import ConfigError, identifier, in_range, load_dataclass, positive, read_toml

__all__ = ["FogctlConfig", "ENV_VARS", "default_config_path", "for_site", "from_agent_config", "load_config",
           "parse_broker"]


def _broker_check(v: Any) -> Optional[str]:
    try:
        parse_broker(v)
    except ValueError:
        return 'expected "host:port" (port 1-65535)'
    return None


def _sites_check(v: Any) -> Optional[str]:
    for name, broker in v.items():
        if identifier(name) is not None:
            return f"site {name!r}: expected a name of letters, digits, '-', '_' or '.'"
        if not isinstance(broker, str) or _broker_check(broker) is not None:
            return f'site {name}: expected "host:port" (port 1-65535)'
    return None


@dataclass(frozen=True)
class FogctlConfig:
    broker: str = field(default="127.0.0.1:1883", metadata={"check": _broker_check})
    cluster: str = field(default="default", metadata={"check": identifier})
    username: Optional[str] = None
    password: Optional[str] = None
    password_file: Optional[str] = None
    cafile: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    insecure: bool = False
    timeout: float = field(default=5.0, metadata={"check": positive("seconds")})
    keepalive: int = field(default=30, metadata={"check": in_range(5, 65535, "an integer")})
    client_id: Optional[str] = None
    # Each site's own broker (docs/scale.md, "Sites"): `fogctl --site NAME` talks to it instead
    # of `broker`, with the same cluster, credentials and TLS files.
    sites: Dict[str, Any] = field(default_factory=dict, metadata={"check": _sites_check})
    # The admin's Ed25519 private key (PEM): `fogctl deploy` signs the pipeline with it, and agents
    # with [security] admin_keys run only signed pipelines (docs/security.md, "Signed pipeline specs").
    sign_key: Optional[str] = None
    # The slots the admin gave each node (as [security] node_slots of agent.toml): a deploy
    # offers no node more, whatever its state says.
    node_slots: Dict[str, Any] = field(default_factory=dict, metadata={"check": _node_slots})

    @property
    def address(self) -> Tuple[str, int]:
        return parse_broker(self.broker)

    def resolved_password(self) -> Optional[str]:
        if self.password_file:
            try:
                return Path(self.password_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(self.password_file, "", f"cannot read password file ({exc.strerror})") from None
        return self.password


# environment variable -> config field (strings converted like TOML values)
ENV_VARS: Dict[str, str] = {
    "FOGCTL_BROKER": "broker",
    "FOGCTL_CLUSTER": "cluster",
    "FOGCTL_USERNAME": "username",
    "FOGCTL_PASSWORD": "password",
    "FOGCTL_PASSWORD_FILE": "password_file",
    "FOGCTL_CAFILE": "cafile",
    "FOGCTL_CERT": "cert",
    "FOGCTL_KEY": "key",
    "FOGCTL_INSECURE": "insecure",
    "FOGCTL_TIMEOUT": "timeout",
    "FOGCTL_KEEPALIVE": "keepalive",
    "FOGCTL_SIGN_KEY": "sign_key",
}


def for_site(cfg: FogctlConfig, site: str) -> FogctlConfig:
    """`cfg` with the broker of `site` from its `[sites]` table; ConfigError naming the known
    sites if there is none of that name."""
    if site not in cfg.sites:
        known = ", ".join(sorted(cfg.sites)) or "none"
        raise ConfigError("--site", "", f"no site {site!r} in the settings' [sites] table (known: {known})")
    return dataclasses.replace(cfg, broker=cfg.sites[site])


def parse_broker(text: str) -> Tuple[str, int]:
    """`host:port`, `host` (port 1883) or `[v6addr]:port`."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"broker: expected host:port, found {text!r}")
    host, port_s = text, "1883"
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"broker: unclosed '[' in {text!r}")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"broker: expected ':' after ']' in {text!r}")
            port_s = rest[1:]
    elif text.count(":") == 1:
        host, port_s = text.split(":")
    if not host or not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"broker: expected host:port with port 1-65535, found {text!r}")
    return host, int(port_s)


def default_config_path(env: Optional[Mapping[str, str]] = None) -> Path:
    env = os.environ if env is None else env
    if env.get("FOGCTL_CONFIG"):
        return Path(env["FOGCTL_CONFIG"])
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "fogctl.toml"


def from_agent_config(path: Path) -> Dict[str, Any]:
    """The fogctl settings an agent.toml implies: broker, cluster, user name and password (file),
    TLS files. Read with the agent's own loader, so a bad file gives the error `fog-agent run`
    would give; fogctl keeps its own keepalive and timeout (an agent's are tuned for a daemon)."""
    from agent.config import load_agent_config

    cfg = load_agent_config(path)
    m = cfg.mqtt
    host = f"[{m.host}]" if ":" in m.host else m.host
    out: Dict[str, Any] = {"broker": f"{host}:{m.port}", "cluster": cfg.agent.cluster,
                           "username": m.username, "password": m.password, "password_file": m.password_file}
    if m.tls is not None:
        out.update(cafile=m.tls.ca_file, cert=m.tls.cert_file, key=m.tls.key_file, insecure=m.tls.insecure)
    if cfg.security.node_slots:
        out["node_slots"] = dict(cfg.security.node_slots)
    return {k: v for k, v in out.items() if v is not None}


def _from_env(env: Mapping[str, str]) -> Dict[str, Any]:
    types = {f.name: f.type for f in dataclasses.fields(FogctlConfig)}
    out: Dict[str, Any] = {}
    for var, name in ENV_VARS.items():
        if var not in env or env[var] == "":
            continue
        raw = env[var]
        tp = str(types[name])
        try:
            if "bool" in tp:
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError
                out[name] = raw.lower() in ("1", "true", "yes")
            elif "float" in tp:
                out[name] = float(raw)
            elif "int" in tp:
                out[name] = int(raw)
            else:
                out[name] = raw
        except ValueError:
            raise ConfigError(var, "", f"expected {tp.replace('Optional[', '').rstrip(']')}", raw) from None
    return out


def load_config(
    overrides: Optional[Mapping[str, Any]] = None,
    env: Optional[Mapping[str, str]] = None,
    path: Optional[Path] = None,
    agent_config: Optional[Path] = None,
) -> FogctlConfig:
    """Merge the layers; `overrides` are the command-line values (None = not given). With
    `agent_config`, that agent.toml's broker settings are the file layer instead of fogctl.toml."""
    env = os.environ if env is None else env
    data: Dict[str, Any] = {}
    if agent_config is not None:
        data.update(from_agent_config(agent_config))
        file_name = str(agent_config)
    else:
        path = path or default_config_path(env)
        if path.exists():
            data.update(read_toml(path))
        file_name = str(path)
    cfg = load_dataclass(FogctlConfig, data, file_name)  # file errors name the file
    merged = dataclasses.asdict(cfg)
    env_values = _from_env(env)
    merged.update(env_values)
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    source = "command line / environment" if env_values or overrides else file_name
    return load_dataclass(FogctlConfig, merged, source)
