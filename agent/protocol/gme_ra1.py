"""RA1: Joung's Ricart-Agrawala algorithm extended to forums (baseline for 2-FGME).

Source: Y.-J. Joung, "Asynchronous group mutual exclusion", Distributed Computing 13(4), 2000,
as summarised in Belkhiria's thesis, section 2.4.3 (Joung's paper itself was not available to us;
this follows the thesis's description).

Rules: a requesting node multicasts Req(forum, SN) to *all* other nodes and enters when every one
of them acknowledged. SN is a Lamport number: incremented on request, max-ed on receipt. A node
replies at once if it is idle, interested in the same forum, or requesting a different forum
with a lower priority (larger <SN, id>); otherwise (in the CS for another forum, or requesting
another forum with a higher priority) it defers the reply until it leaves the CS. An idle node's
priority is the minimum (SN = infinity). Cost: exactly 2 (n - 1) messages per entry.
Concurrent occupancy is poor: a higher-priority request for another forum stops every later
same-forum requester, even while the room is open for that forum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, List, Mapping, Set, Tuple

from agent.protocol.gme_base import (
    INF,
    GmeMessage,
    GmeNode,
    GmeState,
    Group,
    NodeId,
    Output,
    RemoteProtocolError,
    Send,
    register_message,
)

__all__ = ["Ra1Req", "Ra1Ack", "Ra1Node"]


@register_message
@dataclass(frozen=True)
class Ra1Req(GmeMessage):
    kind: ClassVar[str] = "req"
    forum: int
    sn: int


@register_message
@dataclass(frozen=True)
class Ra1Ack(GmeMessage):
    """Reply to the request of the receiver whose sequence number is `sn`."""

    kind: ClassVar[str] = "ack"
    sn: int


class Ra1Node(GmeNode):
    algorithm: ClassVar[str] = "ra1"

    def __init__(self, node_id: NodeId, groups: Mapping[NodeId, Group]) -> None:
        super().__init__(node_id, groups)
        self.peers: Tuple[NodeId, ...] = tuple(self.others())
        self.clock: int = 0
        self.sn: float = INF
        self.deferred: Dict[NodeId, int] = {}
        self.acks: Set[NodeId] = set()

    def _on_request(self) -> List[Output]:
        self.clock += 1
        self.sn = self.clock
        self.acks = set()
        req = Ra1Req(self.id, self.group, self.clock)
        out: List[Output] = [Send(p, req) for p in self.peers]
        if not self.peers:
            out += self._enter()
        return out

    def _must_defer(self, j: NodeId, forum: object, sn: int) -> bool:
        if forum == self.group or self.state is GmeState.IDLE:
            return False
        if self.state is GmeState.IN_CS:
            return True
        return (self.sn, self.id) < (sn, j)

    def receive(self, message: GmeMessage) -> List[Output]:
        if message.sender == self.id or message.sender not in self.groups:
            # Hostile input: an answer to ourselves or to a stranger would be sent nowhere, and a
            # stranger's Ack would count towards our entry (docs/hostile-input.md).
            raise RemoteProtocolError(
                f"RA1 node {self.id}: {message!r} from {message.sender!r}, expected one of the peers {list(self.peers)}"
            )
        if isinstance(message, Ra1Req):
            j = message.sender
            self.clock = max(self.clock, message.sn)
            if self._must_defer(j, message.forum, message.sn):
                self.deferred[j] = message.sn
                return []
            return [Send(j, Ra1Ack(self.id, message.sn))]
        if isinstance(message, Ra1Ack):
            if self.state is not GmeState.REQUESTING or message.sn != self.sn:
                raise RemoteProtocolError(
                    f"RA1 node {self.id} ({self.state.name}, sn={self.sn}): ack {message!r} "
                    "for a request that is not pending"
                )
            self.acks.add(message.sender)
            if len(self.acks) == len(self.peers):
                return self._enter()
            return []
        raise RemoteProtocolError(f"RA1 node {self.id}: unexpected message {message!r}")

    def _on_exit(self) -> List[Output]:
        self.sn = INF
        out: List[Output] = [Send(j, Ra1Ack(self.id, sn)) for j, sn in sorted(self.deferred.items())]
        self.deferred = {}
        return out

    def snapshot(self) -> Tuple[object, ...]:
        return (
            self.state.value,
            self.clock,
            self.sn,
            tuple(sorted(self.deferred.items())),
            frozenset(self.acks),
            self.entries,
        )
