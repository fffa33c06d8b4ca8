"""The explicit key group -> owner table of a keyed operator, and the plans that change it when an
instance duplicates or terminates (docs/operators.md, "Key groups that move"). Sans-IO.

Why a table and not `keygroups.owner` (groups dealt over the sorted instance names): dealing again
after a change of the instance set moves most groups between all instances, and every moved group
costs a hand-over of its state. With a table, a duplication moves only the share of its creator's
groups the creator hands to the copy, a termination only the leaver's groups.

Rules of this file:
- Every group has exactly one owner and a version. A hand-over of a group sets its new owner and
  raises its version by one; the version says which of two tables is newer for that group, so
  tables that travel by different paths (with a Start, with a Redirect, from a file) merge by
  keeping, per group, the higher version. The same version with two owners is a conflict (a
  bug or a forged table): `merge` raises.
- The table starts as the dealing of `keygroups.owner` (version 0 everywhere), so a deployment
  that never scaled routes as before.
- The plans are deterministic (ties broken by group number, then instance name), so every
  replica of a decision computes the same moves.
- `from_wire` treats its input as hostile: sizes are bounded before anything is built.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from agent.dataplane.keygroups import DEFAULT_GROUPS, MAX_GROUPS, owner as dealt_owner

__all__ = ["GroupTable", "TableError", "split_share", "absorb_plan", "MAX_OWNERS", "MAX_NAME", "group_runs",
           "groups_from_runs", "table_from_reports"]

MAX_OWNERS = 1024  # distinct owners a table on the wire may name
MAX_NAME = 200  # characters of an instance name on the wire


class TableError(ValueError):
    """A table that cannot be (merged, built from the wire): says which group or field."""


class GroupTable:
    """group -> (owner, version) for `groups` key groups."""

    def __init__(self, groups: int, owners: Mapping[int, Tuple[str, int]]) -> None:
        if not 1 <= groups <= MAX_GROUPS:
            raise TableError(f"groups must be in 1..{MAX_GROUPS}, found {groups}")
        if set(owners) != set(range(groups)):
            raise TableError(f"a table of {groups} groups must name an owner for each of 0..{groups - 1}")
        self.groups = groups
        self._owner: Dict[int, str] = {g: o for g, (o, _) in owners.items()}
        self._version: Dict[int, int] = {g: v for g, (_, v) in owners.items()}

    @classmethod
    def dealt(cls, instances: Sequence[str], groups: int = DEFAULT_GROUPS) -> "GroupTable":
        """The groups dealt over `instances` as `keygroups.owner` does, version 0."""
        return cls(groups, {g: (dealt_owner(g, instances), 0) for g in range(groups)})

    # ---- reading -----------------------------------------------------------------------------------

    def owner(self, group: int) -> str:
        return self._owner[group]

    def version(self, group: int) -> int:
        return self._version[group]

    def groups_of(self, instance: str) -> Set[int]:
        return {g for g, o in self._owner.items() if o == instance}

    def instances(self) -> Set[str]:
        return set(self._owner.values())

    def copy(self) -> "GroupTable":
        return GroupTable(self.groups, {g: (self._owner[g], self._version[g]) for g in range(self.groups)})

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, GroupTable) and self.groups == other.groups and self._owner == other._owner
                and self._version == other._version)

    def __repr__(self) -> str:
        return f"GroupTable({self.groups}, {dict(sorted(self._owner.items()))})"

    # ---- transitions ---------------------------------------------------------------------------------

    def moved(self, group: int, new: str) -> int:
        """`group` now belongs to `new`: its version rises by one (returned)."""
        if group not in self._owner:
            raise TableError(f"group {group} is not in a table of {self.groups} groups")
        self._owner[group] = new
        self._version[group] += 1
        return self._version[group]

    def apply(self, group: int, new: str, version: int) -> bool:
        """A move learnt from elsewhere (a Redirect): taken if newer than what is known. True if taken."""
        if group not in self._owner:
            raise TableError(f"group {group} is not in a table of {self.groups} groups")
        if version < self._version[group]:
            return False
        if version == self._version[group]:
            if self._owner[group] != new:
                raise TableError(f"group {group} version {version}: owner {self._owner[group]} here, {new} there")
            return False
        self._owner[group], self._version[group] = new, version
        return True

    def merge(self, other: "GroupTable") -> List[int]:
        """Per group, the higher version wins. Returns the groups whose owner changed here."""
        if other.groups != self.groups:
            raise TableError(f"cannot merge a table of {other.groups} groups into one of {self.groups}")
        changed = []
        for g in range(self.groups):
            before = self._owner[g]
            if self.apply(g, other._owner[g], other._version[g]) and self._owner[g] != before:
                changed.append(g)
        return changed

    # ---- wire ------------------------------------------------------------------------------------------

    def to_wire(self) -> Dict[str, Any]:
        """Compact JSON value: the owners named once, then one index and one version per group."""
        names = sorted(set(self._owner.values()))
        index = {n: i for i, n in enumerate(names)}
        return {"groups": self.groups, "owners": names,
                "o": [index[self._owner[g]] for g in range(self.groups)],
                "v": [self._version[g] for g in range(self.groups)]}

    @classmethod
    def from_wire(cls, obj: Any, max_groups: int = MAX_GROUPS) -> "GroupTable":
        """The table of `to_wire`, from untrusted JSON: every size and type checked first."""
        if not isinstance(obj, dict):
            raise TableError(f"a group table must be an object, found {type(obj).__name__}")
        groups, names, idx, ver = obj.get("groups"), obj.get("owners"), obj.get("o"), obj.get("v")
        if type(groups) is not int or not 1 <= groups <= max_groups:
            raise TableError(f"group table: 'groups' must be an integer in 1..{max_groups}")
        if not isinstance(names, list) or not 1 <= len(names) <= MAX_OWNERS:
            raise TableError(f"group table: 'owners' must be a list of 1..{MAX_OWNERS} names")
        if not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in names) or len(set(names)) != len(names):
            raise TableError(f"group table: 'owners' must be distinct names of 1..{MAX_NAME} characters")
        for field, vals in (("o", idx), ("v", ver)):
            if not isinstance(vals, list) or len(vals) != groups:
                raise TableError(f"group table: '{field}' must be a list of {groups} integers")
        if not all(type(i) is int and 0 <= i < len(names) for i in idx):
            raise TableError(f"group table: 'o' must index 'owners' (0..{len(names) - 1})")
        if not all(type(v) is int and 0 <= v < 2 ** 53 for v in ver):
            raise TableError("group table: 'v' must be versions >= 0")
        return cls(groups, {g: (names[idx[g]], ver[g]) for g in range(groups)})


# ---- what a keyed instance says it owns -------------------------------------------------------------


def group_runs(versions: Mapping[int, int]) -> List[List[int]]:
    """The groups a keyed instance owns with their versions, as [first, last, version] runs of
    consecutive groups at one version: a few runs for 128 groups, small enough for the heartbeat
    stats that reach the node's retained state, where a re-homed incarnation finds them."""
    runs: List[List[int]] = []
    for g in sorted(versions):
        v = versions[g]
        if runs and runs[-1][1] == g - 1 and runs[-1][2] == v:
            runs[-1][1] = g
        else:
            runs.append([g, g, v])
    return runs


