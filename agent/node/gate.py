"""Who may ask this node for what: the admission of specs and of requests from the bus.

Rules of this file: no I/O, no clock, no reference to the daemon. Every check takes what it reads
as arguments (the spec or request, the requester, the retained records as `PeerFacts`, the wall
time) and returns a refusal (a sentence naming the requester's problem) or, for a spec, raises
ValueError; the node's core (agent.node.core) carries out what the answer implies: the reply, the
start, the log of a request it refused. What is fixed when the agent starts (this node's
allow-list, directories, admin keys and node-local settings) is the gate's own state.

docs/security.md: control requests come only on `agents/<me>/rpc/<admin>`; a node's requests on
`agents/<me>/peer/<node>` are limited to PEER_OPS, each under its own check: a spawn only of a
pipeline an admin deployed (its text, its generation) and never a clone of an instance bound to
another online node; a keyed state only from the node hosting it; a drain only from the site
manager. A spec is admitted only if its operator's function is on this node's allow-list, its
paths are inside this node's directories, its epoch floor is not ahead of this node's clock, and
(admin keys configured) an admin signed its pipeline text.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import AbstractSet, Any, Dict, Iterable, Mapping, MutableMapping, Optional, Sequence, Union

from agent import signing, topics
from agent.config import load_pipeline_text
from agent.control import records
from agent.instance.spec import InstanceSpec
from agent.node import bounds, chains
from agent.node.hostmap import HostMap
from agent.node.site_manager import LeaseBoard
import agent.operators.admission as admission

log = logging.getLogger(__name__)

# What a node may ask another node on its peer topic: createNode()'s spawn (also the carrier
# of a keeper's hand-over and of a re-home, which are spawns of an existing identity), and the
# chunks of a keyed keeper's state sent just before its hand-over's spawn (agent.node.statexfer),
# and the saved keyed state its host copies to a standby (agent.node.replicas).
PEER_OPS = ("spawn", "state_chunk", "replica")
# spec.extra of a migrated keeper (the daemon's hand-over): the state it shipped.
HANDOVER_KEYS = ("handover_state", "handover_source", "handover_keyed")


def without_handover(spec: InstanceSpec) -> InstanceSpec:
    """`spec` without the state a hand-over shipped in its extra. Why: that state is a snapshot
    of one moment; once the new incarnation has written its own state file it is stale. It must
    not reach the hosted record (a re-home would restore it) nor a copy's spec (copies inherit
    their creator's extra)."""
    if not any(k in spec.extra for k in HANDOVER_KEYS):
        return spec
    return dataclasses.replace(spec, extra={k: v for k, v in spec.extra.items() if k not in HANDOVER_KEYS})


@dataclass(frozen=True)
class NodeLocal:
    """The spec fields that are always this agent's, from its configuration."""

    node: str
    cluster: str
    broker: Any  # agent.mqtt.settings.BrokerSpec
    state_dir: str
    heartbeat_period: float
    fence_reconnect: bool  # re-homing on: a worker that lost its connection waits for our word
    inbox_per_node: bool
    replicate: bool


@dataclass(frozen=True)
class PeerFacts:
    """What the retained records say, as the peer checks read them (the daemon's fleet view)."""

    online: Mapping[str, bool]
    hosted_by_node: Mapping[str, Sequence[Mapping[str, Any]]]
    records: Mapping[str, records.PipelineRecord]
    deployed: AbstractSet[str]
    deployed_text: Mapping[str, str]
    hostmap: HostMap
    leases: LeaseBoard


