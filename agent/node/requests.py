"""The requests on the agent's rpc topic (`agents/<me>/rpc/<admin>`: fogctl, `fog-agent deploy`)
and its peer topic (`agents/<me>/peer/<node>`: the protocol's spawns, standby copies, a
hand-over's state), one handler per op (`Requests.OPS`), and the pins they set.

Why a part of its own: a request is answered from the parts it names (the supervisor's workers,
the gate, the drain, the pins, the standby store, the staging of a hand-over's state) and what it
has the rest of the node do goes through `NodeCalls`, so the node's core (agent.node.core) only
hands a message here. The reply goes to `replies/<requester>/<me>`, computed from the topic; a
Response Topic in the request is ignored (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import deque
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional

from agent import topics
from agent.config import load_pipeline_text
from agent.control.fleet import Instance
from agent.control.rpc_schema import ActionKind, DrainRequest, Reply, RequestError, agent_actions, parse_request
from agent.files import write_atomic
from agent.instance.spec import InstanceSpec
from agent.measure.capacity import capacity_for
from agent.node import chains, hosted, rpc, spawns, statexfer
from agent.node.drain import Drain
from agent.node.fleetview import FleetView
from agent.node.gate import Gate, PeerFacts
from agent.node.hostmap import HostMap
from agent.node.pins import Pins
from agent.node.replicas import ReplicaStore
from agent.node.site_manager import LeaseBoard
from agent.node.workers import WorkerStatus, WorkerTable

log = logging.getLogger(__name__)

# What only a node asks of another on its peer topic (its standby copies, a hand-over's state).
PEER_ONLY_OPS = frozenset({"replica", "state_chunk"})
# Peer requests held until the retained records are in (`hold`): beyond this many, one is
# checked at once, as before (bounded memory; a refused requester places elsewhere or retries).
HELD_PEER_MAX = 256
PINS_FILE = "pins.json"

Respond = Callable[[Dict[str, Any]], None]  # sends the reply to one request


@dataclasses.dataclass(frozen=True)
class NodeCalls:
    """What a request may have the rest of the node do."""

    spawn: Callable[[spawns.SpawnEvent, float], None]  # to createNode()'s core (agent.node.spawns)
    undeploy: Callable[[str], None]  # forgotten for good: never restarted, never re-adopted
    event: Callable[..., None]  # an event of one instance (etype, instance, operator, pipeline, **detail)
    changed: Callable[[], None]  # our state changed: publish it soon
    free_slots: Callable[[], int]
    fleet_slots: Callable[[], int]  # all slots of the online fleet: the bound of a forced scale-out
    stopping: Callable[[], bool]
    publish: Callable[..., Any]  # (topic, payload, correlation=...)
    bad: Callable[[str, Optional[str], Any], None]  # a refused input: counted and logged


class Requests:
    def __init__(self, node: str, cluster: str, state_dir: str, wall: Callable[[], float], supervisor: WorkerTable,
                 gate: Gate, view: FleetView, hostmap: HostMap, leases: LeaseBoard, pins: Pins, drain: Drain,
                 store: ReplicaStore, staging: statexfer.Staging, spill: Any, counters: Dict[str, int],
                 local_instances: Callable[[], List[Instance]], calls: NodeCalls) -> None:
        self.node, self.cluster, self.state_dir, self.wall = node, cluster, state_dir, wall
        self.supervisor, self.gate, self.view, self.pins, self.drain = supervisor, gate, view, pins, drain
        self.hostmap, self.leases = hostmap, leases  # what the peer checks read besides the fleet view
        self.store, self.staging, self.spill, self.counters = store, staging, spill, counters
        self.local_instances = local_instances
        self.calls = calls
        self.seen = rpc.SeenRequests()  # admin requests handled: a redelivery is not applied again
        # Peer requests that arrived before the retained records: a persistent session hands over
        # what was queued for us at connect, before the retained records our checks read (the
        # lease, the hosted records), so they wait for the marker and are then checked in
        # arrival order (`held`).
        self.held: Deque[Any] = deque()

    def peer_facts(self) -> PeerFacts:
        """What the peer checks read of our fleet view (agent.node.gate)."""
        v = self.view
        return PeerFacts(v.online, v.hosted_by_node, v.records, v.deployed, v.deployed_text, self.hostmap, self.leases)

    def hold(self, msg: Any) -> bool:
        """Keep a peer request until the retained records are in; False when the queue is full."""
        if len(self.held) >= HELD_PEER_MAX:
            return False
        self.held.append(msg)
        return True

    def on_request(self, msg: Any, requester: str, peer: bool, now: float) -> None:
        """A request on `agents/<me>/rpc/<admin>` (control) or `agents/<me>/peer/<node>` (the
        protocol's spawns), handed to the handler of its op (`OPS`)."""
        self.counters["rpc_requests"] += 1
        correlation = rpc.correlation_of(msg)
        reply_to = topics.replies(self.cluster, requester, self.node)
        where = "peer" if peer else "rpc"
        if not peer and not self.seen.first(requester, correlation, bytes(msg.payload), now):
            # The same request again (a QoS 1 redelivery, e.g. over a site's bridge after its
            # uplink broke): it was handled once and its reply sent; never apply it twice.
            self.counters["rpc_repeats"] += 1
            log.info("ignoring a repeated request from %s (same correlation data)", requester,
                     extra={"node": self.node})
            return

        def reply(result: Dict[str, Any]) -> None:
            self.calls.publish(reply_to, rpc.encode(result), correlation=correlation or b"")

        try:
            body = rpc.decode_request(msg.payload)
        except ValueError as exc:
            self.calls.bad(f"{where} request", requester, exc)
            reply({"ok": False, "error": str(exc)})
            return
        op = body["op"]
        if peer:
            why = self.gate.peer_refusal(self.wall(), op, requester, body, self.peer_facts())
            if why is not None:
                self.counters["peer_refused"] += 1
                log.warning("refused %s request from node %s: %s", op, requester, why, extra={"node": self.node})
                reply({"ok": False, "error": f"refused: {why}"})
                return
        elif op in PEER_ONLY_OPS:
            reply({"ok": False, "error": f"refused: {op} is a peer request"})
            return
        self.OPS[op](self, body, requester, peer, reply, now)

    # -- the ops ---------------------------------------------------------------------------------

    def _replica(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        answer = self.store.apply(requester, body)
        if answer is not None:
            if not answer.get("ok"):
                log.info("replica of %s from %s: %s", str(body.get("instance"))[:80], requester,
                         answer.get("error"), extra={"node": self.node})
            reply(answer)

    def _state_chunk(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        try:  # never answered: the spawn that follows is (statexfer)
            self.staging.add(requester, body, now)
        except ValueError as exc:
            self.calls.bad("state_chunk", requester, exc)

    def _ping(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        reply({"ok": True, "node": self.node, "instances": sorted(self.supervisor.workers)})

    def _stop(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        # `forget`: an undeploy (docs/fogctl.md): the stored spec goes before the reply, so
        # that no restart of this agent brings the instance back, whatever the broker keeps.
        inst, forget = body["instance"], body.get("forget") is True
        stored = forget and any(s.instance == inst for s in hosted.hosted(self.state_dir))
        if forget and (inst in self.supervisor or stored):
            self.calls.undeploy(inst)
        if inst in self.supervisor:
            self.supervisor.stop(inst, now)
            reply({"ok": True, "instance": inst, "node": self.node})
        elif stored:
            reply({"ok": True, "instance": inst, "node": self.node, "forgotten": True})
        else:
            reply({"ok": False, "error": f"no instance {inst[:80]!r} on {self.node}"})

    def _pin(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        try:
            req = parse_request(body)
        except RequestError as exc:
            reply(Reply(False, {}, str(exc)).to_dict())
            return
        if req.release:  # every pin of the operator (of that pipeline, when it names one)
            key = self.pins.release(req.pipeline, req.operator)
        else:
            key = self.pins.pin(self.wall(), req.pipeline, req.operator, req.seconds)
        save_pins(Path(self.state_dir), self.pins.pins)
        pinned = self.apply_pins()
        log.info("%s %s: local instances %s", "released" if req.release else "pinned", key, pinned,
                 extra={"node": self.node})
        reply(Reply(True, {"pinned": not req.release, "until": self.pins.until(key),
                           "instances": pinned, "node": self.node}).to_dict())

    def _set(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        inst = body["instance"]
        if self.supervisor.send(inst, "set", **body["fields"]):
            reply({"ok": True, "instance": inst, "node": self.node})
        else:
            reply({"ok": False, "error": f"no running instance {inst[:80]!r} on {self.node}"})

    def _steer(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        reply(self.steer(body, now))

    def _spawn(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        if self.calls.stopping():
            reply({"ok": False, "error": f"agent {self.node} is shutting down"})
            return
        if "chain" in body:
            self._chain(body, requester, peer, reply, now)
            return
        data = body["spec"]
        if peer:  # the admin's text of the pipeline (Gate.peer_may_spawn), never the requester's
            data = dict(data, pipeline_toml=self.view.deployed_text[str(data.get("pipeline"))])
        try:
            spec = self.gate.spec_from(self.wall(), data, template=None,
                                       requester=f"{'node' if peer else 'admin'} {requester}")
        except (TypeError, ValueError) as exc:
            reply({"ok": False, "error": f"invalid spec: {exc}"})
            return
        w = self.supervisor.get(spec.instance)
        self.calls.spawn(spawns.SpawnRequest(spec, reply, str(body.get("cause", "rpc"))[:40], requester,
                                             w.status.value if w is not None else None), now)

    OPS: Dict[str, Callable[["Requests", Dict[str, Any], str, bool, Respond, float], None]] = {
        "replica": _replica, "state_chunk": _state_chunk, "ping": _ping, "stop": _stop, "pin": _pin,
        "set": _set, "scale": _steer, "drain": _steer, "undrain": _steer, "spawn": _spawn,
    }

    def _chain(self, body: Dict[str, Any], requester: str, peer: bool, reply: Respond, now: float) -> None:
        """A deploy's chain request (docs/runtime.md, "Chaining"): consecutive keepers in one
        process here, or a refusal (the deployer then places them one by one). The reply waits
        until every member said "ready" (invariant 2 per member)."""
        members = body.get("chain")
        if peer:
            reply({"ok": False, "error": "refused: a chain is started only by a deploy"})
            return
        if not isinstance(members, list) or not all(isinstance(m, dict) for m in members):
            reply({"ok": False, "error": "invalid chain: expected a list of spec objects"})
            return
        try:
            specs = [self.gate.spec_from(self.wall(), m, template=None, requester=f"admin {requester}")
                     for m in members[:chains.MAX_CHAIN + 1]]
        except (TypeError, ValueError) as exc:
            reply({"ok": False, "error": f"invalid spec: {exc}"})
            return
        problem = chains.chain_problem(specs)
        if problem:
            reply({"ok": False, "error": f"invalid chain: {problem}"})
            return
        here = [s.instance for s in specs if s.instance in self.supervisor]
        if here:
            reply({"ok": False, "error": f"instance {here[0]} already runs on {self.node}"})
            return
        if self.calls.free_slots() < len(specs):
            reply({"ok": False, "error": f"no {len(specs)} free slots on {self.node} for a chain"})
            return
        specs = [spec_with_capacity(s, self.state_dir, self.node) for s in specs]
        if self.spill is not None:
            specs = [self.spill.with_spill(s) for s in specs]
        specs = chains.with_chain(specs)
        try:
            self.supervisor.start_chain(specs, now)
        except (OSError, ValueError) as exc:
            log.error("cannot start chain: %s", exc, extra={"instance": specs[0].instance})
            reply({"ok": False, "error": f"{self.node} could not start the chain"})
            return
        self.counters["spawned_local"] += len(specs)
        self.calls.changed()
        self.calls.spawn(spawns.ChainStarted(specs, reply, str(body.get("cause", "rpc"))[:40]), now)

    # -- fogctl steering (agent/control/rpc_schema.py) -------------------------------------------

    def _keeps_keyed_state(self, instance: str) -> bool:
        """The instance said so in its stats (agent.instance.keyed_state)."""
        w = self.supervisor.get(instance)
        return w is not None and bool(w.stats.get("keyed_state"))

    def steer(self, body: Dict[str, Any], now: float) -> Dict[str, Any]:
        """A fogctl scale/drain request (or the site manager's): check it against our own
        instances (`agent_actions`) and hand each action to its worker as a control line; the
        worker runs it through the SAME protocol as an automatic decision (ScalingCore.start_round
        with a forced decision). A keeper stops here and moves when it has exited (the daemon's
        hand-over)."""
        try:
            req = parse_request(body)
            actions = agent_actions(req, self.node, self.local_instances(), slots=self.calls.fleet_slots())
        except RequestError as exc:
            return Reply(False, {}, str(exc)).to_dict()
        for a in actions:
            if a.kind is ActionKind.HANDOVER and self._keeps_keyed_state(a.instance):
                # Its keyed state travels with the hand-over (agent.node.statexfer) up to a
                # bound: a larger one is refused as a whole, before anything is changed.
                data = statexfer.snapshot_bytes(Path(self.state_dir) / f"{a.instance}.keyed.json")
                why = statexfer.too_large(len(data or b""))
                if why:
                    return Reply(False, {}, f"{a.instance} cannot move: {why}").to_dict()
        if isinstance(req, DrainRequest):
            self.drain.set(not req.undo)  # an undrain: the keepers not stopped yet stay
            self.calls.changed()
        sent: List[str] = []
        # Keyed copies leave first, the keepers wait for them (agent.node.drain).
        copies = {a.instance for a in actions if a.kind is ActionKind.TERMINATE and self._keeps_keyed_state(a.instance)}
        for a in actions:
            if a.kind is ActionKind.HANDOVER:
                # A keeper never terminates: it moves with its identity. It stops here first
                # (drains, keeps its session, writes its state); the rest happens when it has exited.
                if a.instance not in self.supervisor:
                    return Reply(False, {"leaving": sent}, f"instance {a.instance} on {self.node} is not running").to_dict()
                if self.drain.hand_over(a.instance, copies, now):
                    self.supervisor.stop(a.instance, now)
                sent.append(a.instance)
                continue
            kind = "duplicate" if a.kind is ActionKind.DUPLICATE else "terminate"
            if self.supervisor.send(a.instance, "scale", action=kind, count=a.count):
                sent.append(a.instance)
            else:
                return Reply(False, {"instances": sent}, f"instance {a.instance} on {self.node} is not reachable").to_dict()
        log.info("steering %s: %s", body.get("op"), [(a.kind.value, a.instance, a.count) for a in actions],
                 extra={"node": self.node})
        for a in actions:
            w = self.supervisor.get(a.instance)
            if w is not None:
                self.calls.event("drain" if isinstance(req, DrainRequest) else "steer", a.instance, w.spec.operator,
                                 w.spec.pipeline, action=a.kind.value, count=a.count)
        key = "leaving" if isinstance(req, DrainRequest) else "instances"
        return Reply(True, {key: sent, "node": self.node}).to_dict()

    # -- pins (fogctl scale: the policy makes no automatic decision for a pinned operator) -------

    def apply_pins(self) -> List[str]:
        """Send each worker whose pinned flag changed a `set pinned` control line; the pinned ones."""
        pinned, send = self.pins.apply((inst, w.spec.pipeline, w.spec.operator, w.status is WorkerStatus.ACTIVE)
                                       for inst, w in self.supervisor.workers.items())
        for inst, want in send:
            if self.supervisor.send(inst, "set", pinned=want):
                self.pins.delivered(inst, want)
        self.calls.changed()
        return pinned

    def expire_pins(self) -> None:
        expired = self.pins.expire(self.wall())
        for k in expired:
            log.info("pin of %s expired", k, extra={"node": self.node})
        if expired:
            save_pins(Path(self.state_dir), self.pins.pins)
            self.apply_pins()


def spec_with_capacity(spec: InstanceSpec, state_dir: Any, node: str) -> InstanceSpec:
    """For `capacity = "calibrate"`: put THIS node's calibrated capacity into the spec's extra.

    Why here: a copy inherits its creator's extra, but may start on another node whose Pi is
    slower or throttled; the agent that starts the worker knows its own calibration
    (`capacity.capacity_for`). A numeric capacity in the pipeline is left alone. Without a
    calibration the worker keeps its fallback and the agent says how to fix it.
    """
    try:
        cfg = load_pipeline_text(spec.pipeline_toml)
        sc = cfg.scaling_for(spec.operator)
    except Exception:  # the worker reports an unloadable pipeline itself (EXIT_BAD_SPEC)
        return spec
    if sc.capacity != "calibrate":
        return spec
    try:
        cap = capacity_for(state_dir, node, spec.operator, None)
    except ValueError as exc:
        log.warning("%s", exc, extra={"node": node, "operator": spec.operator})
        return spec
    extra = dict(spec.extra)
    extra["capacity"] = cap
    return dataclasses.replace(spec, extra=extra)


def load_pins(state_dir: Path) -> Dict[str, Dict[str, Any]]:
    """The pins this node was given (kept over an agent restart); an unreadable file: none."""
    try:
        doc = json.loads((state_dir / PINS_FILE).read_text())
    except (OSError, ValueError):
        doc = None
    out: Dict[str, Dict[str, Any]] = {}
    for key, p in (doc if isinstance(doc, dict) else {}).items():
        if isinstance(p, dict) and isinstance(p.get("operator"), str) and (
                p.get("until") is None or isinstance(p.get("until"), (int, float))):
            out[str(key)] = {"pipeline": p.get("pipeline") if isinstance(p.get("pipeline"), str) else None,
                             "operator": p["operator"], "until": p.get("until")}
    return out


def save_pins(state_dir: Path, pins: Dict[str, Dict[str, Any]]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(state_dir / PINS_FILE, json.dumps(pins, sort_keys=True))


__all__ = ["HELD_PEER_MAX", "NodeCalls", "PEER_ONLY_OPS", "PINS_FILE", "Requests", "load_pins", "save_pins",
           "spec_with_capacity"]