def groups_from_runs(obj: Any, max_groups: int = MAX_GROUPS) -> Dict[int, int]:
    """group -> version from `group_runs`, out of untrusted JSON (a node's retained state): every
    run's type and range checked, at most `max_groups` runs; raises TableError."""
    if not isinstance(obj, list) or len(obj) > max_groups:
        raise TableError(f"group runs: expected a list of at most {max_groups} [first, last, version]")
    out: Dict[int, int] = {}
    for run in obj:
        if (not isinstance(run, list) or len(run) != 3 or not all(type(x) is int for x in run)
                or not 0 <= run[0] <= run[1] < max_groups or not 0 <= run[2] < 2 ** 53):
            raise TableError(f"group runs: {str(run)[:60]} is not [first, last, version] within 0..{max_groups - 1}")
        for g in range(run[0], run[1] + 1):
            if g in out:
                raise TableError(f"group runs: group {g} named twice")
            out[g] = run[2]
    return out


# ---- plans ------------------------------------------------------------------------------------------


def _load(groups: Iterable[int], load: Optional[Mapping[int, float]]) -> Dict[int, float]:
    """Measured load per group (records per second, say); 1.0 each when nothing was measured."""
    return {g: float(load.get(g, 0.0)) if load else 1.0 for g in groups}


