"""Re-homing the instances of a node that stays away (pure: no I/O, no clock; inputs passed in).

A node that loses power for good (SD card dead, Pi unplugged) does not come back to re-adopt its
instances (agent.node.hosted). Its instances are still in their neighbours' routing tables and
their inboxes still fill in the broker (persistent sessions). Rather than removing them from every
table (a protocol round nobody can run for them) we start each one again, **with the same
identity**, on a surviving node:

- the broker hands the new incarnation the inbox session of the old one (same client id), so what
  the predecessors had sent and not seen acked is still there or is replayed to it;
- its routing tables are rebuilt from the fleet's retained records (`agents/<node>/hosted`,
  published by every agent): the instances of the previous and next operator of its pipeline;
- its epoch starts above anything the dead incarnation used (`min_epoch`, from the wall clock),
  so receivers restart its channel and predecessors replay their unacked batches to it;
- a keeper stays the keeper: the same identity with the same flag.

Who does it (a deterministic rule every survivor agrees on without talking): the online agent
with the lowest node name, once the node has been offline for `dead_after` seconds. It places the
instances like any createNode() (placement policy, free slots), skipping any instance that an
online node already lists (somebody re-homed it, or the node came back).

What is lost with the node: the instance's persisted protocol state. A round it was in the middle
of is not finished (its neighbours' resend on silence reaches the new incarnation, which answers as
a fresh active instance); a copy it had created but not started is adopted by the new
incarnation (agent.instance.driver: idle ping or `idle_copies`, probe, echo, `ScalingCore.adopt`),
and a copy lost while idle is re-homed idle (`plan_rehome`). A sink's id file and
a source's position file live in `sink_dir`: on a real fleet put it on shared storage, or rely on
the analytics' accounting to drop duplicate ids (docs/reliability.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from agent import wire
from agent.config import load_pipeline_text
from agent.control import records
from agent.dataplane.keygroups import MAX_GROUPS
from agent.dataplane.owners import MAX_NAME, TableError, group_runs, groups_from_runs
from agent.node import rehoming

__all__ = ["LostPlan", "responsible", "plan_lost", "plan_rehome", "encode_hosted", "decode_hosted"]


# A hosted record carries each instance's pipeline text: larger than other control payloads.
HOSTED_MAX_BYTES = 4 * wire.MAX_CONTROL_BYTES
# At most this many idle copies a re-homed creator is told to probe (agent.instance.driver
# MAX_PROBES bounds the probes it keeps waiting at once).
MAX_IDLE_COPIES = 8


def decode_rehomed(payload: bytes) -> Dict[str, float]:
    """Parse a re-homed record {instance: wall time}; raises ValueError on anything else."""
    data = wire.loads(payload or b"{}", what="re-homed record", expect=dict)
    out: Dict[str, float] = {}
    for k, v in data.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise wire.BusInputError(f"re-homed record: {str(k)[:40]!r} maps to {type(v).__name__}, not a time")
        out[str(k)] = float(v)
    return out


def responsible(me: str, online: Iterable[str]) -> bool:
    """True when `me` is the agent that re-homes for the fleet: the lowest online node name."""
    return me == min(set(online) | {me})


def encode_hosted(specs: Sequence[Mapping[str, Any]]) -> bytes:
    """The retained `agents/<node>/hosted` payload: the specs without broker settings."""
    return json.dumps(sorted((dict(s) for s in specs), key=lambda s: str(s.get("instance"))),
                      sort_keys=True).encode()


def decode_hosted(payload: bytes) -> List[Dict[str, Any]]:
    """Parse a hosted record; raises ValueError on anything that is not a list of specs."""
    data = wire.loads(payload or b"[]", what="hosted record", max_bytes=HOSTED_MAX_BYTES)
    if not isinstance(data, list) or not all(
        isinstance(s, dict) and isinstance(s.get("instance"), str) and isinstance(s.get("operator"), str)
        and isinstance(s.get("pipeline"), str) and isinstance(s.get("pipeline_toml"), str) for s in data
    ):
        raise ValueError("hosted record: expected a JSON list of instance specs")
    return data


def _operator_order(toml_text: str, cache: Dict[str, List[str]]) -> Optional[List[str]]:
    if toml_text not in cache:
        try:
            cache[toml_text] = [op.name for op in load_pipeline_text(toml_text, "hosted record").operators]
        except Exception:  # noqa: BLE001 - a record we cannot read is skipped, never fatal
            cache[toml_text] = []
    return cache[toml_text] or None


def plan_rehome(
    dead: str,
    hosted_by_node: Mapping[str, Sequence[Mapping[str, Any]]],
    online: Set[str],
    listed_online: Set[str],
    min_epoch: int,
    departing: Iterable[str] = (),
    idle: Iterable[str] = (),
    groups: Optional[Mapping[str, Any]] = None,
    handed: Optional[Mapping[str, Any]] = None,
    expecting: Optional[Mapping[str, Any]] = None,
    standby_groups: Optional[Mapping[str, Any]] = None,
    intents: Optional[Mapping[str, str]] = None,
    redirected: Optional[Mapping[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """The specs to start elsewhere for the instances of `dead` (sorted by instance id).

    `hosted_by_node`: every node's retained hosted record; `online`: the nodes online now;
    `listed_online`: instance ids an online node lists in its state (already running somewhere);
    `departing`: instances whose scaling core reports "departing" or "terminated" (their node's
    state): past the predecessor phase of their deletion, they still run (draining) or are
    about to leave the hosted records, but no predecessor may route to them any more. They stay
    out of a re-homed instance's successors: the dead predecessor had acked their Deletion, and
    its new incarnation would send records nobody processes (CHANGELOG.md, "A re-homed
    predecessor routed to a successor that was leaving").
    An instance still "deleting" stays in: its Deletion, sent again on silence, reaches the new
    incarnation, which applies it. Predecessors are never left out: a departing instance still
    sends its last records and its Deletion to its successors.

    `idle`: instances whose node's last state said idle (a copy created, not started yet; the
    lost node's last retained state for its own). A copy with a creator is re-homed idle: it
    waits for a Start, as its dead incarnation did; started active instead, a copy whose
    creator died before its Duplication reached every neighbour ran with tables some neighbours
    never applied, and its later Deletion, from a name they did not know, was never acked (the
    checker: 77 of 400 schedules, CHANGELOG.md "An idle copy re-homed together with its
    creator"). Who starts it: its creator, which every re-homed instance is told of by
    `extra["idle_copies"]` (the idle copies naming it as creator, wherever they run): its new
    incarnation probes them at once and adopts them (agent.instance.driver) before it may leave,
    so that it cannot scale in and leave a copy nobody starts.
    An idle copy stays out of a re-homed instance's successors (nothing may be routed to it
    before the Duplication of its adoption announces it), never out of its predecessors (a
    successor refuses records from a sender its tables lack).

    `groups`: per keyed instance (of `dead` and of the online nodes), the key groups
    (agent.dataplane.owners.group_runs) its node's last retained state said it owned:
    `extra["owned_groups"]`, which a re-homed keyed incarnation resumes instead of holding every
    group as a deployed keeper does (two owners of every group: it and its siblings refused each
    other's Redirects for ever), and `extra["succ_groups"]`, its successors' reports, from which a
    re-homed predecessor of keyed instances builds its group table (its saved one went with its
    node; the dealing named owners the groups had left). Not checked here: the worker reads both as
    bus input (agent.instance.core `_resume_groups`, agent.instance.groups `restored_table`). A
    group moving out is reported by its old owner at its version before the move until the move's
    last Eos (agent.instance.moves `reported_groups`). A copy of a keyed operator that its node's
    last state did not list (created just before the loss) is told it owns no group.

    `handed`: per keyed instance, the groups it last said it had handed out and not seen
    installed yet ([group, new owner, version]: every predecessor's Eos was in, so their tables
    named the new owner). Reported by neither side otherwise; the successors' reports a
    re-homed predecessor gets name the new owner for them (`_with_handed`).

    `expecting`: per keyed instance, the groups on their way to it ([group, old owner,
    version]). A re-homed keyed instance resumes its groups without those a live sibling
    reports at a newer version (moved on since its node's last state), and with those a live
    sibling expects from it, whose moves it starts again (`extra["moves_out"]`: its dead
    incarnation's memory of them went with its node, and the new owner waited for ever).

    `redirected`: per predecessor of keyed instances, the Redirects it took lately ([group, old
    owner, new owner, version], agent.instance.groups `GroupRouting.redirected`). A move whose
    old owner was lost before it reported it, its new owner never having installed the group,
    is one its new owner expects (`_expected_from_redirects`): the old owner resumes the group
    and starts the move again, as for an `expecting` entry.

    `standby_groups`: per keyed instance of `dead`, the groups its standby copy says it owns (the
    ownership saved with its keyed state, agent.node.replicas `ReplicaStore.owned`). A group is
    confirmed Installed to its old owner only once the save that installed it is copied, so a
    copy is the durable word on what moved in, while the node's last state may predate the move
    (a copy created and handed its share just before the loss, not listed at all). Each lost
    instance resumes its report and its copy's groups together, each group at the newer version
    of the two; a group another instance (live, or lost with a newer copy) holds at a newer
    version is not its: the old owner of a move both of whose ends were on the lost node gives
    up a group its copy has forgotten, and the new owner takes it with its state.

    `intents`: per lock-guarded instance (`coordination = "fgme"`), the round ("duplicate" or
    "terminate") its node's last state said it had decided and was waiting to start (an intent
    waits for its 2-FGME locks; a decision of the "ack" core starts at once). The intent is in
    the instance's files only, so a re-homed incarnation never ran it: a `fogctl scale` the
    instance had accepted was lost with its node (the checker: a planned duplication never
    started, CHANGELOG.md). An active re-homed instance gets it as `extra["lock_intent"]` and
    runs it as a forced round (agent.instance.driver).
    """
    gone = set(departing)
    # A copy its node last said was idle, whose standby copy says it owns groups, started since:
    # re-homed idle it stayed out of its predecessors' successors with groups nobody else holds.
    started = {str(i) for i, runs in (standby_groups or {}).items() if isinstance(runs, list) and runs}
    waiting = set(idle) - started
    copies: Dict[str, List[str]] = {}  # creator -> its idle copies
    cache: Dict[str, List[str]] = {}
    members: Dict[Tuple[str, str], Set[str]] = {}
    for node, specs in hosted_by_node.items():
        if node != dead and node not in online:
            continue
        for s in specs:
            members.setdefault((str(s["pipeline"]), str(s["operator"])), set()).add(str(s["instance"]))
            creator = _creator(s)
            if creator and s["instance"] in waiting:
                copies.setdefault(creator, []).append(str(s["instance"]))
    alive = {str(s["instance"]) for node, specs in hosted_by_node.items() if node != dead and node in online
             for s in specs}
    # The groups each keyed instance of the lost node resumes and the moves it starts again
    # (`_resume_plan`); what its re-homed predecessors are told it owns is the same.
    lost = [s for s in hosted_by_node.get(dead, ()) if s["instance"] not in listed_online]
    # who may wait for a group from a lost instance: a live sibling, or one lost with it (a move
    # with both ends on the lost node: the new owner's report says what its standby copy lacks)
    waiting_for = alive | {str(s["instance"]) for s in lost}
    owned_reports: Dict[str, Any] = dict(groups or {})
    moves_out: Dict[str, List[List[Any]]] = {}
    resumed: Dict[str, Any] = {}
    for s in lost:
        inst = str(s["instance"])
        runs = _newest(owned_reports.get(inst), (standby_groups or {}).get(inst))
        if runs is None and _creator(s) and any(i in owned_reports for i in members.get(
                (str(s["pipeline"]), str(s["operator"])), ())):
            # A copy of a keyed operator that neither its node's last state nor a standby copy
            # lists (created just before the loss): no group was installed there as far as anyone
            # reported, so it owns none. The dealing made it a second owner of every group
            # ("handing 128 key groups"), and it and its siblings refused each other's Redirects
            # for ever.
            runs = []
        if runs is not None:
            resumed[inst] = runs
    rivals = {**dict(groups or {}), **resumed}  # live reports, and the lost instances' newest word
    expecting = _expected_from_redirects(expecting, redirected, resumed, rivals)
    moved_on: Dict[str, Any] = {}
    for s in lost:
        inst = str(s["instance"])
        if inst in resumed:
            owned_reports[inst], moves_out[inst] = _resume_plan(inst, runs=resumed[inst], groups=rivals,
                                                                expecting=expecting, alive=alive,
                                                                lost=set(resumed), waiting_for=waiting_for)
            siblings = members.get((str(s["pipeline"]), str(s["operator"])), set()) - {inst}
            moved_on[inst] = _moved_on(inst, siblings, rivals, handed, expecting)
    # with the groups handed out under their new owners, and the groups nobody reports given to
    # the lost node's keeper (`_unreported_to_keepers`)
    reports = _with_handed(owned_reports, handed)
    fill = _unreported_to_keepers(lost, members, reports)
    owned_reports = _added(owned_reports, fill)
    reports = _added(reports, fill)
    out: List[Dict[str, Any]] = []
    for s in sorted(hosted_by_node.get(dead, ()), key=lambda x: str(x["instance"])):
        if s["instance"] in listed_online:
            continue
        order = _operator_order(str(s["pipeline_toml"]), cache)
        if order is None or s["operator"] not in order:
            continue
        i = order.index(str(s["operator"]))
        pipeline = str(s["pipeline"])
        preds = sorted(members.get((pipeline, order[i - 1]), ())) if i > 0 else []
        succs = sorted(members.get((pipeline, order[i + 1]), set()) - gone - waiting) if i + 1 < len(order) else []
        extra = dict(s.get("extra") or {})
        extra["min_epoch"] = max(int(extra.get("min_epoch", 0) or 0), int(min_epoch))
        mine = sorted(c for c in copies.get(str(s["instance"]), ()) if c.startswith(str(s["operator"]) + "-"))
        if mine:
            extra["idle_copies"] = mine[:MAX_IDLE_COPIES]
        else:
            extra.pop("idle_copies", None)
        owned = owned_reports.get(str(s["instance"]))
        extra.pop("moves_out", None)
        extra.pop("moved_on", None)
        if owned is not None:
            extra["owned_groups"] = owned
            if moves_out.get(str(s["instance"])):
                extra["moves_out"] = moves_out[str(s["instance"])]
            if moved_on.get(str(s["instance"])):
                extra["moved_on"] = moved_on[str(s["instance"])]
        else:
            extra.pop("owned_groups", None)
        reported = {i: reports[i] for i in succs if i in reports}
        if reported:  # a predecessor of keyed instances: its group table from what they own
            extra["succ_groups"] = reported
        else:
            extra.pop("succ_groups", None)
        active = not (s["instance"] in waiting and _creator(s) and not s.get("keeper"))
        intent = (intents or {}).get(str(s["instance"]))
        if active and intent in ("duplicate", "terminate"):
            extra["lock_intent"] = intent
        else:
            extra.pop("lock_intent", None)
        out.append({**s, "succs": succs, "preds": preds, "restart": True, "active": active, "extra": extra})
    return out


def _move_entries(entries: Any) -> List[Tuple[int, str, int]]:
    """The [group, instance, version] entries of a report's `handed` or `expecting` list (bus
    input: at most MAX_GROUPS read, an entry of another shape skipped; an instance name and a
    version >= 0, each caller checks more where it needs to)."""
    if not isinstance(entries, list):
        return []
    return [(e[0], e[1], e[2]) for e in entries[:MAX_GROUPS]
            if isinstance(e, list) and len(e) == 3 and type(e[0]) is int and 0 <= e[0] < MAX_GROUPS
            and isinstance(e[1], str) and type(e[2]) is int and 0 <= e[2] < 2 ** 53]


def _with_handed(groups: Optional[Mapping[str, Any]], handed: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The owners' reports (`groups`) with each group an old owner handed out (`handed`, bus
    input: malformed entries skipped) added to its new owner's, at the move's version, unless
    that owner reports it at that version or a newer one already."""
    adds: Dict[str, Dict[int, int]] = {}
    for entries in (handed or {}).values():
        for g, new, v in _move_entries(entries):
            if 0 < len(new) <= MAX_NAME:
                d = adds.setdefault(new, {})
                d[g] = max(d.get(g, -1), v)
    return _added(groups, adds)


def _key_groups(toml_text: str, operator: str) -> Optional[int]:
    try:
        ops = {op.name: op for op in load_pipeline_text(toml_text, "hosted record").operators}
    except Exception:  # noqa: BLE001 - a record we cannot read is skipped, never fatal
        return None
    op = ops.get(operator)
    return int(op.key_groups) if op is not None else None


def _unreported_to_keepers(lost: Sequence[Mapping[str, Any]], members: Mapping[Tuple[str, str], Set[str]],
                           reports: Mapping[str, Any]) -> Dict[str, Dict[int, int]]:
    """The key groups no instance of a keyed operator reports, for the operator's keeper when it
    was on the lost node: {keeper: {group: 0}}. A live instance's report is fresh, and a group
    on its way between live instances is reported by one side (`reported_groups`, `handed`);
    the lost node's last state is up to a state period old, so a group missing from every report
    moved onto the lost node after it (a leaver's group installed at the keeper, the leaver gone
    since: the keeper's Installed leaves only once its standby holds the group, so the standby
    copy has it). Leavers hand their groups to the keeper, which never terminates; only when
    every other instance of the operator on the lost node reported (or is a copy that said
    nothing, which owns no group: `plan_rehome`) can the keeper be the one holding them. Version 0:
    the re-homed keeper and the re-homed predecessors take it alike, and nobody else holds the
    group. Without it the re-homed predecessor dealt its whole table again (chaos
    --pipeline stateful-scaling, seed 1: "16 groups reported by no instance")."""
    out: Dict[str, Dict[int, int]] = {}
    for s in lost:
        if not s.get("keeper"):
            continue
        inst, key = str(s["instance"]), (str(s["pipeline"]), str(s["operator"]))
        names = members.get(key, set())
        if not any(i in reports for i in names):
            continue  # not a keyed operator, or nothing reported: nothing known
        if any(str(o["instance"]) not in reports and not _creator(o) for o in lost
               if (str(o["pipeline"]), str(o["operator"])) == key and o is not s):
            continue  # another instance of the lost node said nothing: the groups may be its
        n = _key_groups(str(s["pipeline_toml"]), str(s["operator"]))
        if n is None:
            continue
        seen: Set[int] = set()
        for i in names:
            try:
                seen |= set(groups_from_runs(reports.get(i, []), n))
            except TableError:
                seen = set(range(n))  # a report we cannot read: guess nothing
                break
        missing = set(range(n)) - seen
        if missing:
            out[inst] = {g: 0 for g in missing}
    return out


def _added(reports: Optional[Mapping[str, Any]], adds: Mapping[str, Mapping[int, int]]) -> Dict[str, Any]:
    """`reports` with each instance's `adds` ({group: version}) in its runs, where its report
    does not name the group at that version or a newer one (a report that does not parse is left
    as it is: the worker refuses it as a whole anyway)."""
    out = dict(reports or {})
    for inst, add in sorted(adds.items()):
        try:
            mine = groups_from_runs(out.get(inst, []))
        except TableError:
            continue
        for g, v in add.items():
            if mine.get(g, -1) < v:
                mine[g] = v
        out[inst] = group_runs(mine)
    return out


def _newest(report: Any, copy: Any) -> Any:
    """A lost instance's report and its standby copy's groups together, each group at the newer
    version of the two; None when neither names any; a report that does not parse as it is (the
    worker refuses it), a copy's that does not parse ignored."""
    if copy is None:
        return report
    try:
        theirs = groups_from_runs(copy)
    except TableError:
        return report
    if report is None:
        return group_runs(theirs)
    return _added({"i": report}, {"i": theirs})["i"]


def _resume_plan(inst: str, runs: Any, groups: Optional[Mapping[str, Any]], expecting: Optional[Mapping[str, Any]],
                 alive: Set[str], lost: Set[str] = frozenset(),
                 waiting_for: Optional[Set[str]] = None) -> Tuple[Any, List[List[Any]]]:
    """The groups a re-homed keyed instance resumes (runs) and the moves it starts again: its
    last report less what a live sibling (or another instance of the `lost` node, from its
    newest word) reports at a newer version, plus each group a sibling expects from it
    (`waiting_for`: live ones and those lost with it; default the live ones), at the version
    before that move. A sibling lost with it expects a group whose state its standby copy does
    not hold (still on its way, or installed with its Installed waiting for the copy:
    agent.instance.moves `stats`), while our standby copy still holds it (we forget a group we
    handed out only at its Installed): we resume it and send it again, as to a live one; not
    when that sibling's newest word (its standby copy) already owns the group at that move's
    version. Bus input: a report that does not parse is passed on as it is (the worker refuses
    it as a whole)."""
    try:
        mine = groups_from_runs(runs)
    except TableError:
        return runs, []
    for other in sorted((alive | lost) - {inst}):
        try:
            theirs = groups_from_runs((groups or {}).get(other, []))
        except TableError:
            continue
        for g, v in theirs.items():
            if g in mine and v > mine[g]:
                del mine[g]
    moves: List[List[Any]] = []
    for new in sorted((alive if waiting_for is None else waiting_for) - {inst}):
        entries = _move_entries((expecting or {}).get(new))
        if not entries:
            continue
        try:
            held = groups_from_runs((groups or {}).get(new, [])) if new in lost else {}
        except TableError:
            held = {}
        for g, old, v in entries:
            if old == inst and v >= 1 and held.get(g, 0) < v:
                mine[g] = v - 1
                moves.append([g, new, v])
    return group_runs(mine), sorted(moves)


def _expected_from_redirects(expecting: Optional[Mapping[str, Any]], redirected: Optional[Mapping[str, Any]],
                             resumed: Mapping[str, Any], rivals: Mapping[str, Any]) -> Dict[str, Any]:
    """`expecting` with the moves the predecessors' Redirects show that no report does: a
    Redirect of group g from a lost instance that resumes g at the version just before it, to
    a new owner that holds g at no version as new and does not say it expects g. That new owner
    waits for g (its records go to it, held there until the state comes); the lost old owner's
    new incarnation must send g again (`_resume_plan`). This is the move whose two ends were on
    the lost node while the copy had not reported its share yet: otherwise the old owner resumes
    g as its own, hands it to its keeper later, and the predecessor refuses that Redirect for
    ever ("which does not own it"; CHANGELOG.md, "A move only the predecessor had seen begin was
    forgotten when both its ends were lost"). Bus input: entries of another shape are skipped."""
    out: Dict[str, Any] = {k: list(v) for k, v in (expecting or {}).items() if isinstance(v, list)}
    tables: Dict[str, Optional[Dict[int, int]]] = {}  # instance -> its groups (rivals), read once
    waits: Dict[str, Set[int]] = {}  # new owner -> the groups it expects already, read once

    def held(inst: str) -> Optional[Dict[int, int]]:
        if inst not in tables:
            try:
                tables[inst] = groups_from_runs(rivals.get(inst) or [])
            except TableError:
                tables[inst] = None
        return tables[inst]

    for entries in (redirected or {}).values():
        if not isinstance(entries, list):
            continue
        for e in entries[:MAX_GROUPS]:
            if not (isinstance(e, list) and len(e) == 4 and type(e[0]) is int and isinstance(e[1], str)
                    and isinstance(e[2], str) and type(e[3]) is int and 0 < len(e[2]) <= MAX_NAME):
                continue
            g, old, new, v = e
            if old not in resumed or old == new:
                continue
            mine, theirs = held(old), held(new)  # rivals[old] is resumed[old]
            if mine is None or theirs is None or mine.get(g) != v - 1 or theirs.get(g, -1) >= v:
                continue
            if new not in waits:
                waits[new] = {x[0] for x in _move_entries(out.get(new))}
            if g in waits[new]:
                continue
            waits[new].add(g)
            out.setdefault(new, []).append([g, old, v])
    return out


def _moved_on(inst: str, siblings: Set[str], groups: Mapping[str, Any], handed: Optional[Mapping[str, Any]],
              expecting: Optional[Mapping[str, Any]]) -> List[List[int]]:
    """For a re-homed keyed instance: per group, the newest version its siblings know of
    (runs): a move of the group towards us at that version or an older one is over, whoever
    still sends it. A group's version rises by one at each move along its one chain of owners,
    so a sibling holding it at v (or moving it on from v: `reported_groups`), handing it out at
    v, or expecting it at v, shows that every move up to v is past; a move a sibling hands
    towards `inst` itself at v is still to come (v - 1). Our dead incarnation's memory of the
    moves it completed (`GroupMoves.seen`) went with its node: without this, a leaver whose
    Installed of a move long over was lost sends its chunks again, and the re-homed incarnation
    would take them as a new move (the Offer "lost in our crash"), install the group's old state
    over the windows of the owners since, and answer the group's real move back Installed
    (CHANGELOG.md, "A re-homed new owner took a move long over again from a leaver's chunks").
    Bus input: reports and entries that do not parse are skipped (a lower floor only takes away
    the check)."""
    floor: Dict[int, int] = {}

    def seen(g: int, v: int) -> None:
        if 0 <= v and floor.get(g, -1) < v:
            floor[g] = v

    for other in sorted(siblings):
        try:
            theirs = groups_from_runs((groups or {}).get(other, []))
        except TableError:
            theirs = {}
        for g, v in theirs.items():
            seen(g, v)
        for table in (handed, expecting):
            for g, name, v in _move_entries((table or {}).get(other)):
                # handed [group, new owner, v]: towards us still to come; expecting [group, old
                # owner, v]: a sibling's, never towards us
                seen(g, v - 1 if table is handed and name == inst else v)
    return group_runs(floor)


def _creator(spec: Mapping[str, Any]) -> str:
    """The creator a copy's hosted record names ("" for an instance deployed with the pipeline)."""
    extra = spec.get("extra")
    creator = extra.get("creator") if isinstance(extra, dict) else None
    return creator if isinstance(creator, str) and not spec.get("keeper") else ""


@dataclass(frozen=True)
class LostPlan:
    """What the responsible agent does for one lost node (`plan_lost`): `planned`, every instance
    of the plan (our re-homed record names them); `start`, the specs to admit and start, with the
    text the admin deployed; `skipped`, (instance, why) of those their pipeline's record rules out;
    `idle`, the instances re-homed idle; `told`, the creators told of idle copies."""

    planned: Tuple[str, ...] = ()
    start: Tuple[Dict[str, Any], ...] = ()
    skipped: Tuple[Tuple[str, str], ...] = ()
    idle: Tuple[str, ...] = ()
    told: Tuple[str, ...] = ()


def plan_lost(me: str, lost: str, hosted_by_node: Mapping[str, Sequence[Mapping[str, Any]]],
              fleet: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool], local: Mapping[str, Any],
              listed: Set[str], min_epoch: int, standby_groups: Mapping[str, Any],
              pipeline_records: Mapping[str, Any], deployed_text: Mapping[str, str]) -> LostPlan:
    """`plan_rehome` of `lost` on the fleet as this agent sees it (`local`: our workers' last
    stats; `listed`: instances that run or are asked for somewhere), then what of it starts: an
    instance of an undeployed pipeline, or of another deploy's generation, does not come back
    through a dead node's record (records.stale_reason); the others carry the admin's text of
    their pipeline where this agent has it, not the one the dead node's record carries."""
    up = {n for n, u in online.items() if u} | {me}
    plan = plan_rehome(lost, hosted_by_node, up, listed, min_epoch, standby_groups=standby_groups,
                       **rehoming.plan_inputs(me, local, fleet, online, lost))
    start: List[Dict[str, Any]] = []
    skipped: List[Tuple[str, str]] = []
    for data in plan:
        pipeline = str(data.get("pipeline"))
        stale = records.stale_reason(records.spec_generation(data), pipeline_records.get(pipeline))
        if stale:
            skipped.append((str(data.get("instance")), stale))
            continue
        text = deployed_text.get(pipeline)
        start.append(data if text is None else dict(data, pipeline_toml=text))
    return LostPlan(planned=tuple(str(d["instance"]) for d in plan), start=tuple(start), skipped=tuple(skipped),
                    idle=tuple(sorted(str(d["instance"]) for d in plan if not d.get("active"))),
                    told=tuple(sorted(str(d["instance"]) for d in plan
                                      if (d.get("extra") or {}).get("idle_copies"))))
