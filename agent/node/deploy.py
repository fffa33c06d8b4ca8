"""`fog-agent deploy pipeline.toml`: publish a pipeline and start its keepers through placement.

Why keepers are started sink first: a source's keeper starts producing the moment it is ready, so
its successor must already be subscribed to its inbox (docs/design.md invariant 2: a message published
to a topic nobody is subscribed to is gone). Starting in reverse pipeline order, and waiting for
each agent's "spawned" reply (sent only after the worker said "ready"), makes every successor of an
instance subscribed before that instance exists.

The pipeline description is published retained on `fog/<cluster>/pipelines/<name>` (the TOML text
itself) so that tools and late agents can read what runs; each keeper's spec carries the text too,
so a node never needs the file.

A deploy is a transaction (docs/fogctl.md, "Deploy and undeploy"): placement is checked first
against the free slots of the retained agent states (`plan_placement`: nothing is published when
the keepers do not fit), then every keeper starts, or the ones that did are stopped and the record
is replaced by a tombstone (`run_deploy`). Each deploy has a generation id, carried in the record
(`stamp`) and in every spec (`extra["generation"]`, inherited by every copy), and an undeploy
leaves a tombstone naming it (`tombstone`). An agent keeps or re-adopts a stored spec only while
`stale_reason` finds no reason against it; see that function for the case of no record at all.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from agent import exitcodes, topics
from agent.config import PipelineConfig, load_pipeline_text
from agent.control.records import GENERATION_KEY, new_generation, stamp, tombstone
from agent.signing import SIGNATURE_KEY, Signer
from agent.node import chains, nodestate
from agent.node.placement import DEFAULT_POLICY, NodeView, PlacementRequest, get_policy
from agent.instance.spec import InstanceSpec, request_spec
from agent.mqtt.settings import BrokerSpec
from agent.mqtt.requester import RequestFailed, Requester

RpcError = RequestFailed  # a call failed: timeout, refused by the remote agent, or undecodable reply

log = logging.getLogger(__name__)


class RpcClient(Requester):
    """Blocking caller for tools (`fog-agent deploy`, the demo, tests): the Requester (one paho
    client, its own network thread, the caller's thread publishes and waits) with host/port
    arguments and RpcError. Its request/reply code is fogctl's (agent.mqtt.requester)."""

    def __init__(self, host: str, port: int, cluster: str, client_id: Optional[str] = None,
                 username: Optional[str] = None, password: Optional[str] = None,
                 identity: Optional[str] = None, cert_file: Optional[str] = None,
                 ca_file: Optional[str] = None, key_file: Optional[str] = None, tls_insecure: bool = False) -> None:
        broker = BrokerSpec(host=host, port=port, username=username, password=password, ca_file=ca_file,
                            cert_file=cert_file, key_file=key_file, tls_insecure=tls_insecure)
        super().__init__(broker, cluster, client_id, identity=identity)

    def connect(self, timeout: Optional[float] = None) -> "RpcClient":
        super().connect(timeout)
        return self

    def snapshot(self, topic_filter: Any, settle: float = 0.3, timeout: float = 10.0) -> Any:  # type: ignore[override]
        """Retained messages under one filter, by topic, ended by a sync marker (Requester.snapshot);
        `timeout` is a hard deadline for the whole snapshot, `settle` is kept for callers of the
        old signature and ignored. A list of filters: Requester.snapshot (payloads as Messages)."""
        del settle
        if not isinstance(topic_filter, str):
            return super().snapshot(topic_filter, timeout)
        return {t: m.payload for t, m in super().snapshot([topic_filter], timeout).items()}

    def call(self, node: str, body: Dict[str, Any], timeout: float = 30.0) -> Dict[str, Any]:
        """Send one request to `node`'s agent and wait for its reply; raise RpcError on failure."""
        reply = self.rpc(node, body, timeout)
        if not isinstance(reply.get("ok"), bool):
            raise RpcError(f"bad reply from {node}: reply without a boolean 'ok'")
        return reply


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


def fleet_from_snapshot(states: Dict[str, bytes], statuses: Dict[str, bytes],
                        node_slots: Optional[Mapping[str, int]] = None) -> List[NodeView]:
    """Placement views from retained state/status payloads keyed by topic; `node_slots`: the
    slots the admin gave each node, which its state may not exceed (`nodestate.node_view`)."""
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
            views.append(nodestate.node_view(doc, online=online.get(doc["node"], False),
                                             max_slots=(node_slots or {}).get(doc["node"])))
        except (ValueError, TypeError) as exc:  # a hostile neighbour's state: skipped, in one line
            log.warning("ignoring %s: %s", topic[:200], exc)
    return views


class DeployRefused(DeployError):
    """Refused before anything was started or published (no online agent, no room, a clash)."""

    status = exitcodes.ERROR


class DeployRolledBack(DeployError):
    """A keeper could not start: the started ones were stopped, the record is a tombstone."""

    status = exitcodes.ROLLED_BACK


class RollbackIncomplete(DeployError):
    """A keeper could not start and stopping the started ones failed too (the message names them)."""

    status = exitcodes.ROLLBACK_INCOMPLETE


Call = Callable[[str, Dict[str, Any]], Dict[str, Any]]  # (node, request) -> reply; errors as ok=false
Publish = Callable[[str, bytes], None]  # retained, QoS 1


def plan_placement(specs: Sequence[InstanceSpec], fleet: Sequence[NodeView], policy: Any) -> Optional[str]:
    """Why the keepers do not fit on the online nodes' free slots (pure), or None when they do.
    Placement is simulated as the deploy will run it (sink first, one slot per keeper)."""
    views = list(fleet)
    for spec in reversed(specs):
        ranking = policy(PlacementRequest(spec.operator, None, spec.succs + spec.preds), views)
        if not ranking:
            online = [v for v in fleet if v.online]
            free = sum(max(0, v.free_slots) for v in online)
            per = ", ".join(f"{v.node} {max(0, v.free_slots)}" for v in online)
            return (f"its {len(specs)} keeper(s) need {len(specs)} free slot(s), the online nodes have "
                    f"{free} ({per or 'none online'})")
        views = _take_slot(views, ranking[0], spec.instance)
    return None


def _take_slot(views: Sequence[NodeView], node: str, instance: str) -> List[NodeView]:
    """The views after `instance` took one slot on `node`."""
    return [dataclasses.replace(v, free_slots=v.free_slots - 1, instances=v.instances + (instance,))
            if v.node == node else v for v in views]


def run_deploy(cfg: PipelineConfig, text: str, specs: Sequence[InstanceSpec], fleet: Sequence[NodeView],
               policy: Any, call: Call, publish: Publish, cluster: str,
               generation: Optional[str] = None, where: str = "", signer: Optional[Signer] = None) -> List[Deployed]:
    """The transaction, over any client (`call`, `publish`): check, publish, start every keeper
    sink first, or roll back. Raises DeployRefused / DeployRolledBack / RollbackIncomplete with a
    one-line message that says which. `signer`: the admin's key (agent.signing); the record and
    every keeper's spec then carry its signature over the text, name and generation, which agents
    that require signatures check before they run any instance of it."""
    name = cfg.pipeline.name
    if not any(v.online for v in fleet):
        raise DeployRefused(f"no agent of cluster {cluster!r} is online" + (f" at {where}" if where else ""))
    running = {i for v in fleet for i in v.instances}
    clash = [s.instance for s in specs if s.instance in running]
    if clash:
        raise DeployRefused(f"pipeline {name!r} is already deployed ({clash[0]} runs)")
    problem = plan_placement(specs, fleet, policy)
    if problem:
        raise DeployRefused(f"deploy of {name} refused: {problem}; nothing was started or published")
    gen = generation or new_generation()
    signature = signer.sign(name, gen, text) if signer is not None else None
    stamps: Dict[str, Any] = {GENERATION_KEY: gen}
    if signature is not None:
        stamps[SIGNATURE_KEY] = signature.to_extra()
    specs = [dataclasses.replace(s, extra=dict(s.extra, **stamps)) for s in specs]
    topic = topics.pipeline(cluster, name)
    publish(topic, stamp(text, gen, signature).encode("utf-8"))
    placed: List[Deployed] = []
    views = list(fleet)
    # chain = true: groups of consecutive keepers, sink first, each on one node (docs/runtime.md,
    # "Chaining"); off: every keeper alone, as before.
    groups = chains.plan_chains(specs, views, policy) if cfg.pipeline.chain else [("", [s]) for s in reversed(specs)]
    try:
        for node, group in groups:  # sink first: successors subscribed before predecessors exist
            if len(group) > 1 and _place_chain(call, node, group):
                for spec in reversed(group):
                    placed.append(Deployed(spec.operator, spec.instance, node))
                    views = _take_slot(views, node, spec.instance)
                log.info("keepers %s started on %s as one chain", ", ".join(s.instance for s in group), node)
                continue
            for spec in reversed(group):  # alone (or a chain the node refused: one by one)
                node = _place_one(call, spec, views, policy)
                placed.append(Deployed(spec.operator, spec.instance, node))
                views = _take_slot(views, node, spec.instance)
                log.info("keeper %s of %s started on %s", spec.instance, spec.operator, node)
    except DeployError as exc:
        failed = []
        for d in reversed(placed):  # sources first, as an undeploy
            reply = call(d.node, {"op": "stop", "instance": d.instance, "forget": True})
            if not reply.get("ok"):
                failed.append(f"{d.instance}@{d.node} ({reply.get('error')})")
        publish(topic, tombstone(name, gen))
        started = ", ".join(f"{d.instance}@{d.node}" for d in reversed(placed)) or "none"
        if failed:
            raise RollbackIncomplete(f"deploy of {name} failed ({exc}); rollback incomplete: could not stop "
                                     f"{', '.join(failed)}; {topic} holds a tombstone") from None
        raise DeployRolledBack(f"deploy of {name} failed and was rolled back: {exc}; stopped: {started}; "
                               f"{topic} holds a tombstone") from None
    return list(reversed(placed))


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
    signer: Optional[Signer] = None,
    node_slots: Optional[Mapping[str, int]] = None,
) -> List[Deployed]:
    """`fog-agent deploy`: `deploy_over` a connection of its own; returns where each keeper runs.

    `tls`: the [mqtt.tls] section (ca_file, cert_file, key_file, insecure) or None. The requests
    name the deployer's identity (agent.identity: user name, else the certificate's CN)."""
    tls_args: Dict[str, Any] = {}
    if tls is not None:
        tls_args = {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file,
                    "tls_insecure": bool(tls.insecure)}
    with RpcClient(host, port, cluster, username=username, password=password, **tls_args) as client:
        return deploy_over(client, text, name, timeout, policy_name, extra, signer=signer, node_slots=node_slots)[1]


