"""What an instance sends: its outputs and the links to its successors (docs/runtime.md, "Instance").

Rules of this file: the part owns its state (the links' credit windows and replay buffers, the
numbering of our channels, publishes issued and not yet answered, the client's refusals to retry,
envelopes waiting for a binding, the floors passed on, the route memory, the acks due upstream)
and holds no reference to the instance. Every call that sends returns its commands
(agent.instance.commands), in the order they must be performed; the instance appends them to its
own. The data-plane objects it shares with the instance (the router, the outbox, the ack tracker,
the hosts table) and the stats counters are handed over at construction. No I/O, no clock.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, Dict, FrozenSet, List, Optional, Tuple

from agent import topics
from agent.dataplane.channel import Outbound
from agent.dataplane.envelope import MAX_FLOORS, Envelope, Item, Kind, built, decode, encode, encode_data, materialized
from agent.dataplane.flow import AckTracker, OutLink
from agent.dataplane.routing import Outbox, Router
from agent.dataplane.sticky import RouteMemory
from agent.dataplane.watermarks import Mark
from agent.instance.commands import Command, Handoff, Publish, SaveRoutes
from agent.instance.hosts import Hosts

__all__ = ["Outputs", "RAW_TOPIC", "ACK_DELAY", "LINK_SILENCE", "LINK_SILENCE_MAX", "FLOORS_KEPT",
           "UNROUTED_MAX", "MARK_PERIOD", "MARK_PERIOD_UNLINKED"]

log = logging.getLogger("agent.instance.worker")

ACK_DELAY = 0.005  # coalesce upstream acks for at most this long
# Batches to a successor unacked this long, with no ack from it meanwhile: send them again under
# their own numbers (what it lost sits at the end of its channel, so it sees no hole). A successor
# that only was slow (an overloaded chain delays acks for seconds) drops the copies in its channel.
LINK_SILENCE = 5.0
LINK_SILENCE_MAX = 600.0  # the wait doubles after each replay that brought no ack (a dead node's
# instance, re-homing off: its session would otherwise fill with a window of copies every 5 s)
FLOORS_KEPT = 4096  # sources whose floor claims an instance keeps and forwards (agent.instance.applied)
# Marks a destination that is an MQTT topic of the operator's own (a sink's publications), not an
# instance: instance ids never contain "\0" (topics._check), so the two cannot be confused.
RAW_TOPIC = "\0"
# Envelopes kept per destination our binding table does not name yet (per-node inboxes,
# `_publish_tracked`): a window of data plus acks and protocol messages, many times over.
UNROUTED_MAX = 1024
# A successor that got no batch carrying our current watermark for this long gets it alone, in an
# empty data batch (agent.dataplane.watermarks): one whose key groups get no records still moves on.
MARK_PERIOD = 0.2
# ... and one we never sent data (a new copy, idle until its Start, holds what it gets: a few
# marks only in its hold buffer, HOLD_TTL / MARK_PERIOD_UNLINKED of them) this often.
MARK_PERIOD_UNLINKED = 5.0

# The seeded faults of the outputs (the checker's `route_past_departed`, `replay_to_departed`)
# are subclasses it installs (foglab.sim.instance_faults): no branch here.

# (destination, payload, lowest input index it carries or None)
Pending = Tuple[str, bytes, Optional[int]]


class Outputs:
    """The sending side of one instance `me`: batches out of the outbox onto numbered channels
    with credit and a replay buffer per successor, acks upstream, and every publish tracked
    until the broker PUBACKs it. `local`: co-hosted instances (a chain), handed envelopes in
    memory; `local_keeps`: those of them that never change a record in place (set by the chain)."""

    # A record sent before whose successor has left our table goes nowhere (`forward`): that
    # successor drained it (INVARIANT 4), and another instance would take it twice (INVARIANT 8).
    # False only in the checker's seeded fault `route_past_departed` (foglab.sim.instance_faults),
    # which routes it afresh.
    drops_sent_to_departed = True
    # A successor we have removed that comes back as a new incarnation gets no replay: it is
    # departing and would drop it; its unacked batches go to the current successors
    # (`successor_restarted`; CHANGELOG.md, "A copy that became a new incarnation in its own
    # deletion stranded its inputs"). False only in the checker's seeded fault
    # `replay_to_departed` (foglab.sim.instance_faults).
    reroutes_departed_replays = True

    def __init__(self, me: str, cluster: str, node: str, router: Router, outbox: Outbox, tracker: AckTracker,
                 hosts: Hosts, stats: Dict[str, int], ctx: Dict[str, Any], *, window: int, ack_every: int,
                 per_node: bool, local: FrozenSet[str], sticky: bool) -> None:
        self.me, self.cluster, self.node = me, cluster, node
        self.router, self.outbox, self.tracker, self.hosts = router, outbox, tracker, hosts
        self.stats, self.ctx = stats, ctx
        self.window = window
        self.per_node = per_node
        self.local = local
        self.local_keeps: FrozenSet[str] = frozenset()
        self.local_ids_only: FrozenSet[str] = frozenset()  # those that read no records (set by the chain)
        self.outbound = Outbound(0)  # our channels' numbers, under our current epoch
        self.links: Dict[str, OutLink] = {}
        # INVARIANT 8 (a record sent again goes where it went): a forwarding instance remembers
        # each record's successor where the next operator's instance count can change
        # (agent.dataplane.sticky.needed).
        self.sticky = sticky
        self.routes = RouteMemory()
        # Per-node inboxes: what we send a receiver our binding table does not name yet waits here.
        self.unrouted: Dict[str, Deque[Tuple[bytes, Optional[int]]]] = {}
        # Receivers whose binding moved to another node, and when (`on_hosts`): what we sent
        # them before went to the old node's topic, where the broker drops it (`resend_moved`).
        self.moved: Dict[str, float] = {}
        self.pending_pub: Dict[int, int] = {}  # mid -> lowest process index it carries
        # token -> (destination, payload, lowest index, retried): issued, not yet answered by the shell
        self._unconfirmed: Dict[int, Tuple[str, bytes, Optional[int], bool]] = {}
        self._token = 0
        self.retry: Deque[Pending] = deque()
        # Source -> the largest floor claimed for it in our input (agent.instance.applied): passed
        # on with the records of that source; a source claims its own.
        self._floors: Dict[str, int] = {}
        self.marks_sent: Dict[str, Tuple[Mark, float]] = {}  # successor -> (last mark sent it, when)
        # Acks go out every `ack_every` batches (half the predecessors' window) or after ACK_DELAY.
        self.ack_every = ack_every
        self.ack_due: Dict[str, Tuple[int, int]] = {}  # sender -> (its epoch, data seq)
        self.ack_since: Optional[float] = None
        self._unacked_batches = 0

    @property
    def epoch(self) -> int:
        return self.outbound.epoch

    def renumber(self, epoch: int) -> None:
        """A new incarnation of ours: every channel numbers from 1 again, in `epoch`."""
        self.outbound = Outbound(epoch)

    def restore_routes(self, saved: Tuple[Any, Any], now: float) -> None:
        """A restart: where each record went, as our dead incarnation saved it (INVARIANT 8); an
        unusable memory leaves the records replayed to us to be routed afresh."""
        if not self.sticky:
            return
        try:
            self.routes = RouteMemory.load(saved[0], saved[1], now)
        except ValueError as exc:
            log.warning("%s: records replayed to us are routed afresh", exc, extra=self.ctx)

    # ---- routing and batching --------------------------------------------------------------------

    def set_routes(self, succs: Tuple[str, ...], now: float) -> None:
        """Our successors are now `succs`: what the outbox still holds is routed over them."""
        old = set(self.router.succs)
        self.router.set_succs(succs)
        moved = self.outbox.reroute(now)
        log.info(
            "routes: succs %s -> %s (%d buffered records re-routed)", sorted(old), sorted(succs), moved, extra=self.ctx
        )

    def credit(self, dest: str) -> int:
        link = self.links.get(dest)
        return self.window if link is None else link.credit

    def forward(self, items: List[Item], index: int, now: float) -> None:
        """Buffer the outputs of input `index`: a record sent before goes to the same successor
        again while it is in our table, nowhere once that successor left (INVARIANT 8,
        agent.dataplane.sticky), the rest as routed."""
        if self.sticky:
            items, pinned, gone = self.routes.split(items, self.router.succs)
            for dest, recs in pinned.items():
                self.outbox.add_to(dest, recs, index, now)
            if gone and not self.drops_sent_to_departed:
                items = items + gone
            elif gone:
                # Their successor left after draining them (INVARIANT 4): they are further
                # down already, and another instance would take them twice (INVARIANT 8).
                self.stats["resent_past_departed"] += len(gone)
        self.outbox.add(items, index, now)

    def flush(self, now: float, force: bool, own: Optional[Dict[str, int]], mark: Optional[Mark]) -> List[Command]:
        """The batches the outbox lets go now (all of them with `force`), each numbered, kept in
        its link's replay buffer and published. `own`: a source's own floor (taken before the
        batches leave the outbox); `mark`: the watermark every batch carries."""
        out: List[Command] = []
        batches = self.outbox.take(now, self.credit, force=force)
        if not batches and self.outbox.pending >= self.outbox.batch_size:
            self.stats["credit_stalls"] += 1
        if batches and self.sticky:
            # Write-ahead (INVARIANT 8): where these records go is on disk before they go, so a
            # crash cannot lose the destination of a record its predecessors will replay.
            for dest, items, _ in batches:
                self.routes.sent(dest, items, self.tracker.last_index)
            out.append(SaveRoutes(*self.routes.take_save(now)))
        for dest, items, low in batches:
            if dest not in self.router.succs:
                # Cannot happen (the outbox routes over the current table); counted if it does.
                self.stats["sends_to_non_successor"] += 1
                log.error("BUG: batch routed to %s which is not a successor", dest, extra=self.ctx)
            link = self.links.get(dest)
            if link is None:
                link = self.links[dest] = OutLink(dest, self.window)
            seq = self.outbound.take(dest)
            floors = own or self._floors_for(items)
            if mark is not None:
                self.marks_sent[dest] = (mark, now)
            if dest in self.local:  # chained: no encoding, no broker (docs/runtime.md, "Chaining")
                env = built(self.me, self.epoch, seq, Kind.DATA, items, floors, mark)
                link.sent(seq, env, len(items), now, low)  # replay buffer: kept until dest acks
                self._hand(out, dest, env)
            else:
                payload = encode_data(self.me, self.epoch, seq, items, floors, mark)
                link.sent(seq, payload, len(items), now, low)  # replay buffer: kept until dest acks
                self._publish_tracked(out, dest, payload, low)
            self.stats["batches_out"] += 1
            self.stats["records_out"] += len(items)
        return out

    def note_floors(self, floors: Dict[str, int]) -> None:
        """Keep the largest floor claimed per source (a claim stays true once made, so the order
        claims arrive in does not matter: agent.instance.applied)."""
        kept = self._floors
        for src, f in floors.items():
            old = kept.get(src)
            if old is None:
                if len(kept) >= FLOORS_KEPT:
                    continue  # only costs the keyed operator a longer list of ranges
                kept[src] = f
            elif f > old:
                kept[src] = f

    def _floors_for(self, items: List[Item]) -> Optional[Dict[str, int]]:
        """The floors a data batch carries: the ones we received for its records' sources (a
        source's own, the first number it has not seen acked end to end, is taken in `flush`)."""
        kept = self._floors
        if not kept:
            return None
        out: Dict[str, int] = {}
        for src in {it[0] for it in items}:
            f = kept.get(src)
            if f is not None:
                out[src] = f
                if len(out) >= MAX_FLOORS:
                    break
        return out or None

    # ---- publishing ------------------------------------------------------------------------------

    def publish_retries(self) -> List[Command]:
        """Publishes the client refused, in order, before anything newer (`_publish_tracked`).
        Every step, not only when there is data to flush: a sink or a departing copy has none,
        and an ack left here held back every later ack of a sink for good (docs/reliability.md)."""
        out: List[Command] = []
        while self.retry:
            dest, payload, low = self.retry.popleft()
            self._issue(out, dest, payload, low, True)
        return out

    def publish(self, dest: str, payload: bytes, low: Optional[int]) -> List[Command]:
        """`_publish_tracked` for the instance (a sink's own publications: `RAW_TOPIC + topic`)."""
        out: List[Command] = []
        self._publish_tracked(out, dest, payload, low)
        return out

    def _publish_tracked(self, out: List[Command], dest: str, payload: bytes, low: Optional[int]) -> None:
        """Publish to `dest`'s inbox after whatever the client refused earlier (order). With
        `low`, the inputs from that index on stay unacked upstream until the broker PUBACKs (data
        we forward); None for our own acks and protocol messages, which carry no input.

        Per-node inboxes: a destination our binding table does not name yet (a new copy whose
        node's hosted record has not reached our agent; anything before our first table) waits in
        `unrouted`, in order, until a "hosts" line names it (`on_hosts`)."""
        if self.per_node and not dest.startswith(RAW_TOPIC) and (dest in self.unrouted or dest not in self.hosts.bound):
            self._park(dest, payload, low)
        elif self.retry:
            self.retry.append((dest, payload, low))
        else:
            self._issue(out, dest, payload, low, False)

    def _park(self, dest: str, payload: bytes, low: Optional[int]) -> None:
        q = self.unrouted.get(dest)
        if q is None:
            q = self.unrouted[dest] = deque()
        if len(q) >= UNROUTED_MAX:
            # A destination no record ever lists (it died before its node published it): the
            # oldest goes; what it carried is still in our replay buffer (data) or resent by the
            # round on silence (protocol), should the destination appear after all.
            q.popleft()
            self.stats["unrouted_dropped"] += 1
        q.append((payload, low))

    def _topic(self, dest: str) -> str:
        if dest.startswith(RAW_TOPIC):
            return dest[1:]  # a sink operator's own publication (mqtt_sink), not an inbox
        if self.per_node:
            return topics.inbox_at(self.cluster, self.hosts.bound[dest], dest, self.node)
        return topics.inbox(self.cluster, dest, self.node)

    def _issue(self, out: List[Command], dest: str, payload: bytes, low: Optional[int], retried: bool) -> None:
        if self.per_node and not dest.startswith(RAW_TOPIC) and dest not in self.hosts.bound:
            self._park(dest, payload, low)  # a retry whose binding a newer table no longer has
            return
        self._token += 1
        self._unconfirmed[self._token] = (dest, payload, low, retried)
        out.append(Publish(self._topic(dest), payload, self._token))

    def on_accepted(self, token: int, mid: int) -> None:
        item = self._unconfirmed.pop(token, None)
        if item is not None and item[2] is not None:
            self.pending_pub[mid] = item[2]

    def on_refused(self, token: int, reason: str) -> None:
        item = self._unconfirmed.pop(token, None)
        if item is None:
            return
        if not item[3]:
            self.stats["publish_rejected"] += 1
            log.warning("%s; will retry", reason or "publish refused", extra=self.ctx)
        # Refusals come in token order and every later publish of the same list is refused too
        # (commands.py), so appending keeps the channel order.
        self.retry.append(item[:3])

    def on_puback(self, mid: int) -> None:
        self.pending_pub.pop(mid, None)

    def on_hosts(self, before: Dict[str, str], now: float) -> List[Command]:
        """The hosts table changed from `before`: receivers that moved get what we sent them again
        (`resend_moved`, at the next Tick), and what waited for a binding now named goes out."""
        out: List[Command] = []
        for dest in self.links:
            was, now_at = before.get(dest), self.hosts.bound.get(dest)
            if was is not None and now_at is not None and was != now_at:
                self.moved[dest] = now
        for dest in [d for d in self.unrouted if d in self.hosts.bound]:
            parked = self.unrouted.pop(dest)
            for payload, low in parked:
                self._publish_tracked(out, dest, payload, low)
        return out

    # ---- envelopes on the numbered channels ------------------------------------------------------

    def send_envelope(self, dest: str, kind: Kind, body: Any) -> List[Command]:
        """Acks and protocol messages: numbered on the same channel as the data (invariant 1)."""
        out: List[Command] = []
        if dest in self.local:
            self._hand(out, dest, built(self.me, self.epoch, self.outbound.take(dest), kind, body))
        else:
            env = Envelope(self.me, self.epoch, self.outbound.take(dest), kind, body)
            self._publish_tracked(out, dest, encode(env), None)
        return out

    def _hand(self, out: List[Command], dest: str, env: Envelope) -> None:
        """An envelope to a co-hosted instance (docs/runtime.md, "Chaining"). Its channel is
        numbered like any other (INVARIANT 1 holds as is), and a data batch stays in our replay
        buffer until `dest` acks it (flow control, acks and replay as over MQTT). Nothing is
        tracked as a publish: the hand-off cannot be refused, and what the broker's PUBACK
        guards (a message in flight that a crash could lose) does not exist in one process, which
        dies as a whole. The records of a data batch are handed as shallow copies: our replay
        buffer keeps the originals, so a successor that changes a record in place cannot change
        what a replay sends (about 10 us per 100 taxi records; 13% of a chain of 3's CPU, sampled).
        A successor in `local_keeps` promised never to change a record in place: no copy. Records
        we took without rebuilding them (`Row`s: our operator reads none) are rebuilt for a
        successor that reads records, and handed as they are to one in `local_ids_only`."""
        if env.kind is Kind.DATA:
            if dest not in self.local_ids_only:
                items = materialized(env.body)
                if items is not env.body:
                    env = built(env.sender, env.epoch, env.seq, Kind.DATA, items, env.floors, env.watermark)
            if dest not in self.local_keeps:
                env = built(env.sender, env.epoch, env.seq, Kind.DATA,
                            [(s, q, dict(r)) if type(r) is dict else (s, q, r) for s, q, r in env.body], env.floors,
                            env.watermark)
            self.stats["handed_out"] += 1
        out.append(Handoff(dest, env))

    def _send_replay_marker(self, out: List[Command], dest: str) -> None:
        """An empty data batch on the channel to `dest`: what we send after it is our replay and
        newer data (see agent.instance.replays). Outside the replay buffer and the credit
        window; the receiver never processes nor acks it (cumulative acks cover its number)."""
        seq = self.outbound.take(dest)
        if dest in self.local:  # chained: on the same in-memory channel as the replay after it
            self._hand(out, dest, Envelope(self.me, self.epoch, seq, Kind.DATA, []))
        else:
            self._publish_tracked(out, dest, encode_data(self.me, self.epoch, seq, []), None)
        self.stats["replay_markers"] += 1

    def send_mark(self, now: float, mark: Optional[Mark]) -> List[Command]:
        """`mark` alone to every successor that has not had it for MARK_PERIOD: outside the
        replay buffer and the credit window (the next one carries it again), never acked."""
        out: List[Command] = []
        if mark is None:
            return out
        for dest in self.router.succs:
            last = self.marks_sent.get(dest)
            period = MARK_PERIOD if dest in self.links else MARK_PERIOD_UNLINKED
            if last is not None and (last[0] == mark or now - last[1] < period):
                continue
            seq = self.outbound.take(dest)
            if dest in self.local:
                self._hand(out, dest, built(self.me, self.epoch, seq, Kind.DATA, [], None, mark))
            else:
                self._publish_tracked(out, dest, encode_data(self.me, self.epoch, seq, [], None, mark), None)
            self.marks_sent[dest] = (mark, now)
            self.stats["marks_sent"] += 1
        return out

    # ---- replays ---------------------------------------------------------------------------------

    def successor_restarted(self, dest: str, now: float) -> List[Command]:
        """`dest`, a successor, is a new incarnation: it may have lost what it held. The marker
        first (it drops what we sent before it: all of that is in the replay), then the replay,
        in order; to a successor we have removed, no replay: its unacked batches go to the current
        successors (CHANGELOG.md, "A copy that became a new incarnation in its own deletion
        stranded its inputs")."""
        out: List[Command] = []
        self._send_replay_marker(out, dest)
        self.marks_sent.pop(dest, None)  # it lost the marks it had from us: sent again
        if dest in self.links:
            if dest in self.router.succs or not self.reroutes_departed_replays:
                self._replay_to(out, dest, now)
            else:
                self._reroute_departed(out, dest, now)
        return out

    def _reroute_departed(self, out: List[Command], dest: str, now: float) -> None:
        """A successor we have removed (its deletion round) came back as a new incarnation while
        it still had batches of ours unacked: it is departing, its successors have removed it
        too (they refuse its data), so replayed to it they were stranded for good and replayed
        every few seconds (CHANGELOG.md, "A copy that became a new incarnation in its own
        deletion stranded its inputs"). They go to our current successors instead, under their
        input index (nothing is acked upstream before they are acked again). Records the departed
        copy had already forwarded come twice: the sink drops them by id (INVARIANT 2). Keyless
        successors only: a keyed copy handed its state over with those records applied, so we
        replay to it as before (docs/reliability.md)."""
        link = self.links[dest]
        if self.router.key is not None or not self.router.succs:
            self._replay_to(out, dest, now)
            return
        batches = link.unacked()
        records = 0
        for u in reversed(batches):  # put_back prepends: the oldest ends first
            env = u.payload if isinstance(u.payload, Envelope) else decode(u.payload)
            self.outbox.put_back(list(env.body), u.low, now)
            records += len(env.body)
        del self.links[dest]
        self.stats["departed_rerouted"] += records
        log.warning("%s left our table and came back as a new incarnation: %d unacked batches (%d records) "
                    "re-routed to our successors", dest, len(batches), records, extra=self.ctx)

    def _replay_to(self, out: List[Command], dest: str, now: float, renumber: bool = True,
                   why: str = "silent link") -> None:
        """Send every batch `dest` has not acked again.

        renumber=True (a new epoch on either side): renumbered on the current channel. A worker
        restarted with the same identity has lost the batches it had taken from the broker but
        not yet forwarded; we still hold them (replay buffer). Records it had already forwarded
        come twice: the sink drops duplicate record ids, but only when the copy reaches the same
        sink instance.

        renumber=False (a silent link, same incarnations): each batch goes again under its first
        number and epoch, so the receiver's channel drops the ones it already has (a slow
        successor, the usual reason for the silence) and delivers only the ones really lost.
        Renumbered, a slow successor processed them twice and, round-robin over several sink
        instances, the second copy reached another sink, which cannot drop it
        (CHANGELOG.md, "Duplicates across sink instances under plain overload")."""
        link = self.links[dest]
        old = link.unacked()
        if not old:
            return
        moves: Dict[int, Tuple[int, Any]] = {}  # renumbered all at once (OutLink.renumber)
        for u in old:
            # A chained successor's batches are kept as the Envelope handed over, not as bytes.
            env = u.payload if isinstance(u.payload, Envelope) else decode(u.payload)
            if not renumber and env.epoch == self.epoch:
                link.resent(u.seq, now)
                if isinstance(u.payload, Envelope):
                    self._hand(out, dest, env)
                else:
                    self._publish_tracked(out, dest, u.payload, self.tracker.last_index + 1)
                continue
            items = env.body
            seq = self.outbound.take(dest)
            if isinstance(u.payload, Envelope):
                again = Envelope(self.me, self.epoch, seq, Kind.DATA, items, floors=env.floors,
                                 watermark=env.watermark)
                moves[u.seq] = (seq, again)
                self._hand(out, dest, again)
                continue
            payload = encode_data(self.me, self.epoch, seq, items, env.floors, env.watermark)
            moves[u.seq] = (seq, payload)
            self._publish_tracked(out, dest, payload, self.tracker.last_index + 1)
        link.renumber(moves, now)
        self.stats["replayed_batches"] += len(old)
        log.warning("replayed %d unacked batches to %s%s", len(old), dest,
                    "" if renumber else f" under their own numbers ({why})", extra=self.ctx)

    def replay_all(self, now: float) -> List[Command]:
        """We are a new incarnation: every successor gets what it had not acked, renumbered in our
        new epoch (its acks for the old epoch would be ignored)."""
        out: List[Command] = []
        for dest, link in list(self.links.items()):
            link.restart_numbering()
            self._replay_to(out, dest, now)
        return out

    def resend_moved(self, now: float) -> List[Command]:
        """A receiver moved to another node (a drain's hand-over, a re-home): every batch we sent
        it before our table said so went to its old node's topic, where the broker drops it (the
        new node may not read it). Sent again at once, under their own numbers, to the new node
        (the receiver's channel drops what it has), and the silent-link backoff starts over: left
        to `replay_silent`, the resend waited for a backoff that had doubled on every replay into
        the old topic while the receiver started (CHANGELOG.md, "A drain could stall a moved
        instance for a minute").
        Run after the release of held envelopes: a renumbered replay for the receiver's new epoch
        (`successor_restarted`) resends them already, and what it sent is newer than the move."""
        out: List[Command] = []
        moved, self.moved = self.moved, {}
        for dest, since in moved.items():
            link = self.links.get(dest)
            if link is None or dest in self.local:
                continue
            link.silent_replays = 0
            if any(u.sent_at < since for u in link.unacked()):
                self.stats["moved_resent"] = self.stats.get("moved_resent", 0) + 1
                self._replay_to(out, dest, now, renumber=False, why=f"moved to node {self.hosts.bound.get(dest)}")
        return out

    def replay_silent(self, now: float) -> List[Command]:
        """Batches a successor left unacked for LINK_SILENCE (doubling per fruitless replay, up to
        LINK_SILENCE_MAX) with no ack from it meanwhile: sent again under their own numbers."""
        out: List[Command] = []
        for dest, link in list(self.links.items()):
            wait = min(LINK_SILENCE * 2 ** link.silent_replays, LINK_SILENCE_MAX)
            if link.inflight and link.oldest_age(now) >= wait and now - link.last_ack_at >= wait:
                self.stats["silent_links_replayed"] += 1
                link.silent_replays += 1
                self._replay_to(out, dest, now, renumber=False)
        return out

    def on_ack(self, sender: str, upto: int, now: float) -> None:
        """A data ack in our epoch: credit back, the replay buffer trimmed."""
        link = self.links.get(sender)
        if link is not None:
            link.ack(upto, now)
            if link.inflight == 0 and sender not in self.router.succs:
                del self.links[sender]  # a departed successor acked everything we sent it

    # ---- acks upstream ---------------------------------------------------------------------------

    def lowest_forwarding(self, sink_head: Optional[int]) -> Optional[int]:
        """The lowest input index whose outputs are not all acked by the successors yet
        (`sink_head`: the first input a deferred sink has not recorded yet).

        An input is acked upstream only when every record derived from it has been processed
        and forwarded by the NEXT instance too (its data ack), not merely PUBACKed by the broker:
        paho PUBACKs a delivery on receipt, so a batch in the broker is not safe once its
        receiver has taken it. If the receiver and we both restart (a whole node restarting),
        only an upstream replay buffer (or the source's resume position) still holds it."""
        lows = [lo for lo in (link.lowest_input() for link in self.links.values()) if lo is not None]
        lo = self.outbox.lowest_index()
        if lo is not None:
            lows.append(lo)
        if self.pending_pub:
            lows.append(min(self.pending_pub.values()))
        lows += [u[2] for u in self._unconfirmed.values() if u[2] is not None]
        lows += [r[2] for r in self.retry if r[2] is not None]
        lows += [u[1] for q in self.unrouted.values() for u in q if u[1] is not None]
        if sink_head is not None:
            lows.append(sink_head)
        return min(lows) if lows else None

    def send_acks(self, now: float, low: Optional[int], stopping: bool) -> List[Command]:
        """Ack inputs processed AND forwarded (PUBACKed) or recorded, i.e. below `low` (the
        lowest input still pending); coalesced for ACK_DELAY."""
        out: List[Command] = []
        done = self.tracker.release(low)
        if self.sticky and not self.retry:  # an ack refused by the client is not on its way yet
            self.routes.released(self.tracker.last_index if low is None else low - 1, now)
        for sender, pos in done.items():
            if pos > self.ack_due.get(sender, (-1, 0)):
                self.ack_due[sender] = pos
        self._unacked_batches += self.tracker.last_released
        if not self.ack_due:
            return out
        if self.ack_since is None:
            self.ack_since = now
        # One ack per `ack_every` batches (half the predecessor's window) or after
        # ACK_DELAY: credit comes back in time while acks cost a fraction of a message per batch.
        if self._unacked_batches >= self.ack_every or now - self.ack_since >= ACK_DELAY or stopping:
            for sender, (epoch, seq) in sorted(self.ack_due.items()):
                out += self.send_envelope(sender, Kind.ACK, [epoch, seq])
                self.stats["acks_sent"] += 1
            self.ack_due.clear()
            self.ack_since = None
            self._unacked_batches = 0
        return out

    # ---- state -----------------------------------------------------------------------------------

    def settled(self) -> bool:
        """Nothing of ours in flight: every publish answered and PUBACKed, nothing waiting for a
        retry or a binding, every batch acked by its successor, no ack due upstream."""
        return (not self.pending_pub and not self._unconfirmed and not self.retry and not self.unrouted
                and all(link.inflight == 0 for link in self.links.values()) and not self.ack_due)

    def unpubacked(self) -> int:
        """Publishes not PUBACKed yet: issued, refused for a retry, or unanswered."""
        return len(self.pending_pub) + len(self.retry) + len(self._unconfirmed)
