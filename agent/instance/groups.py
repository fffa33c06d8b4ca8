"""The key-group table of an instance whose successors keep keyed state: where it comes from,
what travels with a Start, what is saved (docs/operators.md, "Key groups that move").

Rules of this file: sans-IO, like agent.instance.core (it is part of the `Instance`). Only an
instance that routes by key to a keyed operator has a table (`Instance.next_keyed`); every other
one routes as before and sends and reads nothing here.

Where the table comes from:
- deployed (active in its spec): the dealing of `keygroups.owner` over its initial successors,
  version 0, so a deployment that never scales routes exactly as before;
- a copy of a predecessor: its creator's table, carried with its Start (a table dealt over the
  Start's successors would route the groups moved since to their old owners);
- a restart: the table saved with the routing tables (`Instance.persisted_state`), written
  before any Eos that follows a change of it leaves (agent.instance.core);
- a re-home whose node took the saved table: the groups its successors last reported owning
  (`extra["succ_groups"]`, agent.node.rehome).

The Start carries it as an extra field `groups` of the Start's JSON object, next to the paper's
fields: the protocol core never sees it (the driver takes it off before decoding), so the
paper's messages and their count are unchanged. `{"table": <GroupTable wire form>}`.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.dataplane.owners import GroupTable, TableError, table_from_reports

__all__ = ["GroupRouting", "START_FIELD", "initial_table", "restored_table", "start_field", "table_from_start"]

log = logging.getLogger("agent.instance.worker")

START_FIELD = "groups"  # the extra field of a Start's JSON object
# How long a Redirect taken here is reported in the heartbeat (`redirected`): a node lost is
# re-homed `dead_after` seconds after its last heartbeat, and the planner reads these then.
REDIRECTS_REPORTED_S = 300.0


def initial_table(succs: Sequence[str], groups: int) -> Optional[GroupTable]:
    """A deployed instance's table: the groups dealt over its successors (none yet: no table)."""
    return GroupTable.dealt(succs, groups) if succs else None


def restored_table(saved: Dict[str, Any], succs: Sequence[str], groups: int,
                   ctx: Dict[str, str], reports: Any = None) -> Optional[GroupTable]:
    """The table a restarted instance saved; without one, the table of what its successors last
    reported owning (`reports`: a re-home after its node, and its saved table, were lost:
    agent.node.rehome), else (saved before tables existed, an idle copy that never got its Start,
    reports that do not cover every group) the dealing over its restored successors."""
    wire = saved.get("group_table")
    if wire is None and reports is not None:
        try:
            return table_from_reports(reports, groups)
        except TableError as exc:
            log.warning("the successors' reported groups make no table (%s): dealt again", exc, extra=ctx)
    if wire is not None:
        try:
            table = GroupTable.from_wire(wire, max_groups=groups)
            if table.groups == groups:
                return table
            log.warning("saved group table has %d groups, the pipeline %d: dealt again", table.groups, groups,
                        extra=ctx)
        except TableError as exc:
            log.warning("saved group table unusable (%s): dealt again", exc, extra=ctx)
    return initial_table(succs, groups)


def start_field(table: Optional[GroupTable]) -> Optional[Dict[str, Any]]:
    """What a Start to a copy of ours carries (None: nothing, the Start stays the paper's)."""
    return None if table is None else {"table": table.to_wire()}


def table_from_start(field: Any, succs: Sequence[str], groups: int, ctx: Dict[str, str]) -> Optional[GroupTable]:
    """A copy's table from its Start's extra field (untrusted: from the bus, checked by
    `GroupTable.from_wire`); without a usable one, the dealing over the Start's successors."""
    wire = field.get("table") if isinstance(field, dict) else None
    if wire is not None:
        try:
            table = GroupTable.from_wire(wire, max_groups=groups)
            if table.groups == groups:
                return table
        except TableError as exc:
            log.warning("group table of our Start unusable (%s): dealt over our successors", exc, extra=ctx)
    else:
        log.warning("our Start carries no group table: dealt over our successors", extra=ctx)
    return initial_table(succs, groups)


class GroupRouting:
    """The group table's side of an instance routing to a keyed operator: `on` when it routes by
    that operator's group -> owner table (`Instance.next_keyed`), and the Redirects an idle copy
    received before its Start brought its table (taken then, in their order). It holds no
    reference to the instance: the router whose table it sets is passed per call."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._waiting: List[Tuple[str, Any]] = []  # (sender, decoded Redirect), an idle copy's
        self._taken: Dict[int, Tuple[str, str, int, float]] = {}  # group -> (old, new, version, when)

    def took(self, group: int, old: str, new: str, version: int, now: float) -> None:
        """We took a Redirect: `group` goes from `old` to `new` at `version` (`redirected`)."""
        self._taken[group] = (old, new, version, now)

    def redirected(self, now: float) -> List[List[Any]]:
        """The Redirects taken in the last REDIRECTS_REPORTED_S, the newest of each group:
        [group, old owner, new owner, version], for the heartbeat. Both ends of a move can be
        lost with one node before either reports it (a copy created and handed its share just
        before the loss): only the predecessors that took the Redirect know the move began, and
        the re-home planner starts it again from the old owner (agent.node.rehome). Without it,
        the old owner would resume the group as its own while we route it to the new one, which
        would hold its records for ever and refuse nothing (CHANGELOG.md, "A move only the
        predecessor had seen begin was forgotten when both its ends were lost")."""
        for g in [g for g, e in self._taken.items() if now - e[3] > REDIRECTS_REPORTED_S]:
            del self._taken[g]
        return [[g, old, new, v] for g, (old, new, v, _) in sorted(self._taken.items())]

    def hold(self, sender: str, msg: Any, limit: int) -> None:
        """A Redirect before our table (an idle copy): kept until the Start, at most `limit`."""
        if len(self._waiting) < limit:
            self._waiting.append((sender, msg))

    def restore(self, router: Any, saved: Dict[str, Any], ctx: Dict[str, Any], reported: Any) -> None:
        """A restart's table (`restored_table`) onto `router`, when we route by one."""
        if self.on:
            router.table = restored_table(saved, router.succs, router.groups, ctx, reported)

    def start_field(self, router: Any) -> Optional[Dict[str, Any]]:
        """What a Start we send carries of our table (`start_field`), None when we route by none."""
        return start_field(router.table) if self.on else None

    def from_start(self, router: Any, field: Any, succs: Sequence[str],
                   ctx: Dict[str, Any]) -> Optional[List[Tuple[str, Any]]]:
        """Our Start arrived: our creator's table onto `router`, and the Redirects held until now
        (to take, in their order); None when we route by no table."""
        if not self.on:
            return None
        router.table = table_from_start(field, succs, router.groups, ctx)
        waiting, self._waiting = self._waiting, []
        return waiting
