"""Pure views: a `Fleet` snapshot (and a time) in, a JSON document and a human table out.

Why the split from the commands: the same view is asserted in tests in both forms, and the JSON
form is the contract for scripts (documented in docs/fogctl.md); the table is derived from the
same rows so that the two never disagree.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from agent.events import Event
from agent.control.fleet import Fleet, Instance, LockState
from agent.fogctl.render import fmt_age, fmt_num, table

__all__ = ["status", "topology", "topology_tree", "latency", "locks", "pipelines", "event_line", "Doc"]

Doc = Dict[str, Any]


def status(fleet: Fleet, now: float) -> Tuple[Doc, str]:
    """One row per node. A draining node says so in STATUS; an offline node shows no machine
    figures (its retained state is its last word, not its present), only when it was last seen.
    Pins (fogctl scale) the agents hold follow the table, once per operator."""
    pins = _fleet_pins(fleet)
    doc = {"cluster": fleet.cluster, "nodes": [n.to_dict(now) for n in fleet.nodes], "pins": pins}
    rows = []
    for d, n in zip(doc["nodes"], fleet.nodes):
        slots = "-" if n.slots is None else f"{d['free_slots'] if d['free_slots'] is not None else '-'}/{n.slots}"
        state = n.status + (" draining" if n.draining else "")
        rows.append([
            n.node, state if not n.error else f"{state} (bad state: {n.error})",
            fmt_num(d["cpu"]), fmt_num(d["memory"]), fmt_num(d["temperature"]), slots, fmt_num(n.capacity),
            len(n.instances), ",".join(i.id for i in n.instances) or "-", fmt_age(n.last_seen(now)),
        ])
    text = table(["NODE", "STATUS", "CPU%", "MEM%", "TEMP_C", "FREE/SLOTS", "CAPACITY", "N", "INSTANCES", "LAST_SEEN"], rows)
    if pins:
        text += "\npinned by fogctl scale (the policy leaves their count alone): " + "; ".join(
            f"{p['operator']}" + (f" ({p['pipeline']})" if p["pipeline"] else "") + " " + _until(p["until"])
            for p in pins)
    if not fleet.nodes:
        text = f"no agents found on fog/{fleet.cluster}/agents/+/state (wrong --cluster?)"
    return doc, text


def _fleet_pins(fleet: Fleet) -> List[Dict[str, Any]]:
    """Every agent keeps the pins it was sent (fogctl scale pins on every online node): one
    entry per (pipeline, operator), with the nodes that hold it and the latest end."""
    out: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for n in fleet.nodes:
        for p in n.pins:
            key = (p["pipeline"] or "", p["operator"])
            entry = out.setdefault(key, {"operator": p["operator"], "pipeline": p["pipeline"], "until": p["until"],
                                         "nodes": []})
            entry["nodes"].append(n.node)
            if p["until"] is None or (entry["until"] is not None and p["until"] > entry["until"]):
                entry["until"] = p["until"]
    return [out[k] for k in sorted(out)]


def _until(until: Optional[float]) -> str:
    import time as _time

    if until is None:
        return "until released"
    try:
        return "until " + _time.strftime("%H:%M:%SZ", _time.gmtime(until))
    except (OverflowError, OSError, ValueError):
        return f"until ts={until:g}"


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


# Detail keys shown first, in this order (what happened before the particulars). `source` says
# which publisher wrote the event: left out of the line when it is the usual agent or worker,
# shown as `source=state` for a decision read from an agent's state (docs/fogctl.md); --json keeps it.
_LEAD_KEYS = ("cause", "action", "what", "ok", "error", "new", "node", "boundary")
_QUIET_SOURCES = ("agent", "worker")
EVENT_LINE_MAX = 240  # characters: one terminal line and a bit; --json has everything
_VALUE_MAX = 60


def _scalar(v: Any) -> str:
    """One detail value as text a person reads: no Python reprs, quoted when it has spaces."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    text = str(v)
    text = " ".join(text.split())  # newlines and runs of blanks from a reason or an error
    if len(text) > _VALUE_MAX:
        text = text[:_VALUE_MAX - 3] + "..."
    return json.dumps(text, ensure_ascii=False) if (" " in text or "=" in text or not text) else text


def _detail_value(v: Any) -> Optional[str]:
    """A list as comma-separated scalars; an object (a worker's stats, say) is left to --json."""
    if isinstance(v, dict):
        return None
    if isinstance(v, (list, tuple)):
        items = [_scalar(x) for x in v if not isinstance(x, (dict, list, tuple))]
        shown = ",".join(items[:5]) + (f",+{len(items) - 5}" if len(items) > 5 else "")
        return shown or "-"
    if v is None:
        return "-"
    return _scalar(v)


def event_line(ev: Event) -> str:
    """One bounded line per event: time, node, instance, type, then key=value (docs/fogctl.md,
    "watch"): the reason's numbers, then the detail's scalars and lists (what happened first).
    Nested objects (a terminated worker's stats) stay out of the line; `--json` carries them."""
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
    keys = [k for k in _LEAD_KEYS if k in ev.detail] + sorted(k for k in ev.detail if k not in _LEAD_KEYS)
    for k in keys:
        if k == "source" and ev.detail[k] in _QUIET_SOURCES:
            continue
        shown = _detail_value(ev.detail[k])
        if shown is not None:
            parts.append(f"{_scalar(k)}={shown}")
    line = " ".join(parts)
    return line if len(line) <= EVENT_LINE_MAX else line[:EVENT_LINE_MAX - 3] + "..."
