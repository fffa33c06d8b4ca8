"""Where a message from the bus goes, by its topic (agent.topics.parse): the decision of the daemon's
dispatch, pure (no I/O, no clock, no reference to the daemon).

The daemon parses the topic, asks `route` and hands the message to the part it names: the
requests of the rpc and peer topics (agent.node.requests), createNode()'s and the standby copies'
replies, the sync marker of this connection (agent.node.bus), or the handlers of the records and
probes (agent.node.inbound, one per kind, which ignore a kind they do not read).

The rules, and why:
- Requests, replies and probes are never retained: a retained one is a forgery or a leftover,
  and acting on it would repeat it at every reconnect (RETAINED: counted, logged, dropped).
- A request or reply on another node's topic is not ours (IGNORE).
- A peer request that arrives before the retained records of this connection waits for them
  (HOLD): a persistent session hands over what was queued for us at connect, before the
  retained records its checks read (the site manager's lease, the hosted records).
- A reply from ourselves on our replies topic is the sync marker (MARKER): the retained records
  of this connection are in.
"""

from __future__ import annotations

from typing import Optional

from agent import topics

IGNORE = "ignore"
RETAINED = "retained"  # a retained message on a topic that is never retained
REQUEST = "request"  # on our rpc topic (an admin's) or peer topic (another node's)
HOLD = "hold"  # a peer request before the retained records are in
REPLY = "reply"  # a reply to one of our calls, from the node the topic names
MARKER = "marker"  # our own sync marker
INBOUND = "inbound"  # a record or a probe

_REQUESTS = ("rpc", "peer")


def route(me: str, parsed: Optional[topics.Parsed], retain: bool, retained_in: bool) -> str:
    """Where a message on the topic `parsed` (None: not a topic of our cluster) goes on node `me`
    (module doc); `retain`: it came as a retained message; `retained_in`: the retained records of
    this connection are in."""
    if parsed is None:
        return IGNORE
    if retain and parsed.kind in topics.NOT_RETAINED:
        return RETAINED
    if parsed.kind in _REQUESTS + ("reply",) and parsed.node != me:
        return IGNORE
    if parsed.kind == "reply":
        return REPLY if parsed.sender != me else MARKER
    if parsed.kind in _REQUESTS:
        return HOLD if parsed.kind == "peer" and not retained_in else REQUEST
    return INBOUND


def sender(parsed: Optional[topics.Parsed]) -> Optional[str]:
    """Who wrote a message, as far as its topic says: the last level of a request, reply or probe,
    else the node the topic is about."""
    return (parsed.sender or parsed.node) if parsed is not None else None


__all__ = ["HOLD", "IGNORE", "INBOUND", "MARKER", "REPLY", "REQUEST", "RETAINED", "route", "sender"]
