"""createNode() on this node: where a new instance starts and who hears of it (the daemon's spawns).

Rules of this file: no I/O, no clock, no reference to the daemon. h11's habit: the daemon
(agent.node.spawnshell) hands `Spawns.handle` one typed event and the time, and carries out the
commands it returns, in order; the outcome of a command that has one (`StartLocal`, `AskPeer`,
`StageKeyed`) comes back as the next event (`LocalStart`, `Asked`, `Staged`). A requester is opaque
here (`ReplyTo`): the core says which answer goes to it (`Answer`), the daemon sends it. An event
this table does not know, or an outcome for no command, is the daemon's bug: it raises.

The rules, and why:
- The walk: the candidates in turn, the first that takes the instance ends it. This node starts a
  worker (`StartLocal`); another node is asked on its peer topic (`AskPeer`), a keyed keeper's
  state chunks first. Nobody left: the createNode() fails with the last error (`Failed`).
- A re-home's standby (where the copy of its keyed state is, agent.node.replicas) is the first
  candidate, also when placement skipped it for want of a slot: elsewhere the instance would
  resume its key groups empty; it starts there beyond the slots.
- A local start is answered at the worker's "ready" (docs/design.md invariant 2: subscribe
  before announce); a worker that exits before it moves the walk on.
- A request for an instance that exists is answered with it, never with a second process of one
  identity: at once when it runs, at its "ready" when it is starting (each requester then).
- A node that does not answer within RPC_TIMEOUT may still start the instance (its answer held by
  a partition), so the same identity is never asked of another node (invariant 7): the
  createNode() fails and its creator decides again, with a new copy.
- A spawn that reached this node from another was placed here: it starts here or is refused,
  never forwarded (two agents with stale views would bounce it forever).
- A chain (docs/runtime.md, "Chaining") is answered once: ok when every member is ready, else
  with the first failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from agent.instance.spec import InstanceSpec, request_spec

RPC_TIMEOUT = 30.0  # seconds to wait for a remote agent to start an instance and see it ready

ReplyTo = Any  # whom an answer goes to: the daemon's, never looked into here
Chunk = Mapping[str, Any]  # a `state_chunk` request body (agent.node.statexfer)


# -- events (in) ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpawnEvent:
    """Base of what `Spawns.handle` takes."""


@dataclass(frozen=True)
class CreateNode(SpawnEvent):
    """A createNode() of ours (a worker's copy, a re-home, a hand-over): placed anywhere.
    `ranking`: placement's nodes, best first; `here`: the status of our worker of that instance
    (None: none); `elsewhere`: another online node that lists it; `online`: the fleet's statuses."""

    spec: InstanceSpec
    reply: ReplyTo
    cause: str
    ranking: Sequence[str]
    online: Mapping[str, bool]
    here: Optional[str] = None
    elsewhere: Optional[str] = None
    chunks: Sequence[Chunk] = ()


@dataclass(frozen=True)
class SpawnRequest(SpawnEvent):
    """A spawn on our peer or rpc topic from `requester`, admitted: it starts here or is refused."""

    spec: InstanceSpec
    reply: ReplyTo
    cause: str
    requester: str
    here: Optional[str] = None


@dataclass(frozen=True)
class ChainStarted(SpawnEvent):
    """The daemon started a chain's process (`specs`, upstream first); one answer for them all."""

    specs: Sequence[InstanceSpec]
    reply: ReplyTo
    cause: str


@dataclass(frozen=True)
class Staged(SpawnEvent):
    """The outcome of `StageKeyed`: None, or why the state was refused."""

    job: int
    error: Optional[str]


@dataclass(frozen=True)
class LocalStart(SpawnEvent):
    """The outcome of `StartLocal`: None (the worker runs, not ready yet), or why not."""

    job: int
    error: Optional[str]


@dataclass(frozen=True)
class Asked(SpawnEvent):
    """The outcome of `AskPeer`: None (queued), or why not."""

    job: int
    error: Optional[str]


@dataclass(frozen=True)
class PeerReply(SpawnEvent):
    """A reply on `replies/<me>/<replier>` (the topic proves the replier): its decoded `result`,
    or `bad`, why it did not decode."""

    correlation: str
    replier: str
    result: Optional[Mapping[str, Any]] = None
    bad: Optional[str] = None


@dataclass(frozen=True)
class Ready(SpawnEvent):
    """Our worker of `instance` said "ready": its inbox is subscribed."""

    instance: str


@dataclass(frozen=True)
class Exited(SpawnEvent):
    """Our worker of `instance` exited, for `reason`."""

    instance: str
    reason: str


@dataclass(frozen=True)
class Expire(SpawnEvent):
    """The loop's turn: the calls past their deadline fail."""


@dataclass(frozen=True)
class Shutdown(SpawnEvent):
    """The agent stops: the starts not ready yet are answered as failed."""


# -- commands (out) ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpawnCommand:
    """Base of what `Spawns.handle` returns."""


@dataclass(frozen=True)
class StartLocal(SpawnCommand):
    """Start a worker of `spec` here; then `LocalStart(job, ...)`."""

    job: int
    spec: InstanceSpec
    cause: str


@dataclass(frozen=True)
class StageKeyed(SpawnCommand):
    """A hand-over of a keyed keeper: check and stage the state `requester` sent in chunks before
    the spawn (agent.node.statexfer); then `Staged(job, ...)`."""

    job: int
    spec: InstanceSpec
    requester: str


@dataclass(frozen=True)
class AskPeer(SpawnCommand):
    """Publish `chunks` then `body` on `node`'s peer topic, the body with `correlation`; then
    `Asked(job, ...)` (all queued, or why not)."""

    job: int
    node: str
    correlation: str
    body: Mapping[str, Any]
    chunks: Sequence[Chunk]


@dataclass(frozen=True)
class Answer(SpawnCommand):
    reply: ReplyTo
    result: Mapping[str, Any]


@dataclass(frozen=True)
class Placed(SpawnCommand):
    """`node` started `spec`: count it, and in the fleet view until its state lists it."""

    node: str
    spec: InstanceSpec


@dataclass(frozen=True)
class Failed(SpawnCommand):
    """No candidate took `spec`: count and log."""

    spec: InstanceSpec
    error: str
    tried: Tuple[str, ...]


@dataclass(frozen=True)
class TimedOut(SpawnCommand):
    """`node` did not answer the spawn of `spec` within RPC_TIMEOUT: count and log."""

    spec: InstanceSpec
    node: str


@dataclass(frozen=True)
class BadReply(SpawnCommand):
    """The reply of `replier` to one of our calls did not decode: count and log."""

    replier: str
    error: str


# -- the core ---------------------------------------------------------------------------------------


def candidates(ranking: Sequence[str], spec: InstanceSpec, cause: str, me: str,
               online: Mapping[str, bool]) -> List[str]:
    """The nodes to try, in order: placement's, with a re-home's standby first when it is us or
    online."""
    out = list(ranking)
    standby = spec.extra.get("standby")
    if cause == "rehome" and isinstance(standby, str) and (standby == me or online.get(standby)):
        if standby in out:
            out.remove(standby)
        out.insert(0, standby)
    return out


def starts_beyond_slots(spec: InstanceSpec, cause: str, me: str, draining: bool, has_copy: bool) -> bool:
    """A re-home of a keyed instance whose standby copy we hold starts here even with every slot
    taken: elsewhere it would resume its key groups empty (their windows lost, others sent again
    under new ids), while the slot it takes beyond ours is given back at its scale-in. Not while
    we drain (we are being emptied)."""
    return cause == "rehome" and not draining and spec.extra.get("standby") == me and has_copy


@dataclass
class _Chain:
    ids: List[str]
    reply: ReplyTo
    ready: Set[str] = field(default_factory=set)
    done: bool = False


@dataclass
class _Job:
    id: int
    spec: InstanceSpec
    cause: str
    candidates: List[str]
    replies: List[ReplyTo]
    chunks: Tuple[Chunk, ...] = ()
    tried: List[str] = field(default_factory=list)
    chain: Optional[_Chain] = None
    asking: Tuple[str, str] = ("", "")  # (node, correlation) of its AskPeer


@dataclass
class Call:
    """A spawn asked of `node`, unanswered until `deadline`."""

    node: str
    deadline: float
    job: _Job


class Spawns:
    def __init__(self, me: str, prefix: str) -> None:
        self.me = me
        self._prefix = prefix  # of our correlation ids: unique to this agent's run
        self._seq = 0
        self._steps: Dict[int, _Job] = {}  # job id -> a job whose command's outcome is due
        self.awaiting: Dict[str, _Job] = {}  # instance -> its local start, until "ready"
        self.calls: Dict[str, Call] = {}  # correlation -> a spawn asked of another node

    def handle(self, event: SpawnEvent, now: float) -> List[SpawnCommand]:
        try:
            handler = self._EVENTS[type(event)]
        except KeyError:
            raise TypeError(f"not a spawn event: {type(event).__name__}") from None
        return handler(self, event, now)

    # -- readings

    def cause_of(self, instance: str) -> Optional[str]:
        """The cause of the start that waits for `instance` to be ready here, None when none."""
        job = self.awaiting.get(instance)
        return job.cause if job is not None else None

    def placing(self) -> List[Tuple[str, str, str]]:
        """(instance, pipeline, operator) of each spawn asked of another node, unanswered."""
        return [(c.job.spec.instance, c.job.spec.pipeline, c.job.spec.operator) for c in self.calls.values()]

    # -- events

    def _create(self, ev: CreateNode, now: float) -> List[SpawnCommand]:
        known = self._existing(ev.spec.instance, ev.reply, ev.here, ev.elsewhere)
        if known is not None:
            return known
        job = self._job(ev.spec, ev.cause, candidates(ev.ranking, ev.spec, ev.cause, self.me, ev.online), ev.reply)
        job.chunks = tuple(ev.chunks)
        return self._walk(job, now, "no node has a free slot")

    def _request(self, ev: SpawnRequest, now: float) -> List[SpawnCommand]:
        known = self._existing(ev.spec.instance, ev.reply, ev.here, None)
        if known is not None:
            return known
        job = self._job(ev.spec, ev.cause, [self.me], ev.reply)
        if "handover_keyed" in ev.spec.extra:
            self._steps[job.id] = job
            return [StageKeyed(job.id, job.spec, ev.requester)]
        return self._walk(job, now, f"no free slot on {self.me}")

    def _chain_started(self, ev: ChainStarted, now: float) -> List[SpawnCommand]:
        chain = _Chain([s.instance for s in ev.specs], ev.reply)
        for spec in ev.specs:
            job = self._job(spec, ev.cause, [], None)
            job.chain = chain
            self.awaiting[spec.instance] = job
        return []

    def _staged(self, ev: Staged, now: float) -> List[SpawnCommand]:
        job = self._step(ev.job, StageKeyed)
        if ev.error is not None:
            return self._answer(job, {"ok": False, "error": ev.error})
        return self._walk(job, now, f"no free slot on {self.me}")

    def _local_start(self, ev: LocalStart, now: float) -> List[SpawnCommand]:
        job = self._step(ev.job, StartLocal)
        if ev.error is not None:
            return self._walk(job, now, ev.error)
        self.awaiting[job.spec.instance] = job
        return []

    def _asked(self, ev: Asked, now: float) -> List[SpawnCommand]:
        job = self._step(ev.job, AskPeer)
        if ev.error is not None:
            return self._walk(job, now, ev.error)
        node, correlation = job.asking
        self.calls[correlation] = Call(node, now + RPC_TIMEOUT, job)
        return []

    def _peer_reply(self, ev: PeerReply, now: float) -> List[SpawnCommand]:
        call = self.calls.get(ev.correlation)
        if call is None or call.node != ev.replier:
            return []  # late, after a timeout (the job moved on), or not from the node we asked
        del self.calls[ev.correlation]
        job = call.job
        if ev.result is None:
            error = ev.bad or "no result"
            return [BadReply(ev.replier, error)] + self._walk(job, now, f"bad reply from {call.node}: {error}")
        if ev.result.get("ok"):
            return [Placed(call.node, job.spec)] + self._answer(job, dict(ev.result))
        return self._walk(job, now, f"{call.node}: {ev.result.get('error')}")

    def _ready(self, ev: Ready, now: float) -> List[SpawnCommand]:
        job = self.awaiting.pop(ev.instance, None)
        if job is None:
            return []
        return self._answer(job, {"ok": True, "instance": ev.instance, "node": self.me})

    def _exited(self, ev: Exited, now: float) -> List[SpawnCommand]:
        job = self.awaiting.pop(ev.instance, None)
        if job is None:
            return []
        return self._walk(job, now, f"worker exited before ready ({ev.reason})")

    def _expire(self, ev: Expire, now: float) -> List[SpawnCommand]:
        out: List[SpawnCommand] = []
        for correlation, call in list(self.calls.items()):
            if call.deadline <= now:
                del self.calls[correlation]
                spec = call.job.spec
                out.append(TimedOut(spec, call.node))
                out += self._answer(call.job, {"ok": False, "error": f"no reply from {call.node} within "
                                               f"{RPC_TIMEOUT:.0f}s (it may still start {spec.instance})"})
        return out

    def _shutdown(self, ev: Shutdown, now: float) -> List[SpawnCommand]:
        out: List[SpawnCommand] = []
        for job in self.awaiting.values():
            out += self._answer(job, {"ok": False, "error": f"agent {self.me} is shutting down"})
        self.awaiting.clear()
        return out

    _EVENTS: Dict[type, Callable[["Spawns", Any, float], List[SpawnCommand]]] = {
        CreateNode: _create, SpawnRequest: _request, ChainStarted: _chain_started, Staged: _staged,
        LocalStart: _local_start, Asked: _asked, PeerReply: _peer_reply, Ready: _ready, Exited: _exited,
        Expire: _expire, Shutdown: _shutdown,
    }

    # -- the walk

    def _job(self, spec: InstanceSpec, cause: str, nodes: List[str], reply: ReplyTo) -> _Job:
        self._seq += 1
        return _Job(self._seq, spec, cause, nodes, [] if reply is None else [reply])

    def _step(self, job_id: int, command: type) -> _Job:
        job = self._steps.pop(job_id, None)
        if job is None:
            raise LookupError(f"no {command.__name__} of spawn job {job_id} is waiting for its outcome")
        return job

    def _existing(self, instance: str, reply: ReplyTo, here: Optional[str],
                  elsewhere: Optional[str]) -> Optional[List[SpawnCommand]]:
        """The answer when `instance` exists already (its creator crashed mid-round and performs
        its queued outputs again, agent.instance.recovery); None when it does not."""
        if here is not None:
            job = self.awaiting.get(instance)
            if job is not None:  # still starting: every requester hears at its "ready"
                job.replies.append(reply)
                return []
            if here == "active":
                return [Answer(reply, {"ok": True, "instance": instance, "node": self.me})]
            return [Answer(reply, {"ok": False, "error": f"instance {instance} is {here} on {self.me}"})]
        if elsewhere is not None:
            return [Answer(reply, {"ok": True, "instance": instance, "node": elsewhere})]
        return None

    def _walk(self, job: _Job, now: float, error: str) -> List[SpawnCommand]:
        """The next candidate's command, or the failure when none is left (`error`: the last)."""
        if not job.candidates:
            return [Failed(job.spec, error, tuple(job.tried))] + self._answer(job, {"ok": False, "error": error})
        node = job.candidates.pop(0)
        job.tried.append(node)
        self._steps[job.id] = job
        if node == self.me:
            return [StartLocal(job.id, job.spec, job.cause)]
        correlation = f"{self._prefix}-{job.id}-{len(job.tried)}-{now:.6f}"
        job.asking = (node, correlation)
        body = {"op": "spawn", "spec": request_spec(job.spec), "cause": job.cause, "from": self.me}
        return [AskPeer(job.id, node, correlation, body, job.chunks)]

    def _answer(self, job: _Job, result: Mapping[str, Any]) -> List[SpawnCommand]:
        out = self._chain_answer(job.chain, job.spec.instance, result) if job.chain is not None else []
        return out + [Answer(r, result) for r in job.replies]

    def _chain_answer(self, chain: _Chain, member: str, result: Mapping[str, Any]) -> List[SpawnCommand]:
        if chain.done:
            return []
        if not result.get("ok"):
            chain.done = True
            return [Answer(chain.reply, {"ok": False, "error": f"chain member {member}: {result.get('error')}"})]
        chain.ready.add(member)
        if not chain.ready.issuperset(chain.ids):
            return []
        chain.done = True
        return [Answer(chain.reply, {"ok": True, "instance": chain.ids[-1], "node": self.me, "members": list(chain.ids)})]


__all__ = [
    "Answer", "AskPeer", "Asked", "BadReply", "Call", "ChainStarted", "CreateNode", "Exited", "Expire", "Failed",
    "LocalStart", "PeerReply", "Placed", "RPC_TIMEOUT", "Ready", "Shutdown", "SpawnCommand", "SpawnEvent",
    "SpawnRequest", "Spawns", "StageKeyed", "Staged", "StartLocal", "TimedOut", "candidates", "starts_beyond_slots",
]
