"""What an instance reads from its inbox before the admission: the topic it subscribes to, whose
messages a topic carries, the decoding of the bytes, and the bad input counted and logged
(docs/security.md, "Who may read an inbox"; invariant 5: nothing dropped silently).

Rules of this file: `Intake` owns these fields and holds no reference to the instance; it is given
its identity, the decoding its operator needs, the stats counters and the log context at
construction, and per call the topic, the bytes and the time `now`. No I/O, no clock, no random.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Optional, Set

from agent import topics
from agent.dataplane.envelope import LAZY, Envelope, MalformedEnvelope, decode
from agent.dataplane.inbound import LogLimiter

__all__ = ["Intake", "records_decoding"]

log = logging.getLogger("agent.instance.worker")


def records_decoding(operator: Any, is_sink: bool, is_source: bool, keyed: bool, by_key: bool) -> Any:
    """How an instance's data batches are decoded (`Intake.records`): a sink that reads only
    record ids gets compact batches without their records rebuilt (False); so does a map that
    never reads its records (`identity`), as Rows it passes on (LAZY), unless it keeps keyed state
    or routes by key (both read the records); everything else gets its records rebuilt."""
    reads = getattr(operator, "reads_records", True) is not False
    if is_sink:
        return reads
    return LAZY if not reads and not is_source and not keyed and not by_key else True


class Intake:
    """`topic`: the inbox filter to subscribe to. Per-node inboxes (`per_node`): we read
    `inbox/<our node>/<us>/+`, and a message on our inbox at another node is a subscription our
    session kept from an earlier incarnation. `records`: how data batches are decoded (True:
    records rebuilt; False: a sink that reads only record ids; LAZY: a map that never reads its
    records gets them as Rows it passes on; agent.dataplane.envelope)."""

    def __init__(self, cluster: str, node: str, instance: str, per_node: bool, records: Any,
                 stats: Dict[str, int], ctx: Dict[str, Any]) -> None:
        self.topic = (topics.inbox_all_at(cluster, node, instance) if per_node
                      else topics.inbox_all(cluster, instance))
        self._root = f"{topics.base(cluster)}/inbox/" if per_node else None
        self.records = records
        self._stats = stats
        self._ctx = ctx
        self._malformed = LogLimiter()  # bounded: a flood of invented names costs nothing
        self._ignored: Set[str] = set()  # protocol senders logged (admitted ones only: bounded)

    def writer(self, topic: str) -> Optional[str]:
        """The node that wrote a message on our inbox topic `topic`; None for another topic."""
        return topics.inbox_writer(self.topic, topic)

    def foreign(self, topic: str) -> bool:
        """Is `topic` (not our inbox) our inbox on a node we no longer run on? A subscription our
        session kept from an earlier incarnation (a re-home, a hand-over). The role's ACL drops
        these at delivery; a broker without it delivers them. Dropped either way (counted); the
        predecessors replay what we have not acked to our new topic (they learn our node from
        the hosted records)."""
        if self._root is not None and topic.startswith(self._root):
            self._stats["foreign_inbox"] += 1
            return True
        return False

    def decode(self, payload: bytes, now: float) -> Optional[Envelope]:
        """The envelope in `payload`; None for bytes that are not one (counted, logged once per
        sender within the limiter's bounds, skipped)."""
        try:
            return decode(payload, self.records)
        except MalformedEnvelope as exc:
            self._stats["malformed"] += 1
            who = _guess_sender(payload)
            if self._malformed.allow(who, now):
                log.warning("malformed payload on inbox from %s skipped: %s", who, exc, extra=self._ctx)
            return None

    def protocol_ignored(self, sender: str) -> None:
        """A protocol message from `sender` to an instance without scaling: counted, logged once
        per sender."""
        self._stats["protocol_in"] += 1
        self._stats["protocol_errors"] += 1
        if sender not in self._ignored:
            self._ignored.add(sender)
            log.warning("protocol message from %s but scaling is off: ignored", sender, extra=self._ctx)


def _guess_sender(payload: bytes) -> str:
    try:
        msg = json.loads(payload)
        if isinstance(msg, list) and len(msg) > 1 and isinstance(msg[1], str):
            return msg[1][:64]
    except (ValueError, TypeError, RecursionError):
        pass
    return "<unknown>"
