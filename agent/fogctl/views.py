"""Pure views: a `Fleet` snapshot (and a time) in, a JSON document and a human table out.

Why the split from the commands: the same view is asserted in tests in both forms, and the JSON
form is the contract for scripts (documented in docs/fogctl.md); the table is derived from the
same rows so that the two never disagree.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from agent.events import Event
from agent.fogctl.fleet import Fleet, Instance, LockState
from agent.fogctl.render import fmt_age, fmt_num, table

__all__ = ["status", "topology", "topology_tree", "latency", "locks", "pipelines", "event_line", "Doc"]

Doc = Dict[str, Any]


def status(fleet: Fleet, now: float) -> Tuple[Doc, str]:
    doc = {"cluster": fleet.cluster, "nodes": [n.to_dict(now) for n in fleet.nodes]}
    rows = []
    for n in fleet.nodes:
        slots = "-" if n.slots is None else f"{n.free_slots if n.free_slots is not None else '-'}/{n.slots}"
        rows.append([
            n.node, n.status if not n.error else f"{n.status} (bad state: {n.error})",
            fmt_num(n.cpu), fmt_num(n.memory), fmt_num(n.temperature), slots, fmt_num(n.capacity),
            len(n.instances), ",".join(i.id for i in n.instances) or "-", fmt_age(n.last_seen(now)),
        ])
    text = table(["NODE", "STATUS", "CPU%", "MEM%", "TEMP_C", "FREE/SLOTS", "CAPACITY", "N", "INSTANCES", "LAST_SEEN"], rows)
    if not fleet.nodes:
        text = f"no agents found on fog/{fleet.cluster}/agents/+/state (wrong --cluster?)"
    return doc, text


def _pipelines_of(fleet: Fleet, pipeline: Optional[str]) -> List[Optional[str]]:
    if pipeline:
        return [pipeline]
    names = sorted({i.pipeline for i in fleet.instances if i.pipeline} | set(fleet.pipelines))
    if any(i.pipeline is None for i in fleet.instances):
        names.append(None)
    return names  # type: ignore[return-value]


def _instances(fleet: Fleet, pipeline: Optional[str], operator: str) -> List[Instance]:
    return sorted((i for i in fleet.instances if i.pipeline == pipeline and i.operator == operator),
                  key=lambda i: (not i.keeper, i.id))


def topology(fleet: Fleet, pipeline: Optional[str] = None) -> Tuple[Doc, str]:
    doc: Doc = {"cluster": fleet.cluster, "pipelines": []}
    rows = []
    for name in _pipelines_of(fleet, pipeline):
        ops = []
        for op in fleet.operator_order(name):
            insts = _instances(fleet, name, op)
            if not insts and name not in fleet.pipelines:
                continue
            loads = [i.load for i in insts if i.load is not None]
            ops.append({"operator": op, "count": len(insts), "load": sum(loads) if loads else None,
                        "instances": [i.to_dict() for i in insts]})
            for i in insts:
                rows.append([name or "-", op, i.id, i.node, "keeper" if i.keeper else "", i.phase.value,
                             fmt_num(i.load), fmt_num(i.capacity), fmt_num(i.ratio, 2)])
        doc["pipelines"].append({"pipeline": name, "operators": ops})
    text = table(["PIPELINE", "OPERATOR", "INSTANCE", "NODE", "KEEPER", "PHASE", "LOAD", "CAPACITY", "RATIO"], rows)
    if not rows:
        text = "no operator instances found" + (f" for pipeline {pipeline}" if pipeline else "")
    return doc, text


def topology_tree(doc: Doc) -> str:
    lines = []
    for p in doc["pipelines"]:
        lines.append(f"pipeline {p['pipeline'] or '(unnamed)'}")
        for k, op in enumerate(p["operators"]):
            last_op = k == len(p["operators"]) - 1
            lines.append(f"{'└─' if last_op else '├─'} {op['operator']} ({op['count']} instance{'s' if op['count'] != 1 else ''})")
            for j, i in enumerate(op["instances"]):
                branch = "   " if last_op else "│  "
                tip = "└─" if j == len(op["instances"]) - 1 else "├─"
                keeper = " keeper" if i["keeper"] else ""
                lines.append(f"{branch}{tip} {i['id']} @{i['node']} {i['phase']}{keeper} "
                             f"load={fmt_num(i['load'])} cap={fmt_num(i['capacity'])} ratio={fmt_num(i['ratio'], 2)}")
    return "\n".join(lines)


def latency(fleet: Fleet) -> Tuple[Doc, str]:
    doc = {"cluster": fleet.cluster, "measured_ms": fleet.latency, "emulated_ms": fleet.emulated}
    parts = []
    for title, m in (("measured RTT (ms)", fleet.latency), ("configured emulated delay (ms)", fleet.emulated)):
        if not m:
            continue
        names = sorted(set(m) | {p for row in m.values() for p in row})
        rows = [[src] + [("0.0" if src == dst and dst not in m.get(src, {}) else fmt_num(m.get(src, {}).get(dst), 1)) for dst in names]
                for src in names]
        parts.append(f"{title}, row = from, column = to\n" + table(["FROM\\TO"] + names, rows))
    text = "\n\n".join(parts) if parts else f"no latency measurements on fog/{fleet.cluster}/latency/+"
    return doc, text


def locks(fleet: Fleet) -> Tuple[Doc, str]:
    """Per boundary between two operators: who is in the CS, who requests, who is idle.

    An instance reports one state per boundary it belongs to (`lock.boundaries`, workers with
    coordination = "fgme"); an older payload with a single `lock.boundary` still counts once."""
    bounds: Dict[str, Dict[str, Any]] = {}
    for i in fleet.instances:
        per = list(i.locks)
        if not per and i.lock is not None:
            per = [(i.boundary or i.operator, i.lock)]
        for name, st in per:
            b = bounds.setdefault(name, {"boundary": name, "in_cs": [], "requesting": [], "idle": [],
                                         "groups_in_cs": [], "groups_requesting": []})
            key = {LockState.IN_CS: "in_cs", LockState.REQUESTING: "requesting", LockState.IDLE: "idle"}[st]
            b[key].append(i.id)
            if st is LockState.IN_CS and i.operator not in b["groups_in_cs"]:
                b["groups_in_cs"].append(i.operator)
            if st is LockState.REQUESTING and i.operator not in b["groups_requesting"]:
                b["groups_requesting"].append(i.operator)
    order = {}
    for op_index, op in enumerate(fleet.operator_order()):
        order.setdefault(op, op_index)
    items = [bounds[k] for k in sorted(bounds, key=lambda n: (order.get(n.split("|")[0], len(order)), n))]
    for b in items:
        for k in ("in_cs", "requesting", "idle", "groups_in_cs", "groups_requesting"):
            b[k].sort()
    doc = {"cluster": fleet.cluster, "boundaries": items}
    rows = [[b["boundary"], ",".join(b["groups_in_cs"]) or "-", ",".join(b["in_cs"]) or "-",
             ",".join(b["requesting"]) or "-", len(b["idle"])] for b in items]
    text = table(["BOUNDARY", "GROUP_IN_CS", "IN_CS", "REQUESTING", "IDLE"], rows) if rows else \
        "no 2-FGME lock state published (pipelines use coordination = \"ack\"?)"
    return doc, text


def pipelines(fleet: Fleet) -> Tuple[Doc, str]:
    items = []
    for name in _pipelines_of(fleet, None):
        if name is None:
            continue
        ops = fleet.operator_order(name)
        counts = {op: len(_instances(fleet, name, op)) for op in ops}
        items.append({"pipeline": name, "deployed": name in fleet.pipelines,
                      "operators": [{"operator": op, "instances": n} for op, n in counts.items()],
                      "instances": sum(counts.values())})
    doc = {"cluster": fleet.cluster, "pipelines": items}
    rows = [[p["pipeline"], "yes" if p["deployed"] else "no", p["instances"],
             " ".join(f"{o['operator']}={o['instances']}" for o in p["operators"])] for p in items]
    text = table(["PIPELINE", "DEPLOYED", "INSTANCES", "OPERATORS"], rows) if rows else \
        f"no pipelines deployed on fog/{fleet.cluster}/pipelines/+"
    return doc, text


def event_line(ev: Event) -> str:
    """One line per event: time, node, instance, type, then the reason's numbers."""
    import time as _time

    try:
        clock = _time.strftime("%H:%M:%S", _time.gmtime(ev.ts)) + f".{int((ev.ts % 1) * 1000):03d}"
    except (OverflowError, OSError, ValueError):  # a time no clock shows (an event from the bus)
        clock = f"ts={ev.ts:g}"
    parts = [clock, ev.node, ev.instance or "-", ev.type.value]
    r = ev.reason
    if r is not None:
        parts.append(f"load={fmt_num(r.load)} cap={fmt_num(r.capacity)} ratio={r.ratio:.2f}")
        if r.probability is not None:
            parts.append(f"p={r.probability:.3f}")
        if r.draw is not None:
            parts.append(f"draw={r.draw:.3f}")
        if r.action:
            parts.append(f"-> {r.action}" + (f" x{r.count}" if r.count > 1 else ""))
    for k in sorted(ev.detail):
        v = ev.detail[k]
        parts.append(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}")
    return " ".join(parts)