class Gate:
    """The checks of one agent; `counters` is the agent's counter table (refusals are counted)."""

    def __init__(self, local: NodeLocal, allowed: admission.AllowList, node_dirs: admission.NodeDirs,
                 trust: signing.SpecTrust, counters: MutableMapping[str, int], boot: str) -> None:
        self.local = local
        self.node = local.node
        self.allowed = allowed
        self.node_dirs = node_dirs
        self.trust = trust
        self.counters = counters
        self.boot = boot
        self._ids = 0

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def new_instance_id(self, operator: str) -> str:
        self._ids += 1
        return f"{operator}-{self.node}-{self.boot}-{self._ids}"

    # -- specs -----------------------------------------------------------------------------------

    def spec_from(self, now: float, data: Dict[str, Any], template: Optional[InstanceSpec],
                  requester: Optional[str] = None) -> InstanceSpec:
        """A full spec for an instance to start here: the request's fields over the template's.

        The node-local fields (node, broker, state_dir, heartbeat period, spool) are always this
        agent's: a request from another node must not make us connect elsewhere or write to its
        paths. The spec must pass `admit` (its function on this node's allow-list, its paths
        inside this node's directories), else ValueError, logged with `requester` (default: the
        template's worker, who asked), and nothing is started or saved. `now`: the wall clock.
        """
        try:
            admission.check_spec_types(data)  # a wrong type is a refusal, not an exception further down
        except ValueError as exc:
            self._count("refused_specs")
            log.warning("refused spec from %s: %s", requester or "unknown requester", exc, extra={"node": self.node})
            raise
        base: Dict[str, Any] = dataclasses.asdict(without_handover(template)) if template is not None else {}
        base.pop("instance", None)  # a sibling never inherits its requester's identity
        base.update({k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(InstanceSpec)}})
        if template is not None and "keeper" not in data:
            base["keeper"] = False
        if template is not None and "restart" not in data:
            base["restart"] = False
        if not base.get("instance"):
            if not base.get("operator"):
                raise ValueError("spec without an operator")
            base["instance"] = self.new_instance_id(base["operator"])
        topics._check(str(base["instance"]))
        base.update(self.node_local(base.get("extra") or {}))
        base["succs"] = tuple(base.get("succs", ()))
        base["preds"] = tuple(base.get("preds", ()))
        missing = [k for k in ("operator", "pipeline", "pipeline_toml") if not base.get(k)]
        if missing:
            raise ValueError(f"spec without {', '.join(missing)}")
        spec = chains.without_chain(InstanceSpec(**base))  # chained only by a chain request
        if requester is None:
            requester = f"worker {template.instance}" if template is not None else "unknown requester"
        self.admit(now, spec, requester)
        return spec

    def admit(self, now: float, spec: InstanceSpec, requester: str) -> None:
        """Refuse (ValueError, counted, one log line naming the requester) a spec whose operator
        function is not on this node's allow-list, that names a path outside this node's
        directories, or whose epoch floor is ahead of `now` (agent.operators.admission; a spec
        from this node's state dir, `admission.FROM_STATE_DIR`, is not held to the clock).
        Reads the names only: never imports the function."""
        try:
            if not isinstance(spec.pipeline_toml, str) or not isinstance(spec.operator, str):
                raise ValueError("pipeline_toml and operator must be strings")
            if not isinstance(spec.extra, dict):
                raise ValueError("extra must be an object")
            unsigned = self.trust.check(str(spec.pipeline), records.spec_generation(spec), spec.pipeline_toml,
                                        spec.extra.get(signing.SIGNATURE_KEY))
            if unsigned:  # before the text is parsed: an unsigned text is not ours to read
                self._count("refused_signatures")
                raise ValueError(f"not signed by an admin: {unsigned}")
            try:
                pipeline = load_pipeline_text(spec.pipeline_toml, f"pipeline {spec.pipeline}")
                op = pipeline.operator(spec.operator)
            except KeyError:
                raise ValueError(f"operator {spec.operator!r} is not in pipeline {spec.pipeline!r}") from None
            except RecursionError:
                raise ValueError("pipeline text nested too deeply") from None
            self.allowed.check(op.function)
            admission.check_mqtt_topics(op.function, op.params, pipeline.pipeline.mqtt_topics,
                                        required=self.trust.required)
            admission.check_spec_paths(self.node_dirs, spec.extra, op.function, op.params)
            admission.check_epochs(spec.extra, now, stored=requester == admission.FROM_STATE_DIR)
        except ValueError as exc:
            self._count("refused_specs")
            log.warning("refused spec of instance %s from %s: %s", spec.instance, requester, exc,
                        extra={"node": self.node})
            raise

    def node_local(self, extra: Dict[str, Any]) -> Dict[str, Any]:
        """The spec fields that are always this agent's, whatever the spec came with (a request
        from another node, a stored spec): where to connect, where to write, how often to beat,
        and, re-homing on, that a worker which lost its connection waits for our word before it
        reconnects (the daemon's fencing). The spool settings are the node's own too: dropped
        here, set again by `AgentSpill.with_spill` when this node spills. The fault-injection hook
        `crash_at` is dropped unless this node enables fault injection (admission.ENV_FAULT_INJECTION):
        from a request it would let anyone crash a worker at will."""
        own = {k: v for k, v in extra.items() if k != "spill"}  # the spool: AgentSpill.with_spill, or none
        if "crash_at" in own and not admission.fault_injection_enabled():
            dropped = own.pop("crash_at")
            log.warning("dropped extra.crash_at %.100r: fault injection is off on this node (%s)",
                        dropped, admission.ENV_FAULT_INJECTION, extra={"node": self.node})
        c = self.local
        return {"node": c.node, "cluster": c.cluster, "broker": c.broker,
                "state_dir": c.state_dir, "heartbeat_period": c.heartbeat_period,
                "extra": dict(own, fence_reconnect=c.fence_reconnect, check_sender_node=True,
                              inbox_per_node=c.inbox_per_node, replicate=c.replicate)}

    # -- a worker's copy (createNode() from its own process) --------------------------------------

    def max_instances_refusal(self, spec: InstanceSpec, local: Iterable[bounds.Known],
                              placing: Iterable[bounds.Known], fleet: Mapping[str, Mapping[str, Any]],
                              online: Mapping[str, bool]) -> Optional[str]:
        """Why a worker's copy would take its operator past [scaling] max_instances (None: it
        would not). Every instance this agent knows of counts, whatever its phase (`local`: its
        workers; `fleet`: the other online nodes' states), plus the copies it is placing elsewhere
        (`placing`) (agent.node.bounds: hard on one agent, as fresh as the retained states
        across agents)."""
        limit = load_pipeline_text(spec.pipeline_toml, f"pipeline {spec.pipeline}").scaling_for(spec.operator).max_instances
        existing = bounds.operator_instances(spec.pipeline, spec.operator, self.node, local, fleet, online, placing)
        return bounds.refusal(spec.operator, spec.instance, limit, existing)

    def worker_copy(self, now: float, template: Optional[InstanceSpec], msg: Mapping[str, Any],
                    record: Optional[records.PipelineRecord], undeploying: bool, local: Iterable[bounds.Known],
                    placing: Iterable[bounds.Known], fleet: Mapping[str, Mapping[str, Any]],
                    online: Mapping[str, bool]) -> Union[InstanceSpec, str]:
        """The spec of the copy a worker (`template`: its spec, None if no such worker) asks for
        on its "spawn" line, or the refusal its creator gets: no spec object, its pipeline's
        record rules it out (`record`), it is being undeployed, an invalid spec, or past
        max_instances (the creator cancels that copy, docs/scaling.md deviation 8)."""
        if template is None or not isinstance(msg.get("spec"), dict):
            return "spawn without a spec object"
        stale = records.stale_reason(records.spec_generation(template), record)
        if stale or undeploying:
            return f"refused: {stale or 'it is being undeployed'}"
        try:
            spec = self.spec_from(now, msg["spec"], template=template)
        except (TypeError, ValueError) as exc:
            return f"invalid spec: {exc}"
        why = self.max_instances_refusal(spec, local, placing, fleet, online)
        if why:
            self._count("spawn_refused_max")
            log.info("refused copy %s of %s: %s", spec.instance, template.instance, why,
                     extra={"node": self.node, "operator": spec.operator})
            return why
        return spec

    # -- requests on the peer topic ---------------------------------------------------------------

    def peer_refusal(self, now: float, op: str, requester: str, body: Mapping[str, Any],
                     facts: PeerFacts) -> Optional[str]:
        """Why request `op` from node `requester` on our peer topic is refused (None: accepted).
        `now`: the wall clock (the site manager's lease)."""
        if op in ("drain", "undrain"):
            return self.peer_may_steer(now, requester, facts)
        if op in ("state_chunk", "replica"):
            return self.peer_may_ship(requester, body["instance"], facts)
        if op not in PEER_OPS:
            return f"op {op!r} is not allowed on the peer topic (only {', '.join(PEER_OPS)})"
        return self.peer_may_spawn(requester, body, facts)

    def peer_may_spawn(self, requester: str, body: Mapping[str, Any], facts: PeerFacts) -> Optional[str]:
        """Why a spawn from node `requester` on our peer topic is refused, or None to accept it.

        docs/security.md: only for a pipeline an admin deployed (its retained pipelines/<name>
        record, the generation the spec names if any), and a spec that carries a text carries
        that record's text; the spawn then runs the record's text, never the requester's (the
        daemon's spawn). What the requester hosts proves nothing: it writes its own hosted record
        (a node listing a pipeline of its own making in it once had another node run an
        mqtt_source on that node's rpc topic for it)."""
        spec = body.get("spec")
        pipeline = spec.get("pipeline") if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or not isinstance(pipeline, str) or not pipeline:
            return "spawn without a pipeline"
        stale = records.stale_reason(records.spec_generation(spec), facts.records.get(pipeline))
        if stale:
            return f"pipeline {pipeline[:80]!r}: {stale}"
        text = facts.deployed_text.get(pipeline) if pipeline in facts.deployed else None
        if text is None:
            return f"pipeline {pipeline[:80]!r} is not deployed (no admin's record of it)"
        if spec.get("pipeline_toml") not in (None, text):
            return f"the text of pipeline {pipeline[:80]!r} is not the one an admin deployed"
        return self.clone_problem(requester, spec.get("instance"), facts)

    def clone_problem(self, requester: str, instance: Any, facts: PeerFacts) -> Optional[str]:
        """A peer spawn of an instance that runs on another online node, asked by a node other
        than that one: a clone (one identity on two nodes), refused. Only the node an instance is
        bound to moves it while it is online (a hand-over); a re-home starts it elsewhere once its
        node is offline; a scale-out's copy has a new identity. The binding is the proven one of
        the host map, and its node must still list the instance (a binding nobody lists any more
        is a leftover)."""
        if not isinstance(instance, str):
            return None
        node = facts.hostmap.bound(instance)
        if (node is None or node in (requester, self.node) or not facts.online.get(node)
                or not facts.hostmap.proven(instance)
                or not any(s.get("instance") == instance for s in facts.hosted_by_node.get(node, []))):
            return None
        return f"instance {instance[:80]!r} runs on {node} (online): only {node} may move it"

    @staticmethod
    def peer_may_ship(requester: str, instance: str, facts: PeerFacts) -> Optional[str]:
        """A node may send us the keyed state of an instance only if it hosts it (its retained
        hosted record lists it): the draining agent does until the new incarnation is ready."""
        if any(s.get("instance") == instance for s in facts.hosted_by_node.get(requester, [])):
            return None
        return f"{requester} does not host {instance[:80]!r}"

    @staticmethod
    def peer_may_steer(now: float, requester: str, facts: PeerFacts) -> Optional[str]:
        """A node may drain/undrain this one only while it is the site manager this agent derives
        from the claims (`site_manager.leader`: its own claim, running, its holder online)."""
        lease = facts.leases.current(facts.online, now)
        if lease is None or lease.node != requester:
            contested = sorted(facts.leases.valid(facts.online, now)) if lease is None else []
            why = f" (claims of {', '.join(contested[:4])}: none leads until one remains)" if len(contested) > 1 else ""
            return f"{requester} is not the site manager{why}"
        return None


__all__ = ["Gate", "HANDOVER_KEYS", "NodeLocal", "PEER_OPS", "PeerFacts", "without_handover"]
