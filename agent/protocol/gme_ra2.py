"""RA2: Joung's RA1 plus captains that capture same-forum requesters (baseline for 2-FGME).

Source: Y.-J. Joung, "Asynchronous group mutual exclusion", Distributed Computing 13(4), 2000,
as described in Belkhiria's thesis, section 2.4.3. Joung's paper was not available to us, so the
details below are our reconstruction of the thesis's description, checked by `gme_check`:

- Requests and replies are RA1's (`gme_ra1`), to all other nodes.
- A node that enters with all replies is a *captain*. On entry, and for every same-forum Req that
  reaches it while in the CS, it sends Start to each node it knows to be requesting the same
  forum and not yet in (VSN[j] > VF[j]); the receiver enters at once as a *successor*.
- Counters: VSN[j] = requests of j known here, VF[j] = entries of j known here. Every message
  carries the sender's VF vector (merged by max). The k-th request of a node ends with its k-th
  entry, so a captain capturing request k of j sets VF[j] = k.
- Out-of-date acks: an Ack from j carries VF_j[j] (j's entries when it replied). A node counts it
  only while VF[j] known locally is not larger: if j was captured after replying, the captain's
  reply (which a different-forum requester always needs, and which is sent only after the captain
  leaves) carries the larger VF[j], and the old Ack is discarded.
- A successor re-sends, when it leaves, a fresh Ack to every different-forum request it had
  acknowledged before entering and does not know to be served (those Acks became out-of-date).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import gt
from typing import ClassVar, Dict, List, Mapping, Tuple

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

__all__ = ["Ra2Req", "Ra2Ack", "Start", "Ra2Node"]


@register_message
@dataclass(frozen=True)
class Ra2Req(GmeMessage):
    kind: ClassVar[str] = "req"
    forum: int
    sn: int
    k: int  # request number of the sender (VSN[sender])
    vf: Tuple[int, ...]


@register_message
@dataclass(frozen=True)
class Ra2Ack(GmeMessage):
    kind: ClassVar[str] = "ack"
    k: int  # request number of the receiver being acknowledged
    vf: Tuple[int, ...]


@register_message
@dataclass(frozen=True)
class Start(GmeMessage):
    kind: ClassVar[str] = "start"
    k: int  # request number of the captured receiver
    vf: Tuple[int, ...]


class Ra2Node(GmeNode):
    algorithm: ClassVar[str] = "ra2"

    def __init__(self, node_id: NodeId, groups: Mapping[NodeId, Group]) -> None:
        super().__init__(node_id, groups)
        self.peers: Tuple[NodeId, ...] = tuple(self.others())
        self.n = max(groups) + 1
        self.clock = 0
        self.sn: float = INF
        self.vsn: List[int] = [0] * self.n
        self.vf: List[int] = [0] * self.n
        self.deferred: Dict[NodeId, int] = {}  # node -> its request number
        self.acks: Dict[NodeId, int] = {}  # node -> its entries when it replied
        self.acked_open: Dict[NodeId, int] = {}  # different-forum requests we acked
        self.captain = False

    # -- helpers ----------------------------------------------------------------------------------

    def _merge(self, vf: Tuple[int, ...]) -> None:
        """Learn the entries other nodes know of; a node's own count is its own (see the fix).

        FIX (checker counterexample, seed 3 schedule 857 of 10,000 6+6 runs): a captured node
        whose Start is still in flight can learn VF[self] = k from a third node before it enters.
        If it then acknowledged a different-forum request with that VF[self], the requester
        could not tell the Ack out-of-date (e = VF[j]) and entered next to it. VF_i[i] is now
        only ever set by i's own entry, so an Ack always carries the entries i really made.
        """
        mine = self.vf
        if not any(map(gt, vf, mine)):  # the common case: nothing new (C-speed scan)
            return
        me = self.id
        for j, v in enumerate(vf):
            if v > mine[j] and j != me:
                mine[j] = v
        for j in [j for j, e in self.acks.items() if e < self.vf[j] and self.groups[j] != self.group]:
            del self.acks[j]  # out-of-date: j entered the CS after replying
        for j in [j for j, k in self.acked_open.items() if self.vf[j] >= k]:
            del self.acked_open[j]

    def _ack(self, j: NodeId, k: int) -> Send:
        if self.groups[j] != self.group:
            self.acked_open[j] = k
        return Send(j, Ra2Ack(self.id, k, tuple(self.vf)))

    def _capture(self) -> List[Output]:
        out: List[Output] = []
        for j in self.peers:
            if self.groups[j] == self.group and self.vsn[j] > self.vf[j]:
                self.vf[j] = self.vsn[j]
                out.append(Send(j, Start(self.id, self.vsn[j], tuple(self.vf))))
        return out

    def _enter_as(self, captain: bool) -> List[Output]:
        self.captain = captain
        self.vf[self.id] = self.vsn[self.id]
        out = self._enter()
        if captain:
            out += self._capture()
        return out

    # -- driver API -------------------------------------------------------------------------------

    def _on_request(self) -> List[Output]:
        self.clock += 1
        self.sn = self.clock
        self.vsn[self.id] += 1
        self.acks = {}
        k = self.vsn[self.id]
        req = Ra2Req(self.id, self.group, self.clock, k, tuple(self.vf))
        out: List[Output] = [Send(p, req) for p in self.peers]
        if not self.peers:
            out += self._enter_as(True)
        return out

    def receive(self, message: GmeMessage) -> List[Output]:
        j = message.sender
        if j == self.id or j not in self.groups:
            # Hostile input: j indexes VSN/VF, so a stranger's id would be an IndexError (or,
            # negative, another node's counter) after part of the state was already merged.
            raise RemoteProtocolError(
                f"RA2 node {self.id}: {message!r} from {j!r}, expected one of the peers {list(self.peers)}"
            )
        vf = getattr(message, "vf", None)
        if vf is not None and len(vf) != self.n:
            raise RemoteProtocolError(f"RA2 node {self.id}: {message!r} carries {len(vf)} entry counts (VF), expected {self.n}")
        if isinstance(message, Ra2Req):
            self.clock = max(self.clock, message.sn)
            self.vsn[j] = max(self.vsn[j], message.k)
            self._merge(message.vf)
            self.deferred.pop(j, None)  # an older deferred request of j was served already
            same = message.forum == self.group
            if same and self.state is GmeState.IN_CS and self.captain:
                return self._capture()
            if same or self.state is GmeState.IDLE or (
                self.state is GmeState.REQUESTING and (self.sn, self.id) > (message.sn, j)
            ):
                return [self._ack(j, message.k)]
            self.deferred[j] = message.k
            return []
        if isinstance(message, Ra2Ack):
            self._merge(message.vf)
            if self.state is GmeState.REQUESTING and message.k == self.vsn[self.id]:
                e = message.vf[j]
                if not (self.groups[j] != self.group and e < self.vf[j]):
                    self.acks[j] = e
                if len(self.acks) == len(self.peers):
                    return self._enter_as(True)
            return []
        if isinstance(message, Start):
            self._merge(message.vf)
            if self.state is GmeState.REQUESTING and message.k == self.vsn[self.id]:
                return self._enter_as(False)
            return []
        raise RemoteProtocolError(f"RA2 node {self.id}: unexpected message {message!r}")

    def _on_exit(self) -> List[Output]:
        self.sn = INF
        out: List[Output] = []
        revoked = dict(self.acked_open) if not self.captain else {}
        for j, k in sorted(self.deferred.items()):
            out.append(self._ack(j, k))
            revoked.pop(j, None)
        for j, k in sorted(revoked.items()):
            if self.vf[j] < k:
                out.append(self._ack(j, k))
        self.deferred = {}
        self.captain = False
        return out

    def snapshot(self) -> Tuple[object, ...]:
        return (
            self.state.value,
            self.clock,
            self.sn,
            tuple(self.vsn),
            tuple(self.vf),
            tuple(sorted(self.deferred.items())),
            tuple(sorted(self.acks.items())),
            tuple(sorted(self.acked_open.items())),
            self.captain,
            self.entries,
        )
