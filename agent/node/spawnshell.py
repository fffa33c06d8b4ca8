"""createNode() on this node carried out (`CreateNodes`): the placement policy ranks the fleet as
this agent sees it, the createNode() core (agent.node.spawns) walks the candidates and decides,
and this side carries out its commands (`COMMANDS`): starts a worker here, asks a peer, stages a
hand-over's keyed state, answers, counts and logs, and hands the outcome of a start, a request or
a staging back as an event.

Why the commands are stateless: everything a command reads or changes belongs to the node
(`Here`, made once by the daemon, its calls late-bound), so nothing here outlives one run.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from agent import topics
from agent.config import load_pipeline_text
from agent.files import write_atomic
from agent.instance import deployfiles
from agent.instance.spec import InstanceSpec
from agent.node import rpc, spawns, statexfer
from agent.node.contexts import PolicyContexts, siblings
from agent.node.fleetview import FleetView
from agent.node.placement import NodeView, PlacementPolicy, PlacementRequest, policy_for_operator
from agent.node.requests import spec_with_capacity
from agent.node.spawns import RPC_TIMEOUT
from agent.node.workers import WorkerTable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Here:
    """What the commands read and change of this node."""

    node: str
    cluster: str
    state_dir: str
    supervisor: WorkerTable
    spill: Any  # agent.spill.local.AgentSpill, or None
    view: FleetView
    staging: statexfer.Staging
    counters: Dict[str, int]
    connected: Callable[[], bool]  # to the broker
    free_slots: Callable[[], int]
    beyond_slots: Callable[[InstanceSpec, str], bool]  # spawns.starts_beyond_slots, on this node
    install_replica: Callable[[InstanceSpec], None]  # our standby copy becomes its state (a re-home)
    changed: Callable[[], None]  # our state changed: publish it soon
    hosted_first: Callable[[], None]  # our hosted record published first, when it changed
    publish: Callable[..., Any]  # (topic, payload, correlation=...)
    bad: Callable[[str, Optional[str], Any], None]  # a bad message: counted and logged


class CreateNodes:
    """createNode() on this node: placed, walked by the core, its commands carried out."""

    def __init__(self, spawning: spawns.Spawns, here: Here, policy: PlacementPolicy, contexts: PolicyContexts,
                 slots: int, node_slots: Any, stopping: Callable[[], bool]) -> None:
        self.spawning, self.here, self.policy, self.contexts = spawning, here, policy, contexts
        self.slots, self.node_slots, self.stopping = slots, node_slots, stopping

    def views(self) -> List[NodeView]:
        """The fleet as placement sees it: this node as it is now, the others from their records
        (`[security] node_slots` bounds what another node may claim)."""
        h = self.here
        return h.view.views(NodeView(node=h.node, slots=self.slots, free_slots=h.free_slots(), online=True,
                                     latency_ms=h.view.latency.get(h.node, {}), instances=tuple(h.supervisor.workers)),
                            self.node_slots)

    def fleet_slots(self) -> int:
        """All slots of the online fleet as this agent sees it: the bound of a forced scale-out."""
        return sum(max(0, v.slots) for v in self.views() if v.online)

    def create(self, spec: InstanceSpec, reply: spawns.ReplyTo, cause: str, now: float,
               chunks: Sequence[Dict[str, Any]] = ()) -> None:
        """A createNode() of ours (a worker's copy, a re-home, a hand-over): the placement policy of
        its operator ranks the nodes, the core walks them; none while the agent stops."""
        h = self.here
        if self.stopping():
            reply({"ok": False, "error": f"agent {h.node} is shutting down"})
            return
        others = siblings(spec, {i: w.spec for i, w in h.supervisor.workers.items()},
                          h.view.siblings(spec.pipeline, spec.operator, spec.instance))
        request = PlacementRequest(operator=spec.operator, local=h.node, neighbours=spec.succs + spec.preds,
                                   siblings=others)
        policy = policy_for_operator(self.policy, self.contexts.operator_policy(spec)[0])
        ranking = tuple(policy(request, self.views()))
        w = h.supervisor.get(spec.instance)
        status = w.status.value if w is not None else None
        self.handle(spawns.CreateNode(spec, reply, cause, ranking, h.view.online, status, h.view.runs_on(spec.instance),
                                      tuple(chunks)), now)

    def handle(self, event: spawns.SpawnEvent, now: float) -> None:
        """Hand `event` to the createNode() core and carry out its commands in order; the outcome
        of a local start, a staging or a peer request goes back to it."""
        todo = [event]
        while todo:
            for cmd in self.spawning.handle(todo.pop(0), now):
                outcome = carry_out(cmd, self.here, now)
                if outcome is not None:
                    todo.append(outcome)


def carry_out(cmd: spawns.SpawnCommand, here: Here, now: float) -> Optional[spawns.SpawnEvent]:
    """Carry out `cmd`; the outcome of a local start, a staging or a peer request, for the core."""
    return COMMANDS[type(cmd)](cmd, here, now)


def start_local(cmd: spawns.StartLocal, here: Here, now: float) -> spawns.LocalStart:
    spec = cmd.spec
    if (here.free_slots() <= 0 and not here.beyond_slots(spec, cmd.cause)) or spec.instance in here.supervisor:
        return spawns.LocalStart(cmd.job, _no_local_start(here))
    spec = spec_with_capacity(spec, here.state_dir, here.node)
    if here.spill is not None:
        spec = here.spill.with_spill(spec)
    deployfiles.claim_spec(spec)  # before the standby copy is installed among its files
    here.install_replica(spec)
    try:
        here.supervisor.start(spec, now)
    except (OSError, ValueError) as exc:
        log.error("cannot start worker: %s", exc, extra={"instance": spec.instance})
        return spawns.LocalStart(cmd.job, _no_local_start(here))
    here.counters["spawned_local"] += 1
    here.changed()
    return spawns.LocalStart(cmd.job, None)


def _no_local_start(here: Here) -> str:
    return f"no free slot on {here.node}" if here.free_slots() <= 0 else f"{here.node} could not start the worker"


def ask_peer(cmd: spawns.AskPeer, here: Here, now: float) -> spawns.Asked:
    if not here.connected():
        return spawns.Asked(cmd.job, "not connected to the broker")
    # The receiver accepts a peer spawn only for a pipeline our retained hosted record lists
    # (docs/security.md): publish it first, on the same connection, so that it arrives before
    # the request.
    here.hosted_first()
    peer_topic = topics.agent_peer(here.cluster, cmd.node, here.node)
    # A keyed keeper's state first, on the same topic and QoS: it arrives before the spawn.
    # A chunk not queued: no spawn (it would be refused for want of its state).
    if all(here.publish(peer_topic, rpc.encode(dict(chunk))) for chunk in cmd.chunks) and \
            here.publish(peer_topic, rpc.encode(dict(cmd.body)), correlation=cmd.correlation.encode()):
        here.view.reserve(cmd.node)
        return spawns.Asked(cmd.job, None)
    return spawns.Asked(cmd.job, f"request to {cmd.node} not queued")


def stage_keyed(cmd: spawns.StageKeyed, here: Here, now: float) -> spawns.Staged:
    """A hand-over spawn of a keyed keeper: its state, assembled from the chunks the requester
    sent before it, verified and checked (statexfer), written where its worker installs it
    (`Worker._take_handover`) under the instance id `Gate.spec_from` validated. The error text
    refuses the spawn (the requester tries another node or keeps the keeper)."""
    spec, requester = cmd.spec, cmd.requester
    try:
        data = here.staging.take(requester, spec.instance, spec.extra["handover_keyed"])
        groups = load_pipeline_text(spec.pipeline_toml, f"pipeline {spec.pipeline}").operator(spec.operator).key_groups
        statexfer.check_keyed(data, spec.operator, groups)
        state_dir = Path(here.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)  # a fresh node's has no worker yet
        write_atomic(state_dir / f"{spec.instance}.keyed.handover", data.decode("utf-8"))
    except (ValueError, KeyError, OSError) as exc:
        here.bad(f"keyed state of {spec.instance}", requester, exc)
        return spawns.Staged(cmd.job, f"keyed state of {spec.instance}: {exc}")
    log.info("keyed state of %d bytes received from %s", len(data), requester, extra={"instance": spec.instance})
    return spawns.Staged(cmd.job, None)


def answer(cmd: spawns.Answer, here: Here, now: float) -> None:
    cmd.reply(dict(cmd.result))


def placed(cmd: spawns.Placed, here: Here, now: float) -> None:
    here.counters["spawned_remote"] += 1
    here.view.place(cmd.node, (cmd.spec.instance, cmd.spec.pipeline, cmd.spec.operator))


def failed(cmd: spawns.Failed, here: Here, now: float) -> None:
    here.counters["spawn_failed"] += 1
    log.warning("cannot place %s: %s (tried %s)", cmd.spec.instance, cmd.error, list(cmd.tried) or "none",
                extra={"node": here.node, "operator": cmd.spec.operator})


def timed_out(cmd: spawns.TimedOut, here: Here, now: float) -> None:
    here.counters["spawn_failed"] += 1
    log.warning("agent %s did not answer the spawn of %s within %.0fs: not placed elsewhere under "
                "the same identity", cmd.node, cmd.spec.instance, RPC_TIMEOUT,
                extra={"node": here.node, "operator": cmd.spec.operator})


def bad_reply(cmd: spawns.BadReply, here: Here, now: float) -> None:
    here.bad("reply", cmd.replier, cmd.error)


COMMANDS: Dict[type, Callable[[Any, Here, float], Optional[spawns.SpawnEvent]]] = {
    spawns.StartLocal: start_local, spawns.AskPeer: ask_peer, spawns.StageKeyed: stage_keyed,
    spawns.Answer: answer, spawns.Placed: placed, spawns.Failed: failed,
    spawns.TimedOut: timed_out, spawns.BadReply: bad_reply,
}
