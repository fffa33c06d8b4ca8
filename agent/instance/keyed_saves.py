"""A keyed state as saved on disk: its format number and the reader of a snapshot with its log.

Why a module of its own: the node's agent reads saved states too (a hand-over's or a standby's
copy, agent.node.statexfer), and must not import the operator API and the keyed runtime to do
it. Rules of this file: json and pathlib only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

__all__ = ["FORMAT", "load_saved"]

FORMAT = 2  # 1: the highest number applied per (predecessor, source), read by `restore`


def load_saved(path: Path) -> Optional[Dict[str, Any]]:
    """The saved state: the snapshot with the lines of its generation's log applied, in order,
    up to the first line that does not parse (torn by a power cut: never acked)."""
    try:
        data = dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    try:
        lines = path.with_name(path.name + ".log").read_bytes().split(b"\n")
    except FileNotFoundError:
        lines = []
    gen = data.get("gen")
    groups: Dict[str, Any] = data.setdefault("groups", {})
    pairs: Dict[str, Dict[Any, Any]] = {}  # group -> key -> state, for the groups a line changes
    counters: Dict[str, Dict[Any, Any]] = {}

    def opened(g: str) -> None:
        if g not in pairs:
            blob = groups.get(g) or {}
            pairs[g] = {k: v for k, v in blob.get("pairs") or []}
            counters[g] = {k: n for k, n in blob.get("emitted") or []}

    for raw in lines:
        if not raw:
            continue
        try:
            d = json.loads(raw)
        except ValueError:
            break
        if d.get("gen") != gen:
            continue
        if "applied" in d:
            data.setdefault("applied", {}).update(d["applied"])
        if "owned" in d:
            data["owned"] = d["owned"]
        if "positions" in d:  # a log line of format 1
            data.setdefault("positions", {}).update(d["positions"])
        data["max_time"] = d["max_time"]
        data["outputs"] = (data["outputs"] + d["out_add"])[d["out_drop"]:]
        for g, blob in (d.get("groups") or {}).items():
            groups[g] = blob
        for g, k, present, state, n in d.get("keys") or []:
            g = str(g)
            opened(g)
            if present:
                pairs[g][k] = state
            else:
                pairs[g].pop(k, None)
            if n is not None:
                counters[g][k] = n
            else:  # no counter any more: its group was handed out (`forget_group`)
                counters[g].pop(k, None)
    for g in pairs:
        groups[g] = {"pairs": [[k, v] for k, v in pairs[g].items()],
                     "emitted": [[k, n] for k, n in counters[g].items()]}
    return data
