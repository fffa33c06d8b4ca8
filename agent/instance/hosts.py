"""The agent's instance -> node bindings as an instance holds them (the control line "hosts",
agent.node.hostmap): read by the admission (which node may write for a sender,
agent.instance.admission) and by the outputs (which node's inbox a receiver reads,
agent.instance.outputs).

Rules of this file: one value object, no I/O, no reference to the instance; both parts are handed
the same `Hosts` and only `update` replaces its tables.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Set

__all__ = ["Hosts"]

log = logging.getLogger("agent.instance.worker")


class Hosts:
    """`bound`: instance -> the node it runs on; `former`: the nodes it ran on that may still
    write for it; `unproven`: senders whose binding the agent took without a statement from who
    moved them (agent.node.hostmap "unproven"): no new epoch of theirs is taken until proven."""

    def __init__(self) -> None:
        self.bound: Dict[str, str] = {}
        self.former: Dict[str, List[str]] = {}
        self.unproven: Set[str] = set()

    def update(self, msg: Dict[str, Any], ctx: Dict[str, Any]) -> Optional[Dict[str, str]]:
        """Replace the tables with a "hosts" line's; the bindings before, or None (and nothing
        changed) when the line carries no table."""
        bound = msg.get("bound")
        if not isinstance(bound, dict):
            log.warning("hosts line without its tables ignored", extra=ctx)
            return None
        before, self.bound = self.bound, {str(i): str(n) for i, n in bound.items()}
        former = msg.get("former")
        self.former = ({str(i): [str(n) for n in ns] for i, ns in former.items() if isinstance(ns, list)}
                       if isinstance(former, dict) else {})
        unproven = msg.get("unproven")
        self.unproven = {str(i) for i in unproven} if isinstance(unproven, list) else set()
        return before
