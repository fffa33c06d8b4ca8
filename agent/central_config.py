"""`central.toml`: configuration of the central collector and of its batch analytics job.

Same loader and error contract as `agent.config` (`agent.schema.load_dataclass`: unknown keys are
errors, messages name file and key). The `[mqtt]` table is the agent's own `MqttSection`, so the
collector reaches the broker exactly like an agent does: `[mqtt.tls]` (ca_file, cert_file,
key_file) is the same section, loaded and checked by the same code (`agent.config.check_tls`), and
the certificate's CN is the collector's identity on the bus, the name the mosquitto role lists in
`mosquitto_collector_identities` (docs/security.md, "Identities").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from agent.config import MqttSection, _with_source
from agent.schema import identifier, load_dataclass, non_negative, positive, read_toml

__all__ = ["AnalyticsSection", "CentralConfig", "CollectorSection", "load_central_config"]


@dataclass(frozen=True)
class CollectorSection:
    cluster: str = field(default="default", metadata={"check": identifier})
    landing_dir: str = "/var/lib/fog-collector/landing"
    client_id: str = field(default="fog-collector", metadata={"check": identifier})
    # A file whose chunks stop arriving is forgotten after this long (the shipper resends it).
    partial_timeout: float = field(default=600.0, metadata={"check": positive("seconds")})


@dataclass(frozen=True)
class AnalyticsSection:
    enabled: bool = True
    out_dir: str = "/var/lib/fog-collector/analytics"
    master: str = "local[*]"
    # Run the batch job when new files landed and this long passed since the last run (0: never
    # by time) or as soon as `trigger_files` new files landed (0: never by count).
    schedule_seconds: float = field(default=3600.0, metadata={"check": non_negative("seconds")})
    trigger_files: int = field(default=0, metadata={"check": non_negative("files")})


@dataclass(frozen=True)
class CentralConfig:
    collector: CollectorSection = CollectorSection()
    mqtt: MqttSection = MqttSection()
    analytics: AnalyticsSection = AnalyticsSection()
    source: str = field(default="<memory>", init=False, compare=False)


def load_central_config(path: Union[str, Path]) -> CentralConfig:
    path = Path(path)
    cfg = load_dataclass(CentralConfig, read_toml(path), path.name)
    return _with_source(cfg, path)
