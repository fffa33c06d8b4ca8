"""The MQTT topic space (docs/design.md section 5), in one place.

Everything an agent publishes is readable with `mosquitto_sub -v -t 'fog/#'`; fogctl and the
daemon build topics only through these functions so that the two never drift apart.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

ROOT = "fog"


def _check(part: str) -> str:
    if not part or any(c in part for c in "/+#\0"):
        raise ValueError(f"invalid topic segment {part!r}: must be non-empty without '/', '+', '#'")
    return part


def base(cluster: str) -> str:
    return f"{ROOT}/{_check(cluster)}"


def inbox(cluster: str, instance: str, writer: str) -> str:
    """Data batches AND protocol messages to one instance (one FIFO channel per sender), written
    by node `writer`, the node that hosts the sender instance: the shared format, every node may
    read it (`[mqtt] inbox_per_node = false`; `inbox_at` is the default). The ACL lets a node write only
    `inbox/+/<itself>`, so the receiver reads the writing node here and accepts an envelope only
    if that node hosts the instance the envelope claims as its sender (docs/security.md, "Data
    channels"). One topic per sender node keeps MQTT's order per publisher and topic."""
    return f"{base(cluster)}/inbox/{_check(instance)}/{_check(writer)}"


def inbox_all(cluster: str, instance: str) -> str:
    """The subscription of one instance to its inbox (shared format), whichever node writes."""
    return f"{base(cluster)}/inbox/{_check(instance)}/+"


def inbox_at(cluster: str, node: str, instance: str, writer: str) -> str:
    """The same, addressed to the node that hosts `instance` (per-node inboxes, the default:
    docs/security.md, "Who may read an inbox"). The role's ACL lets node n read only
    `inbox/n/#` and write only `inbox/+/+/n`, so only the receiver's node reads its records; the
    sender takes `node` from its binding table (agent.node.hostmap)."""
    return f"{base(cluster)}/inbox/{_check(node)}/{_check(instance)}/{_check(writer)}"


def inbox_all_at(cluster: str, node: str, instance: str) -> str:
    """The subscription of `instance` on `node` to its per-node inbox, whichever node writes."""
    return f"{base(cluster)}/inbox/{_check(node)}/{_check(instance)}/+"


def inbox_writer(inbox_filter: str, topic: str) -> Optional[str]:
    """The writing node of `topic` if it is a topic of the subscription `inbox_filter`
    (`inbox_all(...)`), else None. The worker's fast path (once per envelope); never raises."""
    prefix = inbox_filter[:-1]
    if not isinstance(topic, str) or not topic.startswith(prefix):
        return None
    writer = topic[len(prefix):]
    # A delivery of the subscription `.../+` has one level there, never a wildcard (MQTT forbids
    # them in topic names); checked anyway for topics that do not come from the broker.
    if not writer or "/" in writer or "+" in writer or "#" in writer:
        return None
    return writer


def agent_state(cluster: str, node: str) -> str:
    return f"{base(cluster)}/agents/{_check(node)}/state"


def agent_status(cluster: str, node: str) -> str:
    return f"{base(cluster)}/agents/{_check(node)}/status"


def agent_rpc(cluster: str, node: str, requester: str) -> str:
    """Control requests (ping, stop, set, scale, drain, undrain, spawn) from admin `requester` to
    `node` (docs/security.md: the ACL lets only `requester` write this topic, so the receiver
    reads the sender here, never from the payload)."""
    return f"{base(cluster)}/agents/{_check(node)}/rpc/{_check(requester)}"


def agent_rpc_inbox(cluster: str, node: str) -> str:
    """The subscription of `node` to the control requests of every admin."""
    return f"{base(cluster)}/agents/{_check(node)}/rpc/+"


def agent_peer(cluster: str, node: str, requester: str) -> str:
    """The protocol's node-to-node requests (spawn for createNode, a keeper's hand-over, a
    re-home) from node `requester` to `node`."""
    return f"{base(cluster)}/agents/{_check(node)}/peer/{_check(requester)}"


def agent_peer_inbox(cluster: str, node: str) -> str:
    return f"{base(cluster)}/agents/{_check(node)}/peer/+"


def latency(cluster: str, node: str) -> str:
    return f"{base(cluster)}/latency/{_check(node)}"


def latency_ping(cluster: str, target: str, sender: str) -> str:
    """A latency probe from `sender` to `target` (a self-ping has target == sender)."""
    return f"{base(cluster)}/latency/{_check(target)}/ping/{_check(sender)}"


def latency_pong(cluster: str, sender: str, target: str) -> str:
    """`target`'s answer to a ping of `sender`: under the sender's subtree, written by target."""
    return f"{base(cluster)}/latency/{_check(sender)}/pong/{_check(target)}"


def latency_pings(cluster: str, node: str) -> str:
    """The subscription of `node` to the pings of every sender."""
    return f"{base(cluster)}/latency/{_check(node)}/ping/+"


def latency_pongs(cluster: str, node: str) -> str:
    return f"{base(cluster)}/latency/{_check(node)}/pong/+"


def events(cluster: str) -> str:
    return f"{base(cluster)}/events"


def pipeline(cluster: str, name: str) -> str:
    return f"{base(cluster)}/pipelines/{_check(name)}"


def locks(cluster: str) -> str:
    return f"{base(cluster)}/locks"


def site_manager(cluster: str, node: str) -> str:
    """Node `node`'s retained site-manager claim (its lease while it leads): one record per node,
    on a topic only that node may write (the role's ACL), so the broker proves who wrote it and
    every reader derives the leader from the claims (docs/site-manager.md, "Election")."""
    return f"{base(cluster)}/agents/{_check(node)}/site_manager"


def all_site_managers(cluster: str) -> str:
    """The subscription to every node's site-manager claim."""
    return f"{base(cluster)}/agents/+/site_manager"


def site_manager_of(cluster: str, site: str, node: str) -> str:
    """Node `node`'s site-manager claim on the central broker, where its site's bridge delivers
    it (agent.sites): under `sites/<site>/`, so that the claims of a site never take part in the
    election of the centre's own nodes, which read `agents/+/site_manager`."""
    return f"{base(cluster)}/sites/{_check(site)}/agents/{_check(node)}/site_manager"


def all_sites_site_managers(cluster: str) -> str:
    """The subscription, at the central broker, to the site-manager claims of every bridged
    site's nodes (`site_manager_of`): the topic names the site, so a reader learns from it which
    site each node is in (fogctl's fleet-wide view, agent.fogctl.fleet_sites)."""
    return f"{base(cluster)}/sites/+/agents/+/site_manager"


def spill(cluster: str, node: str) -> str:
    return f"{base(cluster)}/spill/{_check(node)}"


def spill_chunk(cluster: str, node: str) -> str:
    """Spill chunks of `node` to the central collector (agent.spill.shipper)."""
    return f"{spill(cluster, node)}/chunk"


def spill_ack(cluster: str, node: str) -> str:
    """The collector's acks of `node`'s chunks."""
    return f"{spill(cluster, node)}/ack"


def all_spill_chunks(cluster: str) -> str:
    return f"{base(cluster)}/spill/+/chunk"


def agent_hosted(cluster: str, node: str) -> str:
    """Retained JSON list of the specs of the instances a node hosts (no broker settings): what
    the survivors need to start them elsewhere if the node stays away (agent.node.rehome)."""
    return f"{base(cluster)}/agents/{_check(node)}/hosted"


def all_agents_hosted(cluster: str) -> str:
    return f"{base(cluster)}/agents/+/hosted"


def agent_rehomed(cluster: str, node: str) -> str:
    """Retained JSON {instance: wall time} of the instances this node re-homed from dead nodes:
    a node that comes back must not re-adopt them, even after they terminated elsewhere."""
    return f"{base(cluster)}/agents/{_check(node)}/rehomed"


def all_agents_rehomed(cluster: str) -> str:
    return f"{base(cluster)}/agents/+/rehomed"


def all_agents_state(cluster: str) -> str:
    return f"{base(cluster)}/agents/+/state"


def all_agents_status(cluster: str) -> str:
    return f"{base(cluster)}/agents/+/status"


# Added by the fogctl issue (additive): fogctl's reads and its MQTT 5 request/response replies.


def decisions(cluster: str, instance: str) -> str:
    """Retained JSON array of the last scaling decisions of one instance (`fogctl why`)."""
    return f"{base(cluster)}/decisions/{_check(instance)}"


def replies(cluster: str, requester: str, replier: str) -> str:
    """`replier`'s reply to a request of `requester` (an admin or a node). The replier computes
    it from the request's topic; a request's MQTT 5 Response Topic is ignored (docs/security.md).
    A requester also publishes its snapshot sync marker to `replies(c, me, me)`."""
    return f"{base(cluster)}/replies/{_check(requester)}/{_check(replier)}"


def replies_inbox(cluster: str, requester: str) -> str:
    """The subscription of `requester` to the replies addressed to it (matched by correlation)."""
    return f"{base(cluster)}/replies/{_check(requester)}/+"


def all_latency(cluster: str) -> str:
    return f"{base(cluster)}/latency/+"


def all_pipelines(cluster: str) -> str:
    return f"{base(cluster)}/pipelines/+"


def all_decisions(cluster: str) -> str:
    return f"{base(cluster)}/decisions/+"


# -- parsing: the one place that knows the topic layout ---------------------------------------

# Kinds of topic whose messages are requests, replies or live traffic: a retained message on one
# of them is never legitimate (docs/security.md, "Retained messages are ignored").
NOT_RETAINED = frozenset({"rpc", "peer", "reply", "ping", "pong", "events", "locks", "inbox"})

_AGENT_RECORDS = frozenset({"state", "status", "hosted", "rehomed", "site_manager"})


class Parsed(NamedTuple):
    """The parts of a topic of one cluster.

    kind: state | status | hosted | rehomed | site_manager | rpc | peer | reply | latency | ping | pong |
          events | locks | pipeline | decisions | inbox | spill_chunk | spill_ack
    node: the node (or requester of a reply, instance of inbox/decisions, pipeline name) the
          topic is about, i.e. its owner; sender: the identity in the last level of a request,
          reply, probe or inbox topic (who wrote it, as the ACL proves), the site of a
          site-manager claim at the centre (`sites/<site>/agents/<node>/site_manager`), else None.
    """

    kind: str
    node: Optional[str] = None
    sender: Optional[str] = None


def parse(cluster: str, topic: str) -> Optional[Parsed]:
    """The parts of `topic` if it is one of this module's topics of `cluster`, else None.

    Never raises: topics come from the bus. Every segment it returns is a valid segment."""
    prefix = f"{ROOT}/{cluster}/"
    if not isinstance(topic, str) or not topic.startswith(prefix):
        return None
    parts = topic[len(prefix):].split("/")
    if any(not p or p in ("+", "#") or "\0" in p for p in parts):
        return None
    n = len(parts)
    head = parts[0]
    if head == "agents" and n == 3 and parts[2] in _AGENT_RECORDS:
        return Parsed(parts[2], parts[1])
    if head == "agents" and n == 4 and parts[2] in ("rpc", "peer"):
        return Parsed(parts[2], parts[1], parts[3])
    if head == "replies" and n == 3:
        return Parsed("reply", parts[1], parts[2])
    if head == "latency" and n == 2:
        return Parsed("latency", parts[1])
    if head == "latency" and n == 4 and parts[2] in ("ping", "pong"):
        return Parsed(parts[2], parts[1], parts[3])
    if head == "events" and n == 1:
        return Parsed("events")
    if head == "sites" and n == 5 and parts[2] == "agents" and parts[4] == "site_manager":
        # at the centre: node = the claiming node, sender = its site
        return Parsed("site_manager", parts[3], parts[1])
    if head == "locks":
        return Parsed("locks", "/".join(parts[1:]) or None)
    if head == "pipelines" and n == 2:
        return Parsed("pipeline", parts[1])
    if head == "decisions" and n == 2:
        return Parsed("decisions", parts[1])
    if head == "inbox" and n == 3:
        return Parsed("inbox", parts[1], parts[2])
    if head == "inbox" and n == 4:  # per-node: inbox/<receiving node>/<instance>/<writer>
        return Parsed("inbox", parts[2], parts[3])
    if head == "spill" and n == 3 and parts[2] in ("chunk", "ack"):
        return Parsed(f"spill_{parts[2]}", parts[1])
    return None


def parse_any(topic: str) -> Optional[Parsed]:
    """`parse` for a topic of whatever cluster it names (callers that hold topics keyed by a
    subscription of one cluster, e.g. a snapshot)."""
    parts = topic.split("/", 2) if isinstance(topic, str) else []
    if len(parts) < 3 or parts[0] != ROOT or not parts[1] or parts[1] in ("+", "#"):
        return None
    return parse(parts[1], topic)


def filter_problem(topic: Any) -> Optional[str]:
    """Why `topic` is not a valid MQTT topic name or filter, or None (`#` only as the last level,
    wildcards only as whole levels, at most 256 characters, no NUL)."""
    if not isinstance(topic, str) or not topic or len(topic) > 256 or "\0" in topic:
        return "not a topic of 1-256 characters"
    levels = topic.split("/")
    for i, level in enumerate(levels):
        if ("#" in level and (level != "#" or i != len(levels) - 1)) or ("+" in level and level != "+"):
            return "a wildcard must be a whole level, and # the last one"
    return None
