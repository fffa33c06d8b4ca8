"""The fleet-wide view at the central broker: `fogctl status` grouped by site (docs/fogctl.md, "At
the central broker"; docs/scale.md, "Sites").

What the centre holds of a site is what its bridge carries (agent.sites.crossings): each node's
retained status and state records under their own names, the events, and each node's record on
its claim topic renamed `sites/<site>/agents/<node>/site_manager`. The views that read only
status and state records (`status`, `topology`, `locks`) therefore show every site's nodes at the
centre; the latency rows, hosted and re-homed records, decision histories, pipeline records and
lock traffic stay in their sites (`fogctl --site NAME` reads them there).

Which site a node is in, and how that is known: from the renamed claim topic. Every agent writes
one retained record on its own claim topic each time it connects, once it has read the retained
records (its lease while it leads the site manager, else its statement of whom it follows, null
when nobody: docs/site-manager.md), whether or not any node runs a site manager. The centre's ACL
lets the bridge of site S write `sites/S/agents/<n>/site_manager` only for the nodes listed for S
(agent.sites.centre_acl), so the broker proves that node n is behind S's bridge. A node with a
record under its own name `agents/<n>/site_manager` at the centre is connected to the central
broker itself (no bridge may write that name there). A node with neither (its agent has not
connected since its site's bridge came up, or a broker older than the bridge's rename) is shown
under "site not known". The `[sites]` table of fogctl's settings adds the sites it names that
the centre has no node of.

Sans-IO apart from `read_membership` (one snapshot on an open connection).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from agent import topics
from agent.control.fleet import Fleet, parse_status
from agent.fogctl import views
from agent.fogctl.render import fmt_age

__all__ = ["Membership", "STAY_IN_SITES", "STALE_AFTER_S", "known_sites", "membership", "read_membership",
           "site", "site_records", "status"]

# What a site's bridge does not carry to the centre (agent.sites.crossings), as in docs/scale.md.
STAY_IN_SITES = ("latency rows", "hosted records", "re-homed records", "decision histories",
                 "pipeline records", "locks", "inboxes")
# The agents publish their state every [agent] state_period (5 s by default); a site none of whose
# nodes published for this long is shown as possibly cut off: the centre keeps the last records.
STALE_AFTER_S = 30.0

SiteRecord = Callable[[Mapping[str, Any], str, float], Optional[Dict[str, Any]]]


@dataclass(frozen=True)
class Membership:
    """Which site each node is in, as the central broker's records show it.

    `site`: node -> its site (from the one bridge that delivered its record); `several`: node ->
    the sites whose bridges delivered a record of it (a node moved between sites keeps its old
    site's retained record until someone clears it); `here`: nodes with a claim record under their
    own name on this broker; `claims`: site -> {node: payload} of the renamed records."""

    site: Dict[str, str] = field(default_factory=dict)
    several: Dict[str, List[str]] = field(default_factory=dict)
    here: Tuple[str, ...] = ()
    claims: Dict[str, Dict[str, bytes]] = field(default_factory=dict)

    @property
    def sites(self) -> List[str]:
        return sorted(self.claims)


def membership(snapshot: Mapping[str, Any], cluster: str) -> Membership:
    """The membership from a snapshot of `agents/+/site_manager` and
    `sites/+/agents/+/site_manager` (topic -> message with `.payload`, or bytes)."""
    claims: Dict[str, Dict[str, bytes]] = {}
    here = set()
    for topic, msg in snapshot.items():
        payload = msg if isinstance(msg, (bytes, bytearray)) else getattr(msg, "payload", b"")
        parsed = topics.parse(cluster, topic)
        if not payload or parsed is None or parsed.kind != "site_manager" or parsed.node is None:
            continue
        if parsed.sender is None:
            here.add(parsed.node)
        else:
            claims.setdefault(parsed.sender, {})[parsed.node] = bytes(payload)
    by_node: Dict[str, List[str]] = {}
    for site, nodes in claims.items():
        for n in nodes:
            by_node.setdefault(n, []).append(site)
    site = {n: s[0] for n, s in by_node.items() if len(s) == 1}
    several = {n: sorted(s) for n, s in by_node.items() if len(s) > 1}
    return Membership(site, several, tuple(sorted(here - set(by_node))), claims)


def read_membership(conn: Any, cluster: str) -> Membership:
    """The claim records on an open fogctl connection: the renamed ones, and when there are some
    (a central broker) the ones under the nodes' own names. An identity that may not read
    `sites/+/...` gets nothing there (Mosquitto 2.0 grants the subscription and delivers
    nothing); a broker that refuses the subscription outright has, for fogctl, no bridged site."""
    from agent.mqtt.requester import RequestFailed, RequestTimeout

    try:
        snap = conn.snapshot([topics.all_sites_site_managers(cluster)])
    except RequestTimeout:
        raise
    except RequestFailed as exc:  # e.g. fogctl as a node's identity (--agent-config): no bridged site for it
        if "refused the subscription" not in str(exc):
            raise
        return Membership()
    if snap:  # a central broker: which nodes are connected here, not through a bridge
        snap.update(conn.snapshot([topics.all_site_managers(cluster)]))
    return membership(snap, cluster)


def known_sites(cfg: Any) -> List[str]:
    """The sites of fogctl's `[sites]` table, when it talks to the central broker (not with
    `--site`: then its broker is one of the table's)."""
    table = dict(getattr(cfg, "sites", None) or {})
    return [] if cfg.broker in table.values() else sorted(table)


def site_records(m: Membership, site: str, cluster: str, status_of: Callable[[str], Optional[str]]) -> Dict[str, Any]:
    """The records an agent of `site` reads on its own broker, rebuilt from the centre's: each
    node's claim record under its own name, and its status ("online"/"offline" from `status_of`,
    None: no status), as `commands.site_record` takes them."""
    records: Dict[str, Any] = {}
    for n, payload in m.claims.get(site, {}).items():
        records[topics.site_manager(cluster, n)] = types.SimpleNamespace(payload=payload)
        st = status_of(n)
        if st in ("online", "offline"):
            records[topics.agent_status(cluster, n)] = types.SimpleNamespace(payload=str(st).encode())
    return records


def _site_manager(m: Membership, site: str, fleet: Fleet, now: float, site_record: SiteRecord) -> Optional[Dict[str, Any]]:
    """The site manager an agent of `site` would derive, from the site's renamed records and its
    nodes' statuses at the centre (`site_record`: fogctl site's derivation, commands.site_record)."""
    def status_of(n: str) -> Optional[str]:
        node = fleet.node(n)
        return None if node is None else node.status
    return site_record(site_records(m, site, fleet.cluster, status_of), fleet.cluster, now)


def site(doc: Dict[str, Any], text: str, m: Membership, statuses: Mapping[str, Any], cluster: str, now: float,
         site_record: SiteRecord, site_view: Callable[[Optional[Dict[str, Any]], float], Tuple[Dict[str, Any], str]]
         ) -> Tuple[Dict[str, Any], str]:
    """`fogctl site` at the central broker: the view of this broker's own claims (`doc`, `text`),
    then one per bridged site, derived from its renamed records and its nodes' statuses here.
    `statuses`: the snapshot of `agents/+/status` (topic -> message). Unchanged without sites.
    JSON: `doc` plus `sites` (site -> the same document as fogctl site's, for that site)."""
    if not m.sites:
        return doc, text
    online: Dict[str, str] = {}
    for topic, msg in statuses.items():
        parsed = topics.parse(cluster, topic)
        if parsed is not None and parsed.kind == "status" and parsed.node is not None:
            online[parsed.node] = parse_status(getattr(msg, "payload", b"") or b"")
    parts = [("on the central broker itself: " if m.here else "on the central broker itself: no claim; ") + text]
    by_site: Dict[str, Any] = {}
    for name in m.sites:
        sdoc, stext = site_view(site_record(site_records(m, name, cluster, online.get), cluster, now), now)
        by_site[name] = sdoc
        parts.append(f"site {name} (from the records its bridge renames at the centre)\n{stext}")
    return dict(doc, sites=by_site), "\n\n".join(parts)


def _section(fleet: Fleet, names: Sequence[str], now: float) -> Tuple[Dict[str, Any], str]:
    wanted = set(names)
    return views.status(replace(fleet, nodes=tuple(n for n in fleet.nodes if n.node in wanted)), now)


def status(fleet: Fleet, m: Membership, known: Sequence[str], now: float,
           site_record: SiteRecord) -> Tuple[Dict[str, Any], str]:
    """`fogctl status` (views.status) grouped by site when the broker holds bridged sites' records
    or the settings name sites; otherwise exactly views.status. `site_record`: derives a site's
    manager from its claim records and statuses (commands.site_record).

    JSON: views.status's document, each node with `site` (null when not known) and `site_from`
    ("bridge": its site's bridge delivered its record; "this broker": it is connected here;
    null), plus `sites` (one entry per site) and `stay_in_sites` (what the centre cannot show)."""
    doc, text = views.status(fleet, now)
    all_sites = sorted(set(m.sites) | set(known))
    if not all_sites:
        return doc, text
    for d in doc["nodes"]:
        n = d["node"]
        d["site"] = m.site.get(n)
        d["site_from"] = "bridge" if n in m.site else "this broker" if n in m.here else None
    sections: List[str] = []
    entries: List[Dict[str, Any]] = []
    seen = {n.node for n in fleet.nodes}
    for site in all_sites:
        names = sorted(n for n, s in m.site.items() if s == site and n in seen)
        ages = [a for a in (fleet.node(n).last_seen(now) for n in names) if a is not None]  # type: ignore[union-attr]
        newest = min(ages) if ages else None
        lead = _site_manager(m, site, fleet, now, site_record) if site in m.claims else None
        leader = None if lead is None or lead.get("void") or now >= float(lead["until"]) else lead["node"]
        online = sum(1 for n in names if fleet.node(n).status == "online")  # type: ignore[union-attr]
        entries.append({"site": site, "nodes": names, "online": online, "site_manager": leader,
                        "newest_state_s": None if newest is None else round(newest, 3),
                        "stale": newest is not None and newest > STALE_AFTER_S,
                        "in_settings": site in known})
        if not names:
            why = ("its bridge delivered no node record here yet (bridge not connected, or no agent "
                   "started since it came up)" if site not in m.claims else "no status or state record of its nodes here")
            sections.append(f"site {site}: no node seen at the centre; {why}")
            continue
        head = (f"site {site}: {len(names)} node{'s' if len(names) != 1 else ''} ({online} online), "
                f"site manager {leader or '-'}, newest state {fmt_age(newest)}")
        if entries[-1]["stale"]:
            head += (f"\n  no newer record from this site for over {STALE_AFTER_S:g}s: its uplink may be down "
                     f"(the centre keeps its last records; STATUS is the last one that crossed)")
        sections.append(head + "\n" + _section(fleet, names, now)[1])
    rest_here = [n.node for n in fleet.nodes if n.node not in m.site and n.node in m.here]
    rest = [n.node for n in fleet.nodes if n.node not in m.site and n.node not in m.here]
    if rest_here:
        sections.append("on the central broker itself (no bridge)\n" + _section(fleet, rest_here, now)[1])
    if rest:
        several = [f"{n} ({', '.join(m.several[n])})" for n in rest if n in m.several]
        note = (f"; records from several sites' bridges: {', '.join(several)}" if several else
                "; no record of theirs on a claim topic here")
        sections.append(f"site not known{note}\n" + _section(fleet, rest, now)[1])
    doc["sites"] = entries
    doc["stay_in_sites"] = list(STAY_IN_SITES)
    sections.append("at the centre: each site's node status and state records and its events; "
                    f"{', '.join(STAY_IN_SITES)} stay in the sites (fogctl --site NAME)")
    return doc, "\n\n".join(sections)
