"""`fog-agent deploy pipeline.toml`: publish a pipeline and start its keepers through placement.

Why keepers are started sink first: a source's keeper starts producing the moment it is ready, so
its successor must already be subscribed to its inbox (docs/design.md invariant 2: a message published
to a topic nobody is subscribed to is gone). Starting in reverse pipeline order, and waiting for
each agent's "spawned" reply (sent only after the worker said "ready"), makes every successor of an
instance subscribed before that instance exists.

The pipeline description is published retained on `fog/<cluster>/pipelines/<name>` (the TOML text
itself) so that tools and late agents can read what runs; each keeper's spec carries the text too,
so a node never needs the file.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent import topics
from agent.config import PipelineConfig, load_pipeline_text
from agent.runtime import nodestate, rpc
from agent.runtime.placement import DEFAULT_POLICY, NodeView, PlacementRequest, get_policy
from agent.runtime.spec import BrokerSpec, InstanceSpec, request_spec

log = logging.getLogger(__name__)


class DeployError(RuntimeError):
    """The pipeline could not be deployed (says which operator and why)."""


@dataclass(frozen=True)
class Deployed:
    operator: str
    instance: str
    node: str


def keeper_id(pipeline: str, operator: str) -> str:
    """The keeper's instance id: stable, so a second deploy of the same pipeline is detected."""
    return f"{pipeline}.{operator}.0"


def keeper_specs(
    cfg: PipelineConfig,
    text: str,
    cluster: str,
    broker: BrokerSpec,
    extra: Optional[Dict[str, Any]] = None,
) -> List[InstanceSpec]:
    """One keeper spec per operator, in pipeline order, with the initial routing table (pure)."""
    names = [op.name for op in cfg.operators]
    ids = [keeper_id(cfg.pipeline.name, n) for n in names]
    specs = []
    for i, name in enumerate(names):
        specs.append(InstanceSpec(
            instance=ids[i],
            operator=name,
            node="",  # chosen by placement
            cluster=cluster,
            pipeline=cfg.pipeline.name,
            pipeline_toml=text,
            broker=broker,
            succs=(ids[i + 1],) if i + 1 < len(ids) else (),
            preds=(ids[i - 1],) if i > 0 else (),
            keeper=True,
            active=True,
            extra=dict(extra or {}),
        ))
    return specs


def fleet_from_snapshot(states: Dict[str, bytes], statuses: Dict[str, bytes]) -> List[NodeView]:
    """Placement views from retained state/status payloads keyed by topic."""
    online = {}
    for t, p in statuses.items():
        parsed = topics.parse_any(t)
        if parsed is not None and parsed.kind == "status":
            online[parsed.node] = p == b"online"
    views = []
    for topic, payload in sorted(states.items()):
        if not payload:
            continue
        parsed = topics.parse_any(topic)
        try:
            doc = nodestate.parse_node_state(payload)
            if parsed is None or parsed.kind != "state" or doc["node"] != parsed.node:
                raise ValueError(f"state names node {str(doc['node'])[:40]!r}")
            views.append(nodestate.node_view(doc, online=online.get(doc["node"], False)))
        except (ValueError, TypeError) as exc:  # a hostile neighbour's state: skipped, in one line
            log.warning("ignoring %s: %s", topic[:200], exc)
    return views


def deploy(
    text: str,
    host: str,
    port: int,
    cluster: str,
    extra: Optional[Dict[str, Any]] = None,
    policy_name: str = DEFAULT_POLICY,
    timeout: float = 30.0,
    username: Optional[str] = None,
    password: Optional[str] = None,
    name: str = "pipeline.toml",
    tls: Any = None,
) -> List[Deployed]:
    """Deploy one pipeline description (TOML text); returns where each keeper runs.

    `tls`: the [mqtt.tls] section (ca_file, cert_file, key_file, insecure) or None. The requests
    name the deployer's identity (agent.identity: user name, else the certificate's CN)."""
    cfg = load_pipeline_text(text, name)  # ConfigError says where the file is wrong
    unsupported = cfg.runtime_policy_errors()
    if unsupported:
        raise DeployError(f"{name}: " + "; ".join(unsupported))
    policy = get_policy(policy_name)
    broker = BrokerSpec(host=host, port=port, username=username, password=password)
    specs = keeper_specs(cfg, text, cluster, broker, extra)
    tls_args: Dict[str, Any] = {}
    if tls is not None:
        tls_args = {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file,
                    "tls_insecure": bool(tls.insecure)}
    with rpc.RpcClient(host, port, cluster, username=username, password=password, **tls_args) as client:
        states = client.snapshot(topics.all_agents_state(cluster))
        statuses = client.snapshot(topics.all_agents_status(cluster))
        fleet = fleet_from_snapshot(states, statuses)
        if not any(v.online for v in fleet):
            raise DeployError(f"no agent of cluster {cluster!r} is online at {host}:{port}")
        running = {i for v in fleet for i in v.instances}
        clash = [s.instance for s in specs if s.instance in running]
        if clash:
            raise DeployError(f"pipeline {cfg.pipeline.name!r} is already deployed ({clash[0]} runs)")
        client.publish(topics.pipeline(cluster, cfg.pipeline.name), text.encode(), retain=True)
        placed: List[Deployed] = []
        for spec in reversed(specs):  # sink first: successors subscribed before predecessors exist
            node = _place_one(client, spec, fleet, policy, timeout)
            placed.append(Deployed(spec.operator, spec.instance, node))
            fleet = [dataclasses.replace(v, free_slots=v.free_slots - 1, instances=v.instances + (spec.instance,))
                     if v.node == node else v for v in fleet]
            log.info("keeper %s of %s started on %s", spec.instance, spec.operator, node)
    return list(reversed(placed))


def _place_one(client: rpc.RpcClient, spec: InstanceSpec, fleet: Sequence[NodeView], policy: Any, timeout: float) -> str:
    ranking = policy(PlacementRequest(spec.operator, None, spec.succs + spec.preds), fleet)
    errors: List[str] = []
    for node in ranking:
        body = {"op": "spawn", "spec": request_spec(dataclasses.replace(spec, node=node)), "cause": "deploy"}
        try:
            reply = client.call(node, body, timeout=timeout)
        except rpc.RpcError as exc:
            errors.append(str(exc))
            continue
        if reply.get("ok"):
            return str(reply.get("node", node))
        errors.append(f"{node}: {reply.get('error')}")
    raise DeployError(f"cannot start the keeper of {spec.operator!r}: " + ("; ".join(errors) or "no node has a free slot"))


def undeploy_order(placed: Sequence[Deployed]) -> List[Tuple[str, str]]:
    """(node, instance) pairs source first: stopping producers first lets successors drain."""
    return [(d.node, d.instance) for d in placed]


__all__ = ["DeployError", "Deployed", "deploy", "fleet_from_snapshot", "keeper_id", "keeper_specs", "undeploy_order"]
