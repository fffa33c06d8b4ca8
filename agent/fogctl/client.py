"""fogctl's one MQTT connection: agent.mqtt.requester.Requester with fogctl's settings.

The snapshot (ended by a sync marker), the live streams and the MQTT 5 request/response are
the Requester's, shared with `fog-agent deploy` (agent.node.deploy.RpcClient). Every failure is one
of three exceptions with a one-line message: `BrokerUnreachable` (exit 3, names host:port),
`FogctlError` (exit 1) and `RequestTimeout` (a FogctlError).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Optional

from agent.fogctl.config import FogctlConfig
from agent.mqtt.settings import BrokerSpec
from agent.mqtt.requester import BrokerUnreachable, Message, RequestFailed, Requester, RequestTimeout

__all__ = ["Connection", "FogctlError", "BrokerUnreachable", "RequestTimeout", "Message"]

FogctlError = RequestFailed  # fogctl's one-line failure (exit status 1)


class Connection(Requester):
    """A connected MQTT 5 client owned by the calling thread; use as a context manager.

    docs/security.md: requests name their sender, replies come to replies/<identity>/+
    (agent.identity: user name, else the certificate's CN, else the client id)."""

    def __init__(self, cfg: FogctlConfig) -> None:
        self.cfg = cfg
        host, port = cfg.address
        broker = BrokerSpec(host=host, port=port, keepalive=cfg.keepalive, username=cfg.username,
                            ca_file=cfg.cafile, cert_file=cfg.cert, key_file=cfg.key, tls_insecure=cfg.insecure)
        super().__init__(broker, cfg.cluster, cfg.client_id or f"fogctl-{uuid.uuid4().hex[:12]}",
                         timeout=cfg.timeout)

    def connect(self, timeout: Optional[float] = None) -> "Connection":
        if self.cfg.username is not None:  # read the password file only now (ConfigError names it)
            self.broker = dataclasses.replace(self.broker, password=self.cfg.resolved_password())
        super().connect(timeout)
        return self
