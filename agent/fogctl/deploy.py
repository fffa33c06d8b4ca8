"""`fogctl deploy`: the same steps as `fog-agent deploy`, over fogctl's own connection.

Why not call `agent.runtime.deploy.deploy()`: it opens a second client without TLS options, and
its retained snapshot waits for a pause in traffic, which never comes while three or more agents
publish their state every half second (measured: a deploy blocked for 8 minutes). fogctl's
snapshot ends at its sync marker instead. The pure parts are shared, so both tools place and
start keepers identically: `keeper_specs` (ids, routing tables), `fleet_from_snapshot`, the
placement policy, sink first (a successor is subscribed before its predecessor exists,
docs/design.md invariant 2), one `spawn` rpc per keeper, answered only after the worker is ready.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from agent import topics
from agent.fogctl.client import Connection, FogctlError

__all__ = ["deploy_pipeline"]


def deploy_pipeline(conn: Connection, text: str, name: str, timeout: float,
                    policy_name: Optional[str] = None) -> Tuple[Any, List[Dict[str, str]]]:
    """Publish the TOML retained and start its keepers; returns (PipelineConfig, placed keepers)."""
    from agent.config import load_pipeline_text
    from agent.runtime.deploy import fleet_from_snapshot, keeper_specs
    from agent.runtime.placement import DEFAULT_POLICY, PlacementRequest, get_policy
    from agent.runtime.spec import BrokerSpec, request_spec

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
    if not any(v.online for v in fleet):
        raise FogctlError(f"no agent of cluster {c.cluster!r} is online at {conn.address}")
    running = {i for v in fleet for i in v.instances}
    clash = [s.instance for s in specs if s.instance in running]
    if clash:
        raise FogctlError(f"pipeline {cfg.pipeline.name!r} is already deployed ({clash[0]} runs)")
    conn.publish(topics.pipeline(c.cluster, cfg.pipeline.name), text.encode("utf-8"), qos=1, retain=True)
    policy = get_policy(policy_name or DEFAULT_POLICY)
    placed: List[Dict[str, str]] = []
    for spec in reversed(specs):  # sink first
        ranking = policy(PlacementRequest(spec.operator, None, spec.succs + spec.preds), fleet)
        errors: List[str] = []
        node = None
        for candidate in ranking:
            body = {"op": "spawn", "cause": "deploy",
                    "spec": request_spec(dataclasses.replace(spec, node=candidate))}
            try:
                reply = conn.rpc(candidate, body, timeout=timeout)
            except FogctlError as exc:
                errors.append(str(exc))
                continue
            if reply.get("ok"):
                node = str(reply.get("node", candidate))
                break
            errors.append(f"{candidate}: {reply.get('error')}")
        if node is None:
            raise FogctlError(f"cannot start the keeper of {spec.operator!r}: "
                              + ("; ".join(errors) or "no online node has a free slot"))
        placed.append({"operator": spec.operator, "instance": spec.instance, "node": node})
        fleet = [dataclasses.replace(v, free_slots=v.free_slots - 1, instances=v.instances + (spec.instance,))
                 if v.node == node else v for v in fleet]
    return cfg, list(reversed(placed))
