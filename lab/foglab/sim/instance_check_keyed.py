"""The keyed mode of the instance checker (foglab.sim.instance_check, `Config(keyed=True)`).

The keyed pipeline: source -> op -> cnt -> sink, cnt a keyed operator (`MemoryTrail`: per key
the list of records applied) whose key groups move with their state when it scales
(agent.instance.moves); cnt and op scale at once (`KEYED_PLANS`). Checked besides the checker's
own invariants (`check_keyed`): every group at one instance, the one every predecessor's table
names, no move under way; each key's state holds each of its records once, each path's records
in order; the sink got every key's counts 1..n and no output id with two records
(docs/operators.md, "Key groups that move"). The keyed files live on a scratch disk per world
(`new_disk`): `KeyedState.save` writes them as the worker does, and a crash restarts from them.

Kept apart from the checker's world so that the keyed rules read in one place; the world calls
these (no import back: this module knows nothing of `World`).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from agent.operators.keyed import KeyedOperator

__all__ = ["KEEPER", "KEY_GROUPS", "KEYED_PLANS", "MemoryTrail", "check_floor", "check_keyed", "count_handover", "new_disk",
           "copy_disk", "disk_digest", "keyed_path"]

# source -> op (key "k") -> cnt (keyed, KEY_GROUPS groups) -> sink. The keyed operator's first
# instance is its keeper, named as the agent names it: a leaver hands its groups to
# `<pipeline>.<operator>.0` (agent.instance.driver).
KEEPER = "chk.cnt.0"
KEY_GROUPS = 8
# op and cnt both scale, concurrently: cnt 1 -> 2 (its share moves), op 1 -> 2 during those moves
# (a predecessor joins: `add_pred`), then the cnt copy leaves (its groups go to the keeper) and
# op's copy too (a predecessor leaves: `remove_pred`); the plans run as soon as their target is
# active, so each meets the moves of the others at random points.
KEYED_PLANS = ((KEEPER, "duplicate"), ("op-0", "duplicate"), ("copy:cnt", "terminate"), ("copy:op", "terminate"))

_HANDOVER_MARKS = (b'"redirect"', b'"eos"', b'"offer"', b'"state_chunk"', b'"installed"')


class MemoryTrail(KeyedOperator):
    """The keyed operator of the keyed pipeline: per key, the list of (record number, the
    instance it came through) applied, in order; one output per record, `{"key", "count", "n"}`.
    The final states show every update and its order (exactly once, per key in each path's
    order), the outputs every id and value the sink got. With event time (`time_field` "n"),
    the numbers of the records judged late go to `late`."""

    def __init__(self, ctx: Any, late: Optional[List[int]] = None) -> None:
        super().__init__(ctx)
        self.late = late if late is not None else []

    def on_late(self, record: Any) -> Optional[Any]:
        self.late.append(record.get("n") if isinstance(record, dict) else -1)
        return None

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        trail = list(state or [])
        out = []
        for rec in records:
            trail.append([rec["n"], rec.get("via")])
            out.append({"key": key, "count": len(trail), "n": rec["n"]})
        return out, trail


def count_handover(counts: Dict[str, int], payload: bytes) -> None:
    """Coverage: the hand-over message types `payload` carries, added to `counts`."""
    for kind in _HANDOVER_MARKS:
        if kind in payload:
            name = kind.decode().strip('"')
            counts[name] = counts.get(name, 0) + 1


# ---- the keyed files, on a scratch disk per world ------------------------------------------------


def new_disk(owner: object) -> str:
    """A scratch directory removed with `owner`."""
    disk = tempfile.mkdtemp(prefix="instance-check-")
    weakref.finalize(owner, shutil.rmtree, disk, True)
    return disk


def copy_disk(disk: str, owner: object) -> str:
    """A forked world's own copy of the keyed files."""
    other = new_disk(owner)
    shutil.copytree(disk, other, dirs_exist_ok=True)
    return other


