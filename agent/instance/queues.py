"""An instance's input queues: per sender, the envelopes delivered in its order and not handled
yet, and the three protocol messages that may overtake the data queued ahead of them
(docs/runtime.md, "Instance").

Rules of this file: `SenderQueues` owns the queues and holds no reference to the instance; it is
given the stats counters at construction, and per call the scaling driver (read only: whether its
outputs are still being performed, its round, its state) and the function that handles a
protocol message taken ahead. No I/O, no clock, no random.

Each sender's queue is handled strictly in order (invariant 1), round-robin over senders
(`round_robin`, called by the instance's `_process`). Three exceptions, each only past DATA and
never past another protocol message: a `duplication_ack` while our duplication round waits
(`duplication_acks_ahead`), a predecessor's `duplication` (`duplications_ahead`), and a
predecessor's Eos of a key group none of the batches ahead holds (`eos_ahead`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, Optional, Set

from agent.dataplane.envelope import Envelope, Kind
from agent.protocol.scaling import FORWARDING

__all__ = ["SenderQueues"]


class SenderQueues:
    """`by_sender`: sender -> its envelopes not handled yet, in its order. `keyed`: our key groups
    move (an Eos behind data may overtake it)."""

    def __init__(self, stats: Dict[str, int], keyed: bool) -> None:
        self.by_sender: Dict[str, Deque[Envelope]] = {}
        self.dup_behind = False  # a predecessor's duplication queued behind its data (`duplications_ahead`)
        self.eos_behind = False  # a predecessor's Eos queued behind its data (`eos_ahead`)
        self._stats = stats
        self._keyed = keyed

    def put(self, e: Envelope) -> None:
        """`e`, the next of its sender in its order, waits for its turn."""
        q = self.by_sender.get(e.sender)
        if q is None:
            q = self.by_sender[e.sender] = deque()
        q.append(e)
        if len(q) > 1 and e.kind is Kind.PROTO and isinstance(e.body, dict):
            if e.body.get("type") == "duplication":
                self.dup_behind = True
            elif e.body.get("type") == "eos" and self._keyed:
                self.eos_behind = True

    def any(self) -> bool:
        """Does any envelope wait?"""
        return any(self.by_sender.values())

    def data_waiting(self) -> bool:
        """Does a data batch wait (queued protocol messages do not count)?"""
        return any(e.kind is Kind.DATA for q in self.by_sender.values() for e in q)

    def count(self) -> int:
        return sum(len(q) for q in self.by_sender.values())

    def round_robin(self, sc: Any, groups_in: Optional[Callable[[Any], Set[int]]], blocked: Callable[[], bool],
                    on_data: Callable[[Envelope], None], on_protocol: Callable[[Envelope], None]) -> None:
        """Handle the queued envelopes, round-robin over senders, each sender strictly in order but
        for the three exceptions, taken first: a data batch to `on_data` unless `blocked()` (back
        pressure, an idle copy), a protocol message to `on_protocol` unless the scaling driver
        `sc` is still performing earlier outputs (the order of effects). `groups_in`: the key
        groups of a batch's records, where our key groups move (`eos_ahead`)."""
        if sc is not None and sc.duplicating:
            self.duplication_acks_ahead(sc, on_protocol)
        if self.dup_behind:
            self.duplications_ahead(sc, on_protocol)
        if self.eos_behind:
            assert groups_in is not None
            self.eos_ahead(sc, groups_in, on_protocol)
        progress = True
        while progress:
            progress = False
            for sender in list(self.by_sender):
                q = self.by_sender[sender]
                if not q:
                    continue
                env = q[0]
                if env.kind is Kind.DATA:
                    if blocked():
                        continue
                    q.popleft()
                    on_data(env)
                    progress = True
                else:
                    if sc is not None and sc.blocked:
                        continue  # earlier outputs still running: keep the order of effects
                    q.popleft()
                    on_protocol(env)
                    progress = True

    def forget(self, sender: str) -> bool:
        """Drop `sender`'s empty queue; False (kept) if something of it still waits."""
        if self.by_sender.get(sender):
            return False
        self.by_sender.pop(sender, None)
        return True

    def duplication_acks_ahead(self, sc: Any, handle: Callable[[Envelope], None]) -> None:
        """While our duplication round waits for its acks, a predecessor's `duplication_ack`
        queued behind that predecessor's DATA batches is handled now instead of after them.

        Why: the creator of a copy is by definition overloaded, so its predecessors' data queue
        up to a credit window in front of their acks (with a Raspberry-Pi-like 4 ms per record
        and batches of 100: seconds), and the copy would get its Start only after the creator
        worked through all of it: most of decision -> first record (`bench rescale`).
        Why it is safe: handling a duplication ack changes none of our routing tables (our
        preds and succs stay as they are; the ack only completes the round and sends Start with
        the tables we already use), and the data batches it overtakes are still processed by us,
        in their order, right after. Only DATA is overtaken, never a protocol message (a
        neighbour's own round must be applied before our Start carries our tables), and never
        while our earlier outputs are still being performed. Deletion acks never move: invariant 1
        needs a deletion_ack handled after every batch its sender sent before it."""
        if not sc.blocked:
            self._ahead_of_data("duplication_ack", "acks_ahead_of_data", lambda: not sc.blocked and sc.duplicating,
                                handle)

    def _ahead_of_data(self, msg_type: str, stat: str, go_on: Callable[[], bool],
                       handle: Callable[[Envelope], None]) -> bool:
        """In each sender's queue that starts with DATA, the first envelope that is not DATA is
        handled now if it is a protocol message of `msg_type` (and stays otherwise: it decides
        for what follows it). Stops when `go_on()` turns false after one: False then."""
        for q in list(self.by_sender.values()):
            if len(q) < 2 or q[0].kind is not Kind.DATA:
                continue
            for i, env in enumerate(q):
                if env.kind is Kind.DATA:
                    continue
                if env.kind is Kind.PROTO and isinstance(env.body, dict) and env.body.get("type") == msg_type:
                    del q[i]
                    self._stats[stat] += 1
                    handle(env)
                break  # the first non-data envelope decides
            if not go_on():
                return False
        return True

    def duplications_ahead(self, sc: Any, handle: Callable[[Envelope], None]) -> None:
        """A predecessor's `duplication` (it announces a copy of itself) queued behind that
        predecessor's DATA batches is handled now instead of after them: the mirror of
        `duplication_acks_ahead`, on the successor's side of the same round.

        Why: the creator's round waits for every neighbour's ack, and a successor that is itself
        loaded (the demo's keyed `route_counts` behind `in_zone`, 4 ms per record) has up to a
        credit window of the creator's data in front of the duplication: `in_zone`'s round took
        3.7-4.7 s of the demo's 4.8 s decision -> first record outliers (docs/measurement.md,
        "decision -> first record in the demo"). Why it is safe: the duplication only adds the
        copy to our predecessors (the core acks it; no successor of ours changes, no record of
        the creator is moved or dropped), and a copy sends nothing before its Start, which needs
        our ack: the creator could as well have sent the duplication before those batches. The
        overtaken batches are processed right after, in their order. Only DATA is overtaken,
        never a protocol message (a creator's Eos or Deletion keeps its place: invariant 1), only
        while we forward (the core updates its tables then) and never while our earlier outputs
        are being performed."""
        if sc is None or sc.core.state not in FORWARDING:
            self.dup_behind = False
            return
        if sc.blocked:
            return  # asked again next turn
        self.dup_behind = not self._ahead_of_data(
            "duplication", "duplications_ahead_of_data",
            lambda: not sc.blocked and sc.core.state in FORWARDING, handle)  # stopped: the other queues next turn

    def eos_ahead(self, sc: Any, groups_in: Callable[[Any], Set[int]], handle: Callable[[Envelope], None]) -> None:
        """A predecessor's Eos of group g queued behind that predecessor's DATA batches, none of
        which holds a record of g, is handled now instead of after them (docs/operators.md, "Key
        groups that move").

        Why: we hand groups out because we are overloaded, so each predecessor's batches queue
        here up to its credit window, and every Eos waited for all of them, every predecessor's
        queue drained round-robin at our service time: 0.9-2.6 s of a keyed copy's hand-over in
        the demo (docs/measurement.md, "decision -> first record in the demo"). Why it is safe:
        the Eos says the predecessor sends no more of g to us; every record of g it sent before
        is either applied here already or in a batch ahead of the Eos, and we only move the Eos
        when no batch ahead carries one, so g's state is final here exactly as if the batches
        had been processed (they hold only other groups, still ours or still moving, processed
        right after in their order). An Eos overtakes DATA and other Eos only (each concerns its
        own group), never another protocol message (invariant 1), never while our earlier
        outputs are being performed."""
        if sc is not None and sc.blocked:
            return  # asked again next turn
        self.eos_behind = False
        for q in list(self.by_sender.values()):
            if len(q) < 2 or q[0].kind is not Kind.DATA:
                continue
            ahead: Set[int] = set()  # groups of the records in the batches ahead
            i = 0
            while i < len(q):
                env = q[i]
                if env.kind is Kind.DATA:
                    ahead |= groups_in(env.body)
                    i += 1
                    continue
                body = env.body
                if env.kind is not Kind.PROTO or not isinstance(body, dict) or body.get("type") != "eos":
                    break  # any other protocol message keeps its place, and what follows it
                g = body.get("g")
                if type(g) is int and g not in ahead:  # a malformed one keeps its place (decoded there)
                    del q[i]
                    self._stats["eos_ahead_of_data"] += 1
                    handle(env)
                    if sc is not None and sc.blocked:
                        self.eos_behind = True
                        return
                    continue
                i += 1