def deploy_over(conn: Requester, text: str, name: str, timeout: float, policy_name: Optional[str] = None,
                extra: Optional[Dict[str, Any]] = None,
                signer: Optional[Signer] = None,
                node_slots: Optional[Mapping[str, int]] = None) -> Tuple[PipelineConfig, List[Deployed]]:
    """The one deploy path, over a connected Requester (`fog-agent deploy`'s RpcClient, fogctl's
    Connection): parse and check the TOML, one snapshot of the agents' retained states and
    statuses, then `run_deploy`. Returns (PipelineConfig, placed keepers); raises ConfigError
    (names the file and key), DeployError (status 1, 4 or 5) or RequestFailed."""
    cfg = load_pipeline_text(text, name)  # ConfigError says where the file is wrong
    unsupported = cfg.runtime_policy_errors()
    if unsupported:
        raise DeployRefused(f"{name}: " + "; ".join(unsupported))
    cluster = conn.cluster
    specs = keeper_specs(cfg, text, cluster, conn.broker, extra)
    msgs = conn.snapshot([topics.all_agents_state(cluster), topics.all_agents_status(cluster)], timeout=None)
    kinds = {t: topics.parse(cluster, t) for t in msgs}
    states = {t: m.payload for t, m in msgs.items() if kinds[t] is not None and kinds[t].kind == "state"}
    statuses = {t: m.payload for t, m in msgs.items() if kinds[t] is not None and kinds[t].kind == "status"}
    fleet = fleet_from_snapshot(states, statuses, node_slots)

    def call(node: str, body: Dict[str, Any]) -> Dict[str, Any]:
        try:
            return conn.rpc(node, body, timeout=timeout)
        except RequestFailed as exc:
            return {"ok": False, "error": str(exc)}

    placed = run_deploy(cfg, text, specs, fleet, get_policy(policy_name or DEFAULT_POLICY), call,
                        lambda topic, payload: conn.publish(topic, payload, qos=1, retain=True), cluster,
                        where=conn.address, signer=signer)
    return cfg, placed


