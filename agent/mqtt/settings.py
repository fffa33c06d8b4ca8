"""Where and how a client connects to the broker: host, port, session limits, credentials, TLS.

Why a module of its own at the bottom of agent/mqtt: every client (worker, agent, rpc, fogctl,
collector, shipper) is made from these settings by agent/mqtt/client.py, and an instance spec
carries them to a worker (agent/instance/spec.py), so they must not depend on either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BrokerSpec:
    host: str
    port: int
    keepalive: int = 10
    qos: int = 1
    max_inflight: int = 100
    username: Optional[str] = None
    password: Optional[str] = None
    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    tls_insecure: bool = False  # [mqtt.tls].insecure: no server host name check
    id_secret_file: Optional[str] = None  # [mqtt].client_id_secret_file (agent.mqtt.client.site_secret)
