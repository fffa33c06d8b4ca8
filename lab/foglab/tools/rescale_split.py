"""decision -> first record of a scale-out, per operator, and for a keyed operator split into its
parts (`fog-agent demo`'s summary, docs/measurement.md "decision -> first record in the demo").

Why apart from the total: the demo's pipeline scales a stateless operator (`in_zone`) and a
keyed one (`route_counts`) whose copy applies nothing before its share of key groups is
installed (agent.instance.moves). One median over both hid which one was slow and why.

Every stamp is wall time taken by a worker on this machine (the demo's agents share it):
- the creator's decision record (agent.instance.driver): `at` (decided), `spawned_at` (the agent
  answered that the copy's worker is up and subscribed), `chunks_at` (a keyed
  creator has every predecessor's Eos of a group and sends its state: its first group);
- the copy's stats: `activated_at` (its Start arrived), `first_installed_at` (its first group's
  state installed), `first_record_at` (its first processed record), for a keyed copy
  `first_applied_at` instead (the records that arrive before an install are held, not applied).

Parts of one scale-out (with several copies, the earliest copy's stamp counts, as the total):
    round        decision -> copy started, itself made of
      spawn        decision -> the copy's worker up (forked by the agent's fork server, or a cold start)
      announce     worker up -> its Start (the Duplication to every neighbour, their acks: a
                   neighbour handles it behind the data its sender queued there before, FIFO)
    handover     copy started -> its first group installed (keyed only), itself made of
      eos_wait     copy started -> the creator's first chunks (each predecessor's Eos reaches the
                   creator behind the data it queued there before, FIFO: invariant 1)
      transfer     the chunks -> installed at the copy (broker hop, state writes)
    first        keyed: installed -> first record; stateless: started -> first record
round + handover + first = total for every scale-out that has every stamp.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

__all__ = ["FIRST_KEYED", "rescale_by_operator", "split_one"]

# A keyed copy's first record: the first it applied. Its `first_record_at` is the first that
# arrived, held until its group's state is installed (agent.instance.moves `first_applied_at`).
FIRST_KEYED = "first_applied_at"
PARTS_KEYED = ("round", "spawn", "announce", "handover", "eos_wait", "transfer", "first")
PARTS_STATELESS = ("round", "spawn", "announce", "first")


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _earliest(copies: Sequence[Dict[str, Any]], key: str) -> Optional[float]:
    vals = [v for v in (_num(c.get(key)) for c in copies) if v is not None]
    return min(vals) if vals else None


def split_one(decision: Dict[str, Any], copies: Sequence[Dict[str, Any]], keyed: bool) -> Optional[Dict[str, Any]]:
    """The parts (seconds) of one scale-out decision, None when it has no first record."""
    at = _num(decision.get("at"))
    first = _earliest(copies, FIRST_KEYED if keyed else "first_record_at")
    if at is None or first is None:
        return None
    row: Dict[str, Optional[float]] = {"total": first - at}
    act = _earliest(copies, "activated_at")
    row["round"] = act - at if act is not None else None
    spawned = _num(decision.get("spawned_at"))
    row["spawn"] = spawned - at if spawned is not None else None
    row["announce"] = act - spawned if act is not None and spawned is not None else None
    if keyed:
        inst = _earliest(copies, "first_installed_at")
        chunks = _num(decision.get("chunks_at"))
        row["handover"] = inst - act if inst is not None and act is not None else None
        row["eos_wait"] = chunks - act if chunks is not None and act is not None else None
        row["transfer"] = inst - chunks if inst is not None and chunks is not None else None
        row["first"] = first - inst if inst is not None else None
    else:
        row["first"] = first - act if act is not None else None
    return {k: (round(v, 3) if v is not None else None) for k, v in row.items()}


def _median_max(values: List[float]) -> Dict[str, Any]:
    v = sorted(values)
    return {"median": round(v[len(v) // 2], 3) if v else None, "max": round(v[-1], 3) if v else None, "n": len(v)}


def rescale_by_operator(stats: Dict[str, Dict[str, Any]], operator_of: Dict[str, str],
                        warm: Optional[Dict[str, Optional[float]]] = None,
                        ready: Optional[Dict[str, Optional[float]]] = None) -> Dict[str, Any]:
    """{operator: {"keyed", "decision_to_first_record_s": {median, max, n}, "parts_median_s": {...},
    "cold_spawns", "each": [row, ...]}} over every scale-out decision found in `stats` (instance ->
    its last stats, exited instances included), the operator of each instance from `operator_of`;
    `warm`: instance -> seconds since the fork server that forked it had started, None for a cold
    start (its "spawned" event; docs/runtime.md "Pre-started workers"): a row says "cold" when one
    of its copies was a cold start (a python start and imports, seconds on a loaded machine) and
    "warm_age" the smallest age among them (before the fork server: the age of the one pre-started
    spare, and a young one was still importing). `ready`: instance -> seconds from the agent's
    start of its worker to its "ready" (the "spawned" event's `start_to_ready_s`): a row's
    "start_to_ready" is its slowest copy's (the round waits for every copy), the part of `spawn`
    that is the worker's own start; the rest is the spawn request's way through the agents
    (placement, a peer's request over MQTT) and the answer's."""
    warm = warm or {}
    ready = ready or {}
    rows: Dict[str, List[Dict[str, Any]]] = {}
    keyed_ops: Dict[str, bool] = {}
    for inst, st in stats.items():
        op = operator_of.get(inst, "")
        # a keyed instance reports its hand-over (agent.instance.moves.GroupMoves.stats)
        keyed = isinstance(st.get("handover"), dict)
        for d in st.get("decisions", []) or []:
            if not isinstance(d, dict) or d.get("kind") != "scale_out" or not isinstance(d.get("new"), list):
                continue
            row = split_one(d, [stats.get(str(n), {}) for n in d["new"]], keyed)
            if row is not None:
                row["cold"] = any(str(n) in warm and warm[str(n)] is None for n in d["new"])
                ages = [a for a in (warm.get(str(n)) for n in d["new"]) if a is not None]
                row["warm_age"] = min(ages) if ages else None
                starts = [s for s in (ready.get(str(n)) for n in d["new"]) if s is not None]
                row["start_to_ready"] = max(starts) if starts else None
                rows.setdefault(op, []).append(row)
                keyed_ops[op] = keyed
    out: Dict[str, Any] = {}
    for op in sorted(rows):
        each = rows[op]
        parts = PARTS_KEYED if keyed_ops[op] else PARTS_STATELESS
        out[op] = {
            "keyed": keyed_ops[op],
            "decision_to_first_record_s": _median_max([r["total"] for r in each]),
            "parts_median_s": {p: _median_max([r[p] for r in each if r.get(p) is not None])["median"] for p in parts},
            "cold_spawns": sum(1 for r in each if r["cold"]),
            "each": each,
        }
    return out
