"""A site's uplink: which topics cross between a site broker and the central broker, and the
Mosquitto bridge stanza that carries them (docs/scale.md, "Sites").

Why a function and not a hand-written list in the Ansible role: what leaves a site is a security
boundary (docs/security.md). The data plane (inboxes), the protocol between nodes (peer requests,
locks, latency probes, hosted records) and everything an intruder on the uplink could use to
steer a site must stay on the site broker; only the spill, the events, each node's status and
state records and its site-manager claim go out, and only the spill acks and the steering of
the listed administrators come in. One pure function names them, `tests/test_sites.py` holds the
role's template to it and sends real messages through a real bridge to check each line.

Sans-IO: no file, socket or clock here. Topic names come from `agent.topics` only.

Topics keyed by a node keep their name at the centre: node names are fleet-wide identities (the
CN of the node's certificate, one CA per fleet), so `spill/<node>/chunk` and
`agents/<node>/status` of two sites never collide, and the central collector reads every site's
spill with its one subscription. The site managers' claims are renamed under `sites/<site>/` at
the centre: kept under `agents/<node>/`, a site's claims would take part in the election of the
centre's own nodes, which read `agents/+/site_manager` (one site manager per broker). The events
of every site arrive on the centre's one `events` topic: each event names its node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from agent import topics

__all__ = ["Crossing", "Uplink", "crossings", "render_bridge", "centre_acl", "OUT", "IN"]

OUT = "out"  # site broker -> central broker
IN = "in"  # central broker -> site broker


@dataclass(frozen=True)
class Crossing:
    """One topic (no wildcard) that crosses the uplink.

    `local` is its name on the site broker, `remote` on the central broker; `what` says why it
    crosses (rendered as a comment in the stanza)."""

    local: str
    remote: str
    direction: str
    qos: int
    what: str

    def topic_line(self, cluster: str) -> str:
        """The stanza's `topic` line. A renamed topic uses Mosquitto's prefix form
        `topic <suffix> <direction> <qos> <local prefix> <remote prefix>`."""
        if self.local == self.remote:
            return f"topic {self.local} {self.direction} {self.qos}"
        local_prefix = topics.base(cluster) + "/"
        suffix = self.local[len(local_prefix):]
        remote_prefix = self.remote[: len(self.remote) - len(suffix)]
        assert self.local.startswith(local_prefix) and self.remote.endswith(suffix)
        return f"topic {suffix} {self.direction} {self.qos} {local_prefix} {remote_prefix}"


def _names(what: str, values: Sequence[str]) -> List[str]:
    out = []
    for v in values:
        if not isinstance(v, str):
            raise ValueError(f"{what}: {v!r} is not a name (expected a string)")
        topics._check(v)
        out.append(v)
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: a name is listed twice")
    return sorted(out)


def crossings(cluster: str, site: str, nodes: Sequence[str], admins: Sequence[str] = ()) -> List[Crossing]:
    """Exactly the topics that cross the uplink of site `site` whose nodes are `nodes`, steered
    by the administrators `admins` from the centre. Everything else stays on the site broker.

    Out (site -> centre): each node's spill chunks (the central collector lands them), its retained
    status (online/offline, the Last Will), state record (what `fogctl status` shows) and site
    manager claim (renamed `sites/<site>/agents/<node>/site_manager`), the cluster's events, and
    each node's replies to each administrator. In (centre -> site): the collector's spill acks to
    each node, and each administrator's control requests to each node (`fogctl` at the centre).
    Raises ValueError on a name that cannot be a topic segment."""
    topics._check(site)
    ns = _names("nodes", nodes)
    adm = _names("admins", admins)
    clash = sorted(set(ns) & set(adm))
    if clash:
        raise ValueError(f"{clash[0]} is listed both as a node and as an administrator")
    c = cluster
    out: List[Crossing] = []
    for n in ns:
        out.append(Crossing(topics.spill_chunk(c, n), topics.spill_chunk(c, n), OUT, 1, "spill to the central collector"))
        out.append(Crossing(topics.spill_ack(c, n), topics.spill_ack(c, n), IN, 1, "the collector's acks"))
        out.append(Crossing(topics.agent_status(c, n), topics.agent_status(c, n), OUT, 1, "online/offline (retained)"))
        out.append(Crossing(topics.agent_state(c, n), topics.agent_state(c, n), OUT, 1, "state record (retained)"))
        out.append(Crossing(topics.site_manager(c, n), topics.site_manager_of(c, site, n), OUT, 1,
                            "site manager claim (retained), renamed under the site"))
        for a in adm:
            out.append(Crossing(topics.agent_rpc(c, n, a), topics.agent_rpc(c, n, a), IN, 1, f"steering by {a}"))
            out.append(Crossing(topics.replies(c, a, n), topics.replies(c, a, n), OUT, 1, f"replies to {a}"))
    out.append(Crossing(topics.events(c), topics.events(c), OUT, 1, "scaling and lock events"))
    return out


@dataclass(frozen=True)
class Uplink:
    """How the site broker reaches the centre, and as whom.

    `identity`: the site bridge's MQTT client id at the centre and the CN of its certificate
    (`certfile`), which the centre's ACL names (`centre_acl`). `cafile`/`certfile`/`keyfile`:
    paths on the site broker host; None only for a plain loopback bridge in tests (the role
    always renders TLS). `restart_timeout`: seconds between reconnection attempts while the
    uplink is down."""

    site: str
    host: str
    port: int
    identity: str
    cafile: Optional[str] = None
    certfile: Optional[str] = None
    keyfile: Optional[str] = None
    keepalive: int = 30
    restart_timeout: int = 5

    def __post_init__(self) -> None:
        topics._check(self.site)
        topics._check(self.identity)
        tls = (self.cafile, self.certfile, self.keyfile)
        if any(tls) and not all(tls):
            raise ValueError("uplink TLS: give cafile, certfile and keyfile together (or none of them)")
        if not (0 < int(self.port) < 65536):
            raise ValueError(f"uplink port {self.port!r}: expected 1-65535")


def render_bridge(cluster: str, uplink: Uplink, nodes: Sequence[str], admins: Sequence[str] = ()) -> str:
    """The `connection` stanza for the site broker's mosquitto.conf (appended after its
    listeners; bridges cannot be reloaded, a change needs a restart).

    What queues while the uplink is down: `cleansession false` keeps the bridge's session at the
    centre (steering and acks for the site wait there), `local_cleansession false` keeps it on
    the site broker (spill, events and records for the centre wait there). Both queues are
    bounded by the brokers' `max_queued_messages` and `max_queued_bytes` and survive a restart
    with `persistence true` (the role's settings); QoS 1 throughout, so a message can arrive
    twice, never be lost below those bounds."""
    crossing = crossings(cluster, uplink.site, nodes, admins)
    lines = [
        f"# Uplink of site {uplink.site} to the central broker (agent/sites.py; docs/scale.md, \"Sites\").",
        f"connection {uplink.identity}",
        f"address {uplink.host}:{int(uplink.port)}",
        "bridge_protocol_version mqttv50",
        f"remote_clientid {uplink.identity}",
        f"local_clientid {uplink.identity}-local",
        "cleansession false",
        "local_cleansession false",
        "try_private true",
        "start_type automatic",
        f"restart_timeout {int(uplink.restart_timeout)}",
        f"keepalive_interval {int(uplink.keepalive)}",
        # The link's state, 1 or 0, on the site broker only (never crosses the uplink).
        "notifications true",
        "notifications_local_only true",
        f"notification_topic $SYS/broker/connection/{uplink.identity}/state",
    ]
    if uplink.cafile:
        lines += [
            f"bridge_cafile {uplink.cafile}",
            f"bridge_certfile {uplink.certfile}",
            f"bridge_keyfile {uplink.keyfile}",
            "bridge_insecure false",
            "bridge_tls_version tlsv1.2",
        ]
    for x in crossing:
        lines.append(f"# {x.what}")
        lines.append(x.topic_line(cluster))
    return "\n".join(lines) + "\n"


def centre_acl(cluster: str, uplink: Uplink, nodes: Sequence[str], admins: Sequence[str] = ()) -> str:
    """The central broker's ACL block for the site's bridge identity: write what goes out, read
    what comes in, on the centre's names, nothing else (docs/security.md)."""
    lines = [f"user {uplink.identity}", f"# the bridge of site {uplink.site}"]
    for x in crossings(cluster, uplink.site, nodes, admins):
        lines.append(f"topic {'write' if x.direction == OUT else 'read'} {x.remote}")
    return "\n".join(lines) + "\n"
