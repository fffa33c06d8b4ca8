"""2-FGME: group mutual exclusion for two fixed groups (Belkhiria thesis, chapter 5, Alg. 12-15).

Rules of this file: every handler below is one procedure of the thesis's pseudo-code, with the
thesis's line numbers in comments, so that a reader can check the transcription line by line.
Where the pseudo-code is ambiguous the choice made is marked DEVIATION and explained.

Why this algorithm: neighbouring operators must not scale at the same time, while all instances
of one operator may. A node asks permission only from its *competitors* (the nodes of the other
group), never from its own group, which is what saves messages compared with Joung's RA1/RA2. To
still let a whole group in, a node that acknowledged a higher-priority competitor keeps
acknowledging the other group (`competitors_authorized`) until one of them leaves or withdraws
(End / Ack(end) / Ack(renew)). Its own request is then put on hold (`reqs_to_send`) and any
acknowledgement already received for it becomes invalid (`acks_rcvd` / `acks_to_ign`).

System model (thesis 5.2.1): reliable FIFO channels, nodes do not crash, groups are fixed.

DEVIATION (found by our checker, `foglab.sim.gme_check`): in the literal pseudo-code
`acks_to_ign` is a *set*, but a node can withdraw and resend its request to the same competitor
several times (lines 25-38 / 43-50, then 63 / 83) before the answers arrive, so several
acknowledgements to ignore can be in flight from one node, and a set counts only one of them.
The checker finds a schedule of 2+2 nodes, 2 requests each, where the second, stale Ack is
counted and two groups end up in the CS together (see docs/gme.md). Fix, with the smallest
change we found: every Req carries an *epoch* (a per-node counter, +1 per Req sent), every Ack
echoes the epoch of the Req it answers (`waiting_reqs` remembers it), and `acks_to_ign` maps a
competitor to the last withdrawn epoch: an Ack is ignored when it answers a withdrawn Req or a
Req of an earlier request. Same messages, same count, same lines; only the bookkeeping counts.

DEVIATION 4 (damping, issue 27; docs/gme.md "24 nodes on the broker"): line 79 ends the
authorization of the other group on ANY End. An End that answers nothing of ours, the
withdrawal broadcast of a competitor that just yielded to someone else (lines 25-31), then makes
an authorizing node resume (line 83), its resumed Reqs make lower-priority competitors withdraw
and broadcast Ends again: a branching loop whose factor is ~1 with instant delivery and above 1
when each node's messages leave through one queue (MQTT). On the broker at 24 nodes it never
ends. Damped (`damped`; the default where users run the lock, DAMPING_DEFAULT), the
authorization ends on an End only from a node it was granted FOR
(`authorized_for`: the higher-priority requester of line 20-23, or the waiting requesters acked
at exit, lines 90-92), on any Ack(renew) / Ack(end) (line 60, unchanged), and never before one of
them leaves or withdraws: the thesis's prose ("a node stops acknowledging requests from its
competitors when one of them either leaves the critical section or postpones its own request"),
read as "one of those it acknowledges". Other Ends still update the clock and drop the sender's
waiting Req (lines 78, 80-82).

DEVIATION 5 (yield once per request, issue 27; docs/gme.md "48 and 96 nodes"), `yield_once`
(the GME bench turns on 4 and 5 by default, the simulator with `--damping`): a requesting node
runs lines 22-31 (start authorizing the other group and withdraw from every other competitor) at
most once per request. A later higher-priority Req, while it is not
authorizing, gets the Ack of line 21 (and DEVIATION 2), nothing more: the acknowledgement a
higher-priority request needs, without a new withdrawal broadcast. Why: with DEVIATION 4 alone
the churn still fed itself at 48 nodes behind slow publishers: 90% of the withdrawal broadcasts
were answers to Reqs *resent* after an authorization ended (line 83), and each broadcast's Ends
made about one more node resend. Yielding at most once per request bounds the broadcasts by the
requests, whatever the timing. The published algorithm already acks a higher-priority Req with
no new withdrawal when it is authorizing (line 22 false); this extends that to "already yielded
for this request". Safety is pairwise and unchanged (an Ack to a higher-priority j is exactly
line 21); liveness: docs/gme.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

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

__all__ = ["Req", "Ack", "End", "FgmeNode", "FAULTS", "DAMPING_DEFAULT"]

# The variant users get wherever they run the lock, the one source of truth for that default
# (docs/gme.md, "The default: the damped variant"): a pipeline's `[pipeline] fgme_damping`
# (DEVIATION 4 in the lock nodes; agent.config, agent.protocol.guarded), `fog-agent bench gme`
# (DEVIATIONS 4 and 5, `--no-damping` for the published lines) and `fog-agent chaos`. Damped,
# because the published lines 22 and 79 stall behind slow publishers (24 nodes and more on a
# loaded broker) and the damped variant finished every run. The class attributes
# `FgmeNode.damped` / `yield_once` below stay the transcription: the checkers and `fog-agent
# simulate gme` (the thesis's message counts) start from the published algorithm and turn the
# deviations on explicitly.
DAMPING_DEFAULT = True


@register_message
@dataclass(frozen=True)
class Req(GmeMessage):
    """Req(n_i, LC_i): n_i asks its competitors for the CS with priority <LC_i, n_i>."""

    kind: ClassVar[str] = "req"
    clock: int
    epoch: int = 0


@register_message
@dataclass(frozen=True)
class Ack(GmeMessage):
    """Ack(n_i, renew, end). renew: n_i authorizes a posteriori but still wants the CS itself;
    end: n_i acknowledges because it leaves the CS."""

    kind: ClassVar[str] = "ack"
    renew: bool = False
    end: bool = False
    epoch: int = 0


@register_message
@dataclass(frozen=True)
class End(GmeMessage):
    """End(n_i, LC_i): n_i left the CS or withdrew its request, towards nodes it owes no Ack."""

    kind: ClassVar[str] = "end"
    clock: int


# Deliberate bugs, for tests that prove the checker can fail. Never used outside tests.
FAULTS = frozenset({"skip_acks_to_ign", "undo_deviation_3"})


class FgmeNode(GmeNode):
    """One 2-FGME node. Competitors are all nodes of the other group(s)."""

    algorithm: ClassVar[str] = "2fgme"
    # DEVIATIONS 4 and 5 are off in the class (`node.damped` / `node.yield_once`): the core is the
    # transcription, the variant the exhaustive 2+2 x 2 search proved (docs/gme.md), and what the
    # checkers and the simulator start from. Where users run the lock, DAMPING_DEFAULT (above)
    # turns them on: `fog-agent bench gme` both, lock-guarded scaling's `fgme_damping` DEVIATION 4
    # only (DEVIATION 5 costs lock messages there: docs/gme.md, "Damping in lock-guarded scaling").
    damped: ClassVar[bool] = False
    yield_once: ClassVar[bool] = False

    def __init__(
        self, node_id: NodeId, groups: Mapping[NodeId, Group], fault: Optional[str] = None
    ) -> None:
        super().__init__(node_id, groups)
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; expected one of {sorted(FAULTS)}")
        self.fault = fault
        self.competitors: FrozenSet[NodeId] = frozenset(
            n for n, g in groups.items() if g != self.group
        )
        self._sorted_competitors: Tuple[NodeId, ...] = tuple(sorted(self.competitors))
        # INITIALISATION (lines 1-7)
        self.req_clock: float = INF  # req_id = <n_i, req_clock>
        self.lc: int = 0
        self.waiting_reqs: Dict[NodeId, int] = {}  # node -> epoch of its waiting Req
        self.reqs_to_send: Set[NodeId] = set()
        self.acks_to_ign: Dict[NodeId, int] = {}  # node -> last withdrawn epoch (see DEVIATION)
        self.epoch: int = 0  # epoch of the last Req this node sent
        self.sent_epoch: Dict[NodeId, int] = {}  # node -> epoch of the last Req sent to it
        self.req_first_epoch: int = 1  # acks answering older epochs belong to older requests
        self.competitors_authorized: bool = False
        # DEVIATION 4: written and read only when damped (published: stays empty, so persisted
        # lock states, agent/protocol/guarded.py, need not carry it)
        self.authorized_for: FrozenSet[NodeId] = frozenset()
        # DEVIATION 5: this request already ran lines 22-31 (written always, read only with yield_once)
        self.yielded: bool = False
        self.acks_rcvd: Set[NodeId] = set()

    # -- priority ---------------------------------------------------------------------------------

    def _lower_priority_than(self, other: NodeId, other_clock: int) -> bool:
        """req_id > <n_i', LC_i'>: our request (or our absence of request) yields to theirs."""
        return (self.req_clock, self.id) > (other_clock, other)

    # -- REQUEST critical section (lines 8-17) ----------------------------------------------------

    def _on_request(self) -> List[Output]:
        out: List[Output] = []
        self.lc += 1  # line 10
        self.req_clock = self.lc
        self.req_first_epoch = self.epoch + 1  # acks of older epochs answer older requests
        self.yielded = False  # DEVIATION 5: a new request may yield once
        if not self.competitors_authorized:  # line 11
            out += self._multicast_req(self._sorted_competitors)  # line 12
        else:
            self.reqs_to_send = set(self.competitors)  # line 14
        self.acks_rcvd = set()  # line 16
        if not self.competitors:  # no competitor at all: nothing to wait for
            out += self._enter()
        return out

    # -- RECEIVE Req (lines 18-57) ----------------------------------------------------------------

    def _withdraw_from(self, k: NodeId) -> None:
        """Lines 32-37 / 45-50: our Req to k is on hold; its acknowledgement no longer counts."""
        self.reqs_to_send.add(k)  # line 32 / 45
        if self.fault == "undo_deviation_3":  # the pseudo-code's "else", as before the fix
            if k in self.acks_rcvd:
                self.acks_rcvd.discard(k)
            else:
                self.acks_to_ign[k] = self.sent_epoch.get(k, 0)
            return
        self.acks_rcvd.discard(k)  # lines 33-34 / 46-47
        if self.fault != "skip_acks_to_ign":
            # line 36 / 49, DEVIATION 3: applied even when k's Ack was already counted (the
            # pseudo-code's "else"). An Ack(end) from k is counted (line 62 clears the ignore
            # mark) right after line 63 resent our Req to k, so k's answer to that Req can be
            # in flight while its Ack(end) is counted; withdrawing then dropped only the counted
            # one and the in-flight Ack was later counted for a newer Req. Exhaustive search,
            # 2+2 nodes x 2 requests, 6.1 M states (docs/gme.md). With epochs the rule is exact:
            # every Ack answering a Req sent so far is void.
            self.acks_to_ign[k] = self.sent_epoch.get(k, 0)

    def _on_req(self, m: Req) -> List[Output]:
        out: List[Output] = []
        j = m.sender
        self.lc = max(self.lc, m.clock)  # line 19
        in_cs = self.state is GmeState.IN_CS
        if not in_cs and (self.req_clock, self.id) > (m.clock, j):  # line 20: req_id > <n_j, LC_j>
            out.append(Send(j, Ack(self.id, epoch=m.epoch)))  # line 21
            if self.req_clock != INF and j in self.acks_rcvd:
                # DEVIATION 2 (checker counterexample, docs/gme.md): j's earlier Ack(renew)
                # authorized our group, but j now requests with a higher priority, so that
                # authorization is over; keep counting it and both groups enter. Drop it and
                # resend our Req to j when the other group's authorization ends. (FIFO: an Ack j
                # sent before this Req has already arrived, so nothing is in flight to ignore.)
                self.acks_rcvd.discard(j)
                self.reqs_to_send.add(j)
            if not self.competitors_authorized and not self._yields_again():  # line 22
                self.competitors_authorized = True  # line 23
                if self.damped:
                    self.authorized_for = frozenset((j,))  # DEVIATION 4
                if self.req_clock != INF:  # line 24
                    self.yielded = True
                    end = End(self.id, self.lc)  # one immutable End shared by the multicast
                    for k in self._sorted_competitors:  # line 25
                        if k == j:
                            continue
                        if k in self.waiting_reqs:  # line 26
                            e = self.waiting_reqs.pop(k)  # line 27
                            out.append(Send(k, Ack(self.id, renew=True, epoch=e)))  # line 28
                        else:
                            out.append(Send(k, end))  # line 30
                        self._withdraw_from(k)  # lines 32-37
        else:
            if self.competitors_authorized and not in_cs:  # line 42
                if j not in self.reqs_to_send:  # line 43
                    out.append(Send(j, End(self.id, self.lc)))  # line 44
                    self._withdraw_from(j)  # lines 45-50
                out.append(Send(j, Ack(self.id, renew=True, epoch=m.epoch)))  # line 52
            else:
                self.waiting_reqs[j] = m.epoch  # line 54
        return out

    def _yields_again(self) -> bool:
        """DEVIATION 5: this request yielded once already (lines 24-31), so a higher-priority Req
        gets line 21's Ack only. Idle nodes (req_clock infinite) authorize as published: that
        sends nothing."""
        return self.yield_once and self.yielded and self.req_clock != INF

    # -- RECEIVE Ack (lines 58-76) ----------------------------------------------------------------

    def _on_ack(self, m: Ack) -> List[Output]:
        out: List[Output] = []
        j = m.sender
        if m.end or m.renew:  # line 59
            self.competitors_authorized = False  # line 60
            if m.end:  # line 61
                self.acks_to_ign.pop(j, None)  # line 62
                out += self._resume()  # lines 63-65
        stale = m.epoch < self.req_first_epoch or m.epoch <= self.acks_to_ign.get(j, -1)
        if stale or self.state is not GmeState.REQUESTING:  # line 68
            pass  # line 69: ignored (the threshold stays: later acks carry larger epochs)
        else:
            self.acks_rcvd.add(j)  # line 71
            if self.acks_rcvd == self.competitors:  # line 72
                out += self._enter()  # line 73
        return out

    # -- RECEIVE End (lines 77-86) ----------------------------------------------------------------

    def _on_end(self, m: End) -> List[Output]:
        self.lc = max(self.lc, m.clock)  # line 78
        if self.competitors_authorized and m.sender not in self.authorized_for and self.damped:
            # DEVIATION 4: not the end of the authorization we granted; only lines 80-82
            self.waiting_reqs.pop(m.sender, None)
            return []
        self.competitors_authorized = False  # line 79
        self.waiting_reqs.pop(m.sender, None)  # lines 80-82
        return self._resume()  # lines 83-85

    def _resume(self) -> List[Output]:
        """Lines 63-65 / 83-85: send the requests put on hold.

        Line 65 (drop reqs_to_send from acks_to_ign) is implied by the epochs: the resent Req
        has a new epoch, above the withdrawn one. A node that is not requesting any more has
        nothing to resend (the pseudo-code would send Req with req_id = <n_i, infinity>).
        """
        targets = sorted(self.reqs_to_send)
        self.reqs_to_send = set()
        if not targets or self.state is not GmeState.REQUESTING:
            return []
        return self._multicast_req(targets)

    # -- EXIT critical section (lines 87-98) ------------------------------------------------------

    def _on_exit(self) -> List[Output]:
        out: List[Output] = []
        self.req_clock = INF  # line 89
        if self.waiting_reqs:  # line 90
            self.competitors_authorized = True  # line 91
            if self.damped:
                self.authorized_for = frozenset(self.waiting_reqs)  # DEVIATION 4
            for k, e in sorted(self.waiting_reqs.items()):  # line 92
                out.append(Send(k, Ack(self.id, end=True, epoch=e)))
        end = End(self.id, self.lc)
        for k in self._sorted_competitors:  # lines 94-95
            if k not in self.waiting_reqs:
                out.append(Send(k, end))
        self.waiting_reqs = {}  # line 96
        self.acks_to_ign = {}  # line 97
        return out

    # -- plumbing ---------------------------------------------------------------------------------

    def _multicast_req(self, targets: Sequence[NodeId]) -> List[Output]:
        assert self.req_clock != INF
        self.epoch += 1
        for k in targets:
            self.sent_epoch[k] = self.epoch
        req = Req(self.id, int(self.req_clock), self.epoch)
        return [Send(k, req) for k in targets]

    def receive(self, message: GmeMessage) -> List[Output]:
        if message.sender not in self.competitors:
            raise RemoteProtocolError(
                f"2-FGME node {self.id} ({self.state.name}): message {message!r} from "
                f"{message.sender}, expected one of the competitors {sorted(self.competitors)}"
            )
        t = type(message)
        if t is Req:
            return self._on_req(message)  # type: ignore[arg-type]
        if t is Ack:
            return self._on_ack(message)  # type: ignore[arg-type]
        if t is End:
            return self._on_end(message)  # type: ignore[arg-type]
        raise RemoteProtocolError(f"2-FGME node {self.id}: unexpected message {message!r}")

    def renamed(self, perm: Mapping[NodeId, NodeId]) -> "FgmeNode":
        """A copy with node ids renamed by `perm` (symmetry reduction in the checker).

        Only meaningful for a permutation inside each group that keeps every group's ids on the
        same side of the other group's (then every priority comparison, which is always between
        competitors, keeps its outcome)."""
        new = copy.copy(self)
        new.id = perm[self.id]
        new.groups = {perm[k]: g for k, g in self.groups.items()}
        new.competitors = frozenset(perm[k] for k in self.competitors)
        new._sorted_competitors = tuple(sorted(new.competitors))
        new.waiting_reqs = {perm[k]: e for k, e in self.waiting_reqs.items()}
        new.reqs_to_send = {perm[k] for k in self.reqs_to_send}
        new.acks_to_ign = {perm[k]: e for k, e in self.acks_to_ign.items()}
        new.sent_epoch = {perm[k]: e for k, e in self.sent_epoch.items()}
        new.acks_rcvd = {perm[k] for k in self.acks_rcvd}
        new.authorized_for = frozenset(perm[k] for k in self.authorized_for)
        return new

    def _live_authorized_for(self) -> Optional[FrozenSet[NodeId]]:
        """authorized_for where it is read (damped and authorizing), else None: dead otherwise
        (keeps the published variant's classes)."""
        return self.authorized_for if self.competitors_authorized and self.damped else None

    def _live_yielded(self) -> Optional[bool]:
        """yielded (DEVIATION 5) where it is read: yield_once and requesting (reset by `request()`,
        read only at line 22 with a finite req_clock); None otherwise (keeps the published
        variant's states and classes)."""
        return self.yielded if self.yield_once and self.state is GmeState.REQUESTING else None

    def live_snapshot(self, requests_left: int) -> Tuple[object, ...]:
        """`snapshot()` without the variables no future step reads before writing them.

        Why: the exhaustive checker merges global states that differ only in dead variables
        (they send the same messages and enter at the same points under every schedule). Two
        nodes with equal live snapshots must react to every input with the same sends and with
        successors whose live snapshots are equal again; the checker verifies this on every
        transition it computes (`exhaustive_check`, dead-variable merging). By state:

        - IDLE, no request left: answers each Req with Ack(epoch of the Req) (line 20: req_clock
          is infinite, line 24 false), sends nothing on Ack or End (`_resume` needs REQUESTING),
          never requests or exits again. Nothing else is read.
        - IDLE with requests left: `request()` reads lc, epoch, competitors_authorized and
          reqs_to_send (kept, line 11: a Req sent to all does not clear it); it resets acks_rcvd
          and req_first_epoch = epoch + 1 makes every acks_to_ign / sent_epoch value (all <= epoch)
          irrelevant; waiting_reqs is empty (cleared at exit, filled only outside IDLE).
        - IN_CS: Reqs are queued (line 54), Acks ignored, `exit()` reads lc, waiting_reqs,
          competitors_authorized and sets req_clock, acks_to_ign; sent_epoch and
          req_first_epoch are overwritten before the next read (as in IDLE), acks_rcvd too.
        - REQUESTING: everything, except acks_to_ign / sent_epoch entries below req_first_epoch
          (an Ack answering such an epoch is stale by `m.epoch < req_first_epoch` already).
        - authorized_for (DEVIATION 4) is read only when damped and competitors_authorized is
          true, and written whenever the latter becomes true: dead otherwise.
        - yielded (DEVIATION 5) is read only with yield_once and requesting, and reset by every
          request: dead otherwise.
        `entries` only counts, for the checker's measure.
        """
        s = self.state
        auth_for = self._live_authorized_for()
        if s is GmeState.IDLE:
            if requests_left == 0:
                return (s.value,)
            return (s.value, self.lc, self.epoch, self.competitors_authorized, frozenset(self.reqs_to_send), auth_for)
        if s is GmeState.IN_CS:
            return (
                s.value, self.lc, self.epoch, tuple(sorted(self.waiting_reqs.items())),
                frozenset(self.reqs_to_send), self.competitors_authorized, auth_for,
            )
        first = self.req_first_epoch
        return (
            s.value,
            self.req_clock,
            self.lc,
            tuple(sorted(self.waiting_reqs.items())),
            frozenset(self.reqs_to_send),
            tuple(sorted((k, e) for k, e in self.acks_to_ign.items() if e >= first)),
            self.epoch,
            first,
            tuple(sorted((k, e) for k, e in self.sent_epoch.items() if e >= first)),
            self.competitors_authorized,
            auth_for,
            frozenset(self.acks_rcvd),
            self._live_yielded(),
        )

    def snapshot(self) -> Tuple[object, ...]:
        return (
            self.state.value,
            self.req_clock,
            self.lc,
            tuple(sorted(self.waiting_reqs.items())),
            frozenset(self.reqs_to_send),
            tuple(sorted(self.acks_to_ign.items())),
            self.epoch,
            self.req_first_epoch,
            tuple(sorted(self.sent_epoch.items())),
            self.competitors_authorized,
            self._live_authorized_for(),
            frozenset(self.acks_rcvd),
            self.entries,
            self._live_yielded(),
        )
