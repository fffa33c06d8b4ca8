"""`fogctl deploy`: the same steps as `fog-agent deploy`, over fogctl's own connection.

Why not call `agent.node.deploy.deploy()`: it opens a second client without TLS options, and
its retained snapshot waits for a pause in traffic, which never comes while three or more agents
publish their state every half second (measured: a deploy blocked for 8 minutes). fogctl's
snapshot ends at its sync marker instead. The pure parts are shared, so both tools place and
start keepers identically: `keeper_specs` (ids, routing tables), `fleet_from_snapshot`, the
placement policy, sink first (a successor is subscribed before its predecessor exists,
docs/design.md invariant 2), one `spawn` rpc per keeper, answered only after the worker is ready, and
the transaction around them (`run_deploy`: placement checked before anything is published, every
keeper started or the started ones stopped and the record replaced by a tombstone).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from agent import topics
from agent.fogctl.client import Connection, FogctlError

__all__ = ["DeployFailed", "deploy_pipeline"]


class DeployFailed(FogctlError):
    """A deploy that did not happen; `status` is fogctl's exit status: 1 refused before anything
    was started or published, 4 failed and rolled back, 5 failed and the rollback is incomplete."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def deploy_pipeline(conn: Connection, text: str, name: str, timeout: float,
                    policy_name: Optional[str] = None) -> Tuple[Any, List[Dict[str, str]]]:
    """Publish the TOML retained and start its keepers; returns (PipelineConfig, placed keepers)."""
    from agent.config import load_pipeline_text
    from agent.node.deploy import DeployError, fleet_from_snapshot, keeper_specs, run_deploy
    from agent.node.placement import DEFAULT_POLICY, get_policy
    from agent.instance.spec import BrokerSpec

    cfg = load_pipeline_text(text, name)  # ConfigError names the file and key
    unsupported = cfg.runtime_policy_errors()
    if unsupported:
        raise FogctlError(f"{name}: " + "; ".join(unsupported))
    c = conn.cfg
    host, port = c.address
    broker = BrokerSpec(host=host, port=port, username=c.username, password=c.resolved_password(),
                        ca_file=c.cafile, cert_file=c.cert, key_file=c.key)
    specs = keeper_specs(cfg, text, c.cluster, broker)
    msgs = conn.snapshot([topics.all_agents_state(c.cluster), topics.all_agents_status(c.cluster)])
    states = {t: m.payload for t, m in msgs.items() if t.endswith("/state")}
    statuses = {t: m.payload for t, m in msgs.items() if t.endswith("/status")}
    fleet = fleet_from_snapshot(states, statuses)

    def call(node: str, body: Dict[str, Any]) -> Dict[str, Any]:
        try:
            return conn.rpc(node, body, timeout=timeout)
        except FogctlError as exc:
            return {"ok": False, "error": str(exc)}

    try:
        placed = run_deploy(cfg, text, specs, fleet, get_policy(policy_name or DEFAULT_POLICY), call,
                            lambda topic, payload: conn.publish(topic, payload, qos=1, retain=True), c.cluster,
                            where=conn.address)
    except DeployError as exc:
        raise DeployFailed(str(exc), getattr(exc, "status", 1)) from None
    return cfg, [{"operator": d.operator, "instance": d.instance, "node": d.node} for d in placed]