def disk_digest(disk: str) -> bytes:
    """The files, not their place (two forks with the same files are one state)."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(Path(disk).iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.digest()


def keyed_path(disk: str, iid: str) -> Path:
    return Path(disk) / f"{iid}.keyed.json"


# ---- the terminal check --------------------------------------------------------------------------


def check_floor(source: Any, values: Dict[Tuple[str, int], Any]) -> Optional[Tuple[str, str]]:
    """After every move: the source's floor claim (agent.instance.applied: every record below it
    acked end to end) passes no record whose output has not reached the sink. A keyed operator
    downstream skips every number below the claim as a replay: a claim ahead of a record still
    on its way loses it there (CHANGELOG.md, "Held records acked before their outputs")."""
    floor = source.source_resume_seq()
    reached = {v["n"] for v in values.values() if isinstance(v, dict) and isinstance(v.get("n"), int)}
    ahead = [n for n in range(floor) if n not in reached]
    if ahead:
        return ("acked_before_sink", f"the source claims every record below {floor} acked end to end; "
                f"records {ahead[:8]} have not reached the sink")
    return None


def check_keyed(insts: Dict[str, Any], records: int, keys: int, store: List[Tuple[str, int]],
                values: Dict[Tuple[str, int], Any], conflicts: Iterable[Any]) -> Optional[Tuple[str, str]]:
    """The keyed pipeline's end: every group at one instance (the one every predecessor's
    table names, no move under way), each key's state holding each of its records exactly
    once and, per path (the op instance it came through), in source order; the sink got
    every key's outputs 1..n, no id with two records (`conflicts`: the sinks' ids that came
    again with another record)."""
    holders: Dict[int, str] = {}
    trails: Dict[Any, List[Any]] = {}
    for iid, inst in sorted(insts.items()):
        if inst.moves is None:
            continue
        m = inst.moves.member
        if m.busy() or inst.moves.leaving or inst.moves.held:
            return ("move_not_ended", f"{iid}: moving {sorted(m.old.moving)}, awaiting Installed "
                    f"{sorted(m.old.waiting_install)}, expecting {sorted(m.new.expected)}, early {sorted(m.early)}, "
                    f"leaving {inst.moves.leaving}, held {inst.moves.held}")
        for g in m.owned:
            if g in holders:
                return ("group_twice", f"group {g} held by {holders[g]} and {iid}")
            holders[g] = iid
        stray = (set(inst.keyed.states) | set(inst.keyed.emitted)) - m.owned
        if stray:
            return ("group_twice", f"{iid} keeps the state of groups {sorted(stray)} it does not hold")
        for g, per_key in inst.keyed.states.items():
            for key, trail in per_key.items():
                trails[key] = trail
    if set(holders) != set(range(KEY_GROUPS)):
        return ("group_lost", f"groups {sorted(set(range(KEY_GROUPS)) - set(holders))} held by no instance")
    for iid, inst in sorted(insts.items()):
        table = inst.router.table if inst.next_keyed else None
        if table is None:
            continue
        wrong = {g: table.owner(g) for g in range(KEY_GROUPS) if table.owner(g) != holders[g]}
        if wrong:
            return ("tables_disagree", f"{iid} routes groups {wrong} (held by {[holders[g] for g in wrong]})")
    for key in sorted({f"k{n % keys}" for n in range(records)}):
        want = [n for n in range(records) if f"k{n % keys}" == key]
        trail = trails.get(key, [])
        if sorted(n for n, _ in trail) != want:
            return ("state_not_exactly_once", f"key {key}: applied {[n for n, _ in trail]}, records {want}")
        for via in {v for _, v in trail}:
            path = [n for n, v in trail if v == via]
            if path != sorted(path):
                return ("key_order", f"key {key}: records through {via} applied in the order {path}")
    conflicts = list(conflicts)
    if conflicts:
        return ("output_id_twice", f"output ids {conflicts[:4]} came with two different records")
    counts: Dict[Any, List[int]] = {}
    for rid in store:
        rec = values[rid]
        counts.setdefault(rec["key"], []).append(rec["count"])
    for key, trail in sorted(trails.items()):
        if sorted(counts.get(key, [])) != list(range(1, len(trail) + 1)):
            return ("outputs_not_exactly_once", f"key {key}: counts at the sink {sorted(counts.get(key, []))}, "
                    f"{len(trail)} records applied")
    return None
