"""A drain's hand-over of a keeper: what starts elsewhere with the same identity, and what its
createNode() answer means.

Why a same-identity migration rather than duplicate-then-terminate: a keeper never terminates,
and its identity is what its neighbours' tables, its inbox session and its channel positions are
keyed by. So it moves like a crash restart on another node: the spec gets `restart = true` and
the state file it just wrote (plus a source's position), the new incarnation takes epoch + 1 and
the broker session of its inbox, and its predecessors replay what it had not acked (duplicates
are dropped by sequence and, at the sink, by record id). Placement skips the draining node (0
free slots). Once the new incarnation is ready the old node forgets the instance, so an agent
restart there never re-adopts it; if no node can take it, it restarts there so that nothing
stalls.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.instance.spec import InstanceSpec
from agent.node import statexfer

MOVED, STAYS, RESTART = "moved", "stays", "restart"


@dataclasses.dataclass(frozen=True)
class HandOver:
    spec: InstanceSpec  # to start elsewhere
    local: InstanceSpec  # to restart here when nobody takes it
    chunks: Tuple[Dict[str, Any], ...] = ()  # its keyed state, sent before the spawn (statexfer)
    keyed: Optional[int] = None  # bytes of keyed state
    refused: Optional[str] = None  # why it cannot move: it restarts here


def prepare(spec: InstanceSpec, stats: Mapping[str, Any], state_dir: Path, wall: float, transfer: str) -> HandOver:
    """The hand-over of the keeper `spec` that has just exited, from the files it wrote there."""
    inst = spec.instance
    extra = dict(spec.extra)
    extra["handover_state"] = read_json(state_dir / f"{inst}.state.json")
    if extra["handover_state"] is None:  # never written: start above any epoch it used, as a re-home does
        extra["min_epoch"] = max(int(extra.get("min_epoch", 0) or 0), int(wall))
    source = read_json(Path(str(extra.get("sink_dir") or state_dir)) / f"{inst}.source.json")
    if source is not None:
        extra["handover_source"] = source
    local = dataclasses.replace(spec, restart=True)
    # A keyed operator's state (states, output counters, applied numbers, unacked outputs) goes
    # as it was saved at the worker's exit, in chunks before the spawn (statexfer).
    try:
        keyed = statexfer.snapshot_bytes(state_dir / f"{inst}.keyed.json")
    except (OSError, ValueError) as exc:
        keyed, why = None, f"its keyed state cannot be read: {exc}"
    else:
        why = statexfer.too_large(len(keyed or b""))
    if why:  # grew past the bound since the drain was accepted, or unreadable: stays here
        return HandOver(local, local, refused=why)
    chunks: List[Dict[str, Any]] = []
    if keyed is not None:
        manifest, chunks = statexfer.chunk_bodies(inst, transfer, keyed)
        extra["handover_keyed"] = manifest.to_json()
    keeper = bool(stats.get("keeper", spec.keeper))
    moved = dataclasses.replace(spec, restart=True, active=True, keeper=keeper, extra=extra)
    return HandOver(moved, local, tuple(chunks), len(keyed) if keyed is not None else None)


def outcome(result: Mapping[str, Any], node: str, stopping: bool) -> str:
    """MOVED: another node runs it (forget it here); RESTART: nobody took it (start it here
    again); STAYS: it runs here already, or the agent stops (re-adopted at its restart)."""
    if result.get("ok") and result.get("node") != node:
        return MOVED
    return STAYS if result.get("ok") or stopping else RESTART


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A small JSON object file (a worker's state or a source's position), or None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


__all__ = ["HandOver", "MOVED", "RESTART", "STAYS", "outcome", "prepare", "read_json"]
