"""Carrying out the site manager's effects on the agent that runs the candidate (docs/site-manager.md):
its period is run on the fleet view (agent.node.site_driver) and each effect it returns is done
here, through the two calls the daemon gives (a publish, a steer of this node itself).

Why apart from the driver: the driver decides from what it is given, this side does the
sending; a steer of another node goes on that node's peer topic under a correlation of its own,
a steer of this node goes straight to its own requests, not around through the broker.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Mapping

from agent import events, topics
from agent.node import rpc
from agent.node.site_driver import Emit, Hook, Publish, SiteDriver, Steer, run_hook

log = logging.getLogger(__name__)


def tick(site: SiteDriver, node: str, cluster: str, client_id: str, fleet: Mapping[str, Any],
         online: Mapping[str, bool], own_state: Mapping[str, Any], now: float,
         publish: Callable[..., Any], steer_here: Callable[[Dict[str, Any]], None]) -> None:
    """Run the site manager's period at wall time `now` on the node states `fleet` (ours is
    `own_state`) and the statuses `online`, and carry out its effects."""
    docs = {n: d for n, d in fleet.items() if n != node}
    docs[node] = own_state
    up = dict(online)  # every node's status: the election's claims too, not only the states'
    up[node] = True
    for eff in site.tick(now, docs, up):
        if isinstance(eff, Publish):
            publish(eff.topic, eff.payload, retain=eff.retain)
        elif isinstance(eff, Steer):
            if eff.node == node:
                steer_here(eff.body)
            else:
                corr = f"{client_id}-site-{now:.6f}"
                publish(topics.agent_peer(cluster, eff.node, node), rpc.encode(eff.body),
                        correlation=corr.encode())
        elif isinstance(eff, Hook):
            run_hook(eff.argv, node)
        elif isinstance(eff, Emit):
            site_event(eff.action, now, node, cluster, publish)


def site_event(action: Dict[str, Any], now: float, node: str, cluster: str, publish: Callable[..., Any]) -> None:
    """The site manager's action as an event on `fog/<cluster>/events`; a bad one is logged, never raised."""
    try:
        ev = events.make(events.EventType.SITE_ACTION.value, ts=now, node=node,
                         detail=dict(action, source="site_manager"))
    except ValueError as exc:
        log.error("site event not published: %s", exc, extra={"node": node})
        return
    publish(topics.events(cluster), ev.to_json().encode(), qos=1)
