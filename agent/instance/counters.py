"""The counters an instance keeps and reports in its heartbeat, each with what it counts
(docs/runtime.md, "Instance"; docs/reliability.md for the recovery ones). The instance and its
parts increment them; the shell adds its transport's (paho_out, connected).

Rules of this file: data only.
"""

from __future__ import annotations

from typing import Dict

__all__ = ["new_counters"]


def new_counters() -> Dict[str, int]:
    """A new instance's counters, all at 0, in the order the heartbeat lists them."""
    return {
        "records_in": 0,
        "records_out": 0,
        "filtered": 0,
        "operator_errors": 0,
        "batches_in": 0,
        "batches_out": 0,
        "malformed": 0,
        "duplicate_envelopes": 0,
        "acks_sent": 0,
        "acks_in": 0,
        "protocol_in": 0,
        "protocol_out": 0,
        "protocol_errors": 0,
        "sends_to_non_successor": 0,
        "credit_stalls": 0,
        "publish_rejected": 0,
        "refused_senders": 0,  # envelopes from senders our tables do not know (incl. expired holds)
        "refused_epochs": 0,  # an epoch no real incarnation of the sender can have
        "refused_seqs": 0,  # a number (or an ack) far beyond what the sender can have sent
        "refused_nodes": 0,  # written by a node that does not host the sender (incl. expired holds)
        "held_dropped": 0,  # of those, refused because the hold buffer was full
        "held_released": 0,  # held until the protocol announced their sender, then admitted
        "handed_out": 0,  # data batches handed in memory to a chained successor (no broker)
        "handed_in": 0,  # data batches handed in memory by a chained predecessor
        "passed_batches": 0,  # forwarded whole, as the bytes that came (an unchanged operator)
        "foreign_inbox": 0,  # envelopes on our inbox of a node we no longer run on (dropped)
        "stale_acks": 0,  # acks for an earlier incarnation of ours
        "acks_ahead_of_data": 0,  # duplication_acks taken ahead of data queued before them
        "duplications_ahead_of_data": 0,  # a predecessor's duplication taken ahead of its data
        "eos_ahead_of_data": 0,  # a predecessor's Eos taken ahead of its data without the group's records
        "spool_stalls": 0,  # a sink held back by its full spool
        "spool_events": 0,  # spool events published
        "unrouted_dropped": 0,  # envelopes for a destination no binding names, dropped past UNROUTED_MAX
        # key-group hand-over messages (agent.instance.moves), counted apart from the paper's
        "handover_in": 0,
        "handover_out": 0,
        "handover_bytes_in": 0,
        "handover_bytes_out": 0,
        "handover_errors": 0,  # hand-over messages refused (malformed, impossible in the move's state, no keyed state here)
        "eos_before_replay": 0,  # an Eos ahead of its predecessor's replay marker, dropped (asked again)
        # recovery (docs/reliability.md): a new incarnation of ours, by cause
        "sessions_lost": 0,
        "gaps_recovered": 0,
        "replays_asked_again": 0,
        "replays_asked_at_start": 0,  # a restarted sender's first numbers missing (agent.dataplane.channel)
        "replay_markers": 0,  # sent, each ahead of a replay
        "dropped_before_replay": 0,  # data batches from a predecessor ahead of its replay marker
        "replayed_batches": 0,  # to a successor: a new incarnation of it, or silent (LINK_SILENCE)
        "silent_links_replayed": 0,  # of those, the replays to a silent successor
        "departed_rerouted": 0,  # records re-routed from a successor that left our table
        "resent_past_departed": 0,  # records sent again whose successor left: dropped (INVARIANT 8)
        "marks_sent": 0,  # watermarks sent alone (agent.dataplane.watermarks)
        "late_at_source": 0,  # source records older than its own watermark when polled
        "channels_untracked": 0,  # source records of a channel past [operator.watermark] max_channels
    }
