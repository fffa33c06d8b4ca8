"""Steering requests from fogctl to an agent's rpc topic, and the agent's reply (JSON, MQTT 5).

Transport: fogctl publishes the request (QoS 1, not retained) on
`topics.agent_rpc(cluster, node, identity)` with MQTT 5 CorrelationData; the agent publishes
exactly one reply object on `topics.replies(cluster, identity, node)` (computed from the request's
topic, docs/security.md) with the same CorrelationData. `fog-agent deploy`'s spawns use the same
topic; another agent's spawns come on `topics.agent_peer`. Requests are told apart by `op`.

Requests (`{"v": 1, "op": ..., ...}`):
  scale     {"op": "scale", "pipeline": "taxi"|null, "operator": "in_zone", "delta": 2}
            delta > 0: sent to the agent hosting the operator's keeper (else any instance of it);
            that agent's instance duplicates through the scaling protocol (one duplication per
            copy, same messages as an automatic scale-out; placement picks the nodes).
  scale-in  {"op": "scale", "pipeline": ..., "operator": "in_zone", "delta": -1,
             "instances": ["in_zone-3"]}
            delta < 0: one request per node hosting the chosen instances (non-keepers, least
            loaded first), naming them; they leave through the protocol's scale-in (drain before
            exit). An agent acts only on its own instances.
  drain     {"op": "drain", "node": "n2"}  sent to n2 itself. Every non-keeper on n2 leaves through
            scale-in; a keeper (it never terminates) migrates with its identity: it stops (drains,
            keeps its session), and its agent starts it on another node with its persisted state
            (`restart = true`, epoch + 1, its predecessors replay). The agent stops accepting new
            instances until `undrain`.
  undrain   {"op": "undrain", "node": "n2"}
  pin       {"op": "pin", "pipeline": "taxi"|null, "operator": "in_zone", "seconds": 600|null,
             "release": false}
            sent by `fogctl scale` to every online agent after the scale requests: while pinned,
            the operator's instances on that agent (also the ones started later) make no
            automatic decision; steering still works. Until "release": true or `seconds` have
            passed (the agent's clock). Kept in the agent's state dir; listed in its state
            ("pins", and "pinned": true per instance), which `fogctl why` reads.
Reply: {"v": 1, "ok": true, "result": {...}} or {"v": 1, "ok": false, "error": "one line"}.
  scale result: {"instances": [new or leaving instance ids]}; drain result: {"leaving": [...]};
  pin result: {"pinned": bool, "until": wall time or null, "instances": [local ones it applies to]}.

An agent MUST refuse (ok=false, error says which invariant) a request that would break one:
scaling below one instance or terminating a keeper, more copies than free slots, draining the
last node that can host a keeper. fogctl checks the same rules before sending (`check_scale`,
`check_drain`) so that a person gets the refusal without a round trip; the agent's check is the
one that counts, because the fleet may change in between. `agent_actions()` is that check on the
agent side: it turns a request into actions on the agent's own instances (duplicate N times,
terminate, hand the keeper role over) or a RequestError to reply with.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from agent.control.fleet import Fleet, Instance, Phase

__all__ = [
    "SCHEMA_VERSION", "ScaleRequest", "DrainRequest", "PinRequest", "Reply", "parse_request", "check_scale",
    "check_drain", "RequestError", "ActionKind", "Action", "agent_actions",
]

SCHEMA_VERSION = 1


class RequestError(ValueError):
    """A malformed request (the agent replies ok=false with this message)."""


@dataclass(frozen=True)
class ScaleRequest:
    operator: str
    delta: int
    pipeline: Optional[str] = None
    instances: Tuple[str, ...] = ()  # scale-in: which instances leave

    def __post_init__(self) -> None:
        # Types first: the request comes from the bus, and the checks below compare and negate delta.
        if not isinstance(self.operator, str) or not self.operator:
            raise RequestError(f"operator: expected a non-empty string, found {str(self.operator)[:80]!r}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, int) or self.delta == 0:
            raise RequestError(f"delta: expected a non-zero integer, found {str(self.delta)[:80]!r}")
        if self.pipeline is not None and not isinstance(self.pipeline, str):
            raise RequestError(f"pipeline: expected a string or null, found {type(self.pipeline).__name__}")
        if self.instances and len(self.instances) != -self.delta:
            raise RequestError(f"instances: expected {-self.delta} ids for delta {self.delta}, found {len(self.instances)}")

    def to_dict(self) -> Dict[str, Any]:
        d = {"v": SCHEMA_VERSION, "op": "scale", "operator": self.operator, "delta": self.delta,
             "pipeline": self.pipeline}
        if self.instances:
            d["instances"] = list(self.instances)
        return d


@dataclass(frozen=True)
class DrainRequest:
    node: str
    undo: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.node, str) or not self.node:
            raise RequestError(f"node: expected a non-empty string, found {self.node!r}")

    def to_dict(self) -> Dict[str, Any]:
        return {"v": SCHEMA_VERSION, "op": "undrain" if self.undo else "drain", "node": self.node}


MAX_PIN_SECONDS = 366 * 86400.0  # a year: a longer pin is a typo (use no timeout instead)


@dataclass(frozen=True)
class PinRequest:
    operator: str
    pipeline: Optional[str] = None
    seconds: Optional[float] = None  # None: until released
    release: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.operator, str) or not self.operator or len(self.operator) > 200:
            raise RequestError(f"operator: expected a non-empty string, found {str(self.operator)[:80]!r}")
        if self.pipeline is not None and (not isinstance(self.pipeline, str) or len(self.pipeline) > 200):
            raise RequestError(f"pipeline: expected a string or null, found {str(self.pipeline)[:80]!r}")
        if self.seconds is not None and (isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float))
                                         or not 0 < self.seconds <= MAX_PIN_SECONDS):
            raise RequestError(f"seconds: expected a number in (0, {MAX_PIN_SECONDS:g}] or null, "
                               f"found {str(self.seconds)[:80]!r}")
        if not isinstance(self.release, bool):
            raise RequestError("release: expected true or false")

    def to_dict(self) -> Dict[str, Any]:
        return {"v": SCHEMA_VERSION, "op": "pin", "operator": self.operator, "pipeline": self.pipeline,
                "seconds": self.seconds, "release": self.release}


def parse_duration(text: str) -> float:
    """`--for 10m`: seconds from "90", "90s", "10m", "2h", "1d" (RequestError otherwise)."""
    t = str(text).strip().lower()
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(t[-1:], None)
    number = t[:-1] if unit else t
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_PIN_SECONDS or value != value:
        raise RequestError(f"--for {text!r}: expected a positive duration like 90s, 10m, 2h (at most a year)")
    return value


@dataclass(frozen=True)
class Reply:
    ok: bool
    result: Dict[str, Any]
    error: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"v": SCHEMA_VERSION, "ok": self.ok}
        if self.ok:
            out["result"] = self.result
        else:
            out["error"] = self.error or "refused"
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Reply":
        ok = d.get("ok") is True
        # The daemon's own ops (spawn/stop/ping) reply flat: {"ok": true, "instance": ..., "node": ...}
        result = d.get("result") if isinstance(d.get("result"), dict) else \
            {k: v for k, v in d.items() if k not in ("v", "ok", "error")}
        err = d.get("error")
        return cls(ok, dict(result), None if ok else (str(err) if err else "refused without a reason"))


def parse_request(d: Any) -> Any:
    """Agent side: decode a request dict into ScaleRequest / DrainRequest; RequestError if bad."""
    if not isinstance(d, Mapping):
        raise RequestError(f"request: expected a JSON object, found {type(d).__name__}")
    op = d.get("op")
    if op == "scale":
        ids = d.get("instances") or []
        if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
            raise RequestError(f"instances: expected an array of instance ids, found {ids!r}")
        return ScaleRequest(operator=d.get("operator"), delta=d.get("delta"), pipeline=d.get("pipeline"),  # type: ignore[arg-type]
                            instances=tuple(ids))
    if op in ("drain", "undrain"):
        return DrainRequest(node=d.get("node"), undo=op == "undrain")  # type: ignore[arg-type]
    if op == "pin":
        return PinRequest(operator=d.get("operator"), pipeline=d.get("pipeline"),  # type: ignore[arg-type]
                          seconds=d.get("seconds"), release=d.get("release", False))  # type: ignore[arg-type]
    raise RequestError(f"op: expected scale, drain, undrain or pin, found {op!r}")


# ---- the invariants, checked from a fleet snapshot (pure) --------------------------------------


def check_scale(fleet: Fleet, req: ScaleRequest) -> List[Tuple[str, ScaleRequest]]:
    """The (node, request) pairs to send, or raise RequestError saying which rule it breaks."""
    insts = [i for i in fleet.instances if i.operator == req.operator
             and (req.pipeline is None or i.pipeline in (None, req.pipeline))]
    online = {n.node for n in fleet.nodes if n.status == "online"}
    if not insts:
        known = sorted({i.operator for i in fleet.instances})
        raise RequestError(f"no instance of operator {req.operator!r} in cluster {fleet.cluster!r}"
                           f" (operators: {', '.join(known) or 'none'})")
    pipelines = sorted({i.pipeline for i in insts if i.pipeline})
    if req.pipeline is None and len(pipelines) > 1:
        raise RequestError(f"operator {req.operator!r} exists in pipelines {', '.join(pipelines)}: add --pipeline")
    live = [i for i in insts if i.phase is not Phase.TERMINATING and i.node in online]
    if not live:
        raise RequestError(f"no instance of {req.operator!r} is on an online node")
    if req.delta > 0:
        free = sum(n.free_slots or 0 for n in fleet.nodes if n.status == "online")
        if req.delta > free:
            raise RequestError(f"refused: {req.operator} +{req.delta} needs {req.delta} free slots, "
                               f"the online nodes have {free}")
        limit = _max_instances(fleet, req.pipeline or (pipelines[0] if pipelines else None), req.operator)
        # Counted as the agents count (agent.node.bounds): every phase, online nodes. Said
        # here, because the agent would only refuse the copies and the round would shrink.
        have = sum(1 for i in insts if i.node in online)
        if limit is not None and have + req.delta > limit:
            raise RequestError(f"refused: {req.operator} +{req.delta} would make {have + req.delta} instances, "
                               f"its max_instances is {limit} (docs/scaling.md)")
    else:
        removable = [i for i in live if not i.keeper and i.phase is Phase.ACTIVE]
        if -req.delta > len(removable):
            raise RequestError(
                f"refused: {req.operator} {req.delta} would break an invariant: it has {len(live)} "
                f"instance(s), the keeper never terminates, so at most {len(removable)} can leave")
        leaving = sorted(removable, key=lambda i: (i.load if i.load is not None else 0.0, i.id))[: -req.delta]
        per_node: Dict[str, List[str]] = {}
        for i in leaving:
            per_node.setdefault(i.node, []).append(i.id)
        return [(node, ScaleRequest(req.operator, -len(ids), req.pipeline, tuple(ids)))
                for node, ids in sorted(per_node.items())]
    keepers = [i for i in live if i.keeper]
    target = (keepers or sorted(live, key=lambda i: i.id))[0].node
    return [(target, req)]


def _max_instances(fleet: Fleet, pipeline: Optional[str], operator: str) -> Optional[int]:
    """The operator's [scaling] max_instances from the retained pipeline TOML (None: unknown;
    a malformed retained pipeline must not break `scale`)."""
    text = fleet.pipelines.get(pipeline or "")
    if not text:
        return None
    try:
        from agent.config import load_pipeline_text

        return load_pipeline_text(text, f"pipeline {pipeline}").scaling_for(operator).max_instances
    except Exception:  # any error in a retained text: no bound known here, the agents still bound
        return None


def check_drain(fleet: Fleet, req: DrainRequest) -> List[str]:
    """The instance ids that will leave node `req.node`, or raise RequestError."""
    node = fleet.node(req.node)
    if node is None:
        raise RequestError(f"unknown node {req.node!r} in cluster {fleet.cluster!r} "
                           f"(nodes: {', '.join(n.node for n in fleet.nodes) or 'none'})")
    if node.status != "online":
        raise RequestError(f"node {req.node} is {node.status}: a drain needs the agent online")
    if req.undo:
        return []
    others = [n for n in fleet.nodes if n.node != req.node and n.status == "online"]
    free = sum(n.free_slots or 0 for n in others)
    keepers = [i.id for i in node.instances if i.keeper]
    if keepers and free == 0:
        raise RequestError(f"refused: draining {req.node} would break an invariant: keeper(s) "
                           f"{', '.join(keepers)} must move to another node and no other online "
                           f"node has a free slot")
    return [i.id for i in node.instances]


# ---- agent side: what a request asks this agent's instances to do (pure) ----------------------


class ActionKind(Enum):
    DUPLICATE = "duplicate"  # the instance runs `count` duplications through the protocol
    TERMINATE = "terminate"  # the instance leaves through scale-in (drain before exit)
    HANDOVER = "handover"    # a keeper stops and restarts on another node with the same identity


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    instance: str
    count: int = 1


def agent_actions(req: Any, node: str, local: Sequence[Instance], slots: Optional[int] = None) -> List[Action]:
    """The daemon's half of a steering request: actions on its own instances, or RequestError.

    `local` are the instances this agent hosts (fleet.Instance, e.g. from its own state doc);
    `slots`, all the slots of the online fleet as this agent sees it: a forced scale-out asking
    for more copies than exist is refused (docs/security.md: each copy is one scaling round, and
    such a request would run rounds until it filled every slot). Why all slots, not the free
    ones: free slots change between this check and the rounds, and a copy that finds no slot
    cancels its round (the protocol's own answer); what must not exist is a request for rounds
    no fleet could ever hold.
    """
    if isinstance(req, DrainRequest):
        if req.node != node:
            raise RequestError(f"drain {req.node} was sent to {node}")
        if req.undo:
            return []
        return [Action(ActionKind.HANDOVER if i.keeper else ActionKind.TERMINATE, i.id)
                for i in sorted(local, key=lambda i: (i.keeper, i.id)) if i.phase is not Phase.TERMINATING]
    if not isinstance(req, ScaleRequest):
        raise RequestError(f"unsupported request {req!r}")
    mine = [i for i in local if i.operator == req.operator and (req.pipeline is None or i.pipeline in (None, req.pipeline))]
    if req.delta > 0:
        if slots is not None and req.delta > slots:
            raise RequestError(f"refused: {req.operator} +{req.delta} asks for more copies than the "
                               f"{max(0, slots)} slots of the online nodes")
        live = sorted((i for i in mine if i.phase is Phase.ACTIVE), key=lambda i: (not i.keeper, i.id))
        if not live:
            raise RequestError(f"no active instance of {req.operator!r} on {node}")
        return [Action(ActionKind.DUPLICATE, live[0].id, req.delta)]
    by_id = {i.id: i for i in mine}
    actions = []
    for iid in req.instances:
        inst = by_id.get(iid)
        if inst is None:
            raise RequestError(f"no instance {iid!r} of {req.operator!r} on {node}")
        if inst.keeper:
            raise RequestError(f"refused: {iid} is the keeper of {req.operator}; a keeper never terminates")
        if inst.phase is not Phase.ACTIVE:
            raise RequestError(f"refused: {iid} is {inst.phase.value}, not active")
        actions.append(Action(ActionKind.TERMINATE, iid))
    if not actions:
        raise RequestError(f"scale {req.delta:+d} names no instances")
    return actions