def split_share(mine: Iterable[int], load: Optional[Mapping[int, float]] = None) -> List[int]:
    """The groups a duplicating creator hands to its copy, out of the groups `mine` whose state it
    holds (not those on their way to it: it cannot hand what it does not have): about half their
    measured load, the creator keeping at least one group (none handed if it has fewer than two).

    Heaviest first, each group to the side with fewer groups so far (ties: the creator) unless
    that would leave the two sides' loads further apart than both the group's own load and their
    gap before it; then to the side with less load. The gap thus never exceeds the heaviest
    group's load: the copy's share is half the load +- half of one group's. Groups without load
    (no record, or long idle) only even out the counts, hence the state moved (with no load
    measured at all: half the groups by count)."""
    mine = sorted(set(mine))
    if len(mine) < 2:
        return []
    w = _load(mine, load)
    keep: float = 0.0
    give: float = 0.0
    handed: List[int] = []
    kept = 0
    for g in sorted(mine, key=lambda g: (-w[g], g)):
        to_copy = len(handed) < kept
        gap = (give + w[g] - keep) if to_copy else (keep + w[g] - give)
        if abs(gap) > max(w[g], abs(give - keep)):
            to_copy = give < keep
        if to_copy:
            handed.append(g)
            give += w[g]
        else:
            kept += 1
            keep += w[g]
    if not kept:
        handed.pop()
    return sorted(handed)


def absorb_plan(table: GroupTable, leaver: str, survivors: Sequence[str],
                load: Optional[Mapping[int, float]] = None, mine: Optional[Iterable[int]] = None) -> Dict[int, str]:
    """Where each group of a terminating `leaver` goes: heaviest first, to the survivor with the
    least load so far (its own groups counted). `mine`: the groups whose state the leaver holds
    (default: its groups in `table`); one still on its way to it is handed on once it arrives."""
    alive = sorted(set(survivors) - {leaver})
    if not alive:
        raise TableError(f"{leaver} cannot leave: no survivor to take its groups")
    w = _load(range(table.groups), load)
    held = {s: sum(w[g] for g in table.groups_of(s)) for s in alive}
    plan: Dict[int, str] = {}
    for g in sorted(table.groups_of(leaver) if mine is None else set(mine), key=lambda g: (-w[g], g)):
        to = min(alive, key=lambda s: (held[s], s))
        plan[g] = to
        held[to] += w[g]
    return plan


def table_from_reports(reports: Any, groups: int) -> GroupTable:
    """A table from what the owners last said they own (`{instance: group_runs}`, untrusted: the
    nodes' retained states): each group's owner is the instance reporting it at the highest
    version. A predecessor re-homed without its saved table starts from it, where the dealing
    named owners the groups had left (their Redirects then refused for ever: "which does not own
    it"). Raises TableError unless every group is reported: a group in the middle of a move is
    reported by neither side, and guessing its owner is the conflict this avoids."""
    if not isinstance(reports, dict) or not 1 <= len(reports) <= MAX_OWNERS:
        raise TableError(f"owner reports: expected an object of 1..{MAX_OWNERS} instances")
    best: Dict[int, Tuple[str, int]] = {}
    for inst, runs in sorted(reports.items()):
        if not isinstance(inst, str) or not 0 < len(inst) <= MAX_NAME:
            raise TableError("owner reports: an instance name is not a string of 1..MAX_NAME characters")
        for g, v in groups_from_runs(runs, groups).items():
            if g not in best or v > best[g][1]:
                best[g] = (inst, v)
    missing = [g for g in range(groups) if g not in best]
    if missing:
        raise TableError(f"owner reports: {len(missing)} groups reported by no instance (e.g. {missing[0]})")
    return GroupTable(groups, best)