def _place_chain(call: Call, node: str, group: Sequence[InstanceSpec]) -> bool:
    """Ask `node` to start consecutive keepers as one chain; whether it did (a refusal is logged
    and the keepers are then placed one by one)."""
    specs = [request_spec(dataclasses.replace(s, node=node)) for s in group]
    reply = call(node, {"op": "spawn", "spec": specs[-1], "chain": specs, "cause": "deploy"})
    if reply.get("ok"):
        return True
    log.warning("chain %s refused by %s (%s): placing its keepers one by one",
                ", ".join(s.instance for s in group), node, reply.get("error"))
    return False


def _place_one(call: Call, spec: InstanceSpec, fleet: Sequence[NodeView], policy: Any) -> str:
    ranking = policy(PlacementRequest(spec.operator, None, spec.succs + spec.preds), fleet)
    errors: List[str] = []
    for node in ranking:
        body = {"op": "spawn", "spec": request_spec(dataclasses.replace(spec, node=node)), "cause": "deploy"}
        reply = call(node, body)
        if reply.get("ok"):
            return str(reply.get("node", node))
        errors.append(f"{node}: {reply.get('error')}")
    raise DeployError(f"cannot start the keeper of {spec.operator!r}: " + ("; ".join(errors) or "no node has a free slot"))


def undeploy_order(placed: Sequence[Deployed]) -> List[Tuple[str, str]]:
    """(node, instance) pairs source first: stopping producers first lets successors drain."""
    return [(d.node, d.instance) for d in placed]


__all__ = ["DeployError", "DeployRefused", "DeployRolledBack", "Deployed", "RollbackIncomplete", "RpcClient", "RpcError",
           "deploy", "deploy_over", "fleet_from_snapshot", "keeper_id", "keeper_specs", "plan_placement", "run_deploy",
           "undeploy_order"]
