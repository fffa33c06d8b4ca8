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

`HandOvers` carries a hand-over out (reads the files the keeper wrote, asks createNode(), acts on
its answer) through `HandOverCalls`, holding no reference to the daemon.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from agent.instance.spec import InstanceSpec
from agent.node import statexfer
from agent.node.drain import Drain

log = logging.getLogger(__name__)

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


@dataclasses.dataclass(frozen=True)
class HandOverCalls:
    """What a hand-over may have the rest of the node do."""

    create_node: Callable[..., None]  # (spec, reply, cause=, now=, chunks=): placed anywhere but here
    restart: Callable[[InstanceSpec], None]  # start it here again, now
    moved: Callable[[str, Any], None]  # we moved the instance to that node: our "moved" statement
    forget: Callable[[str], None]  # gone from this node for good: never re-adopted here
    event: Callable[..., None]  # an event of one instance (etype, instance, operator, pipeline, **detail)
    changed: Callable[[], None]  # our state changed: publish it soon
    stopping: Callable[[], bool]  # the agent shuts down


class HandOvers:
    """The hand-overs of this node's drained keepers (the drain's `moving`: those whose start
    elsewhere is not answered yet)."""

    def __init__(self, node: str, state_dir: str, boot: str, drain: Drain, wall: Callable[[], float],
                 calls: HandOverCalls) -> None:
        self.node, self.state_dir, self.boot, self.drain, self.wall = node, Path(state_dir), boot, drain, wall
        self.calls = calls
        self._counter = 0  # of this agent's transfers: with `boot`, the keyed state's transfer id

    def start(self, spec: InstanceSpec, stats: Mapping[str, Any], now: float) -> None:
        """Start the keeper `spec`, stopped for a drain, again ELSEWHERE with the same identity."""
        inst = spec.instance
        transfer = f"{self.boot}-{self._counter}-{int(self.wall() * 1000)}"
        self._counter += 1
        move = prepare(spec, stats, self.state_dir, self.wall(), transfer)
        if move.refused:
            log.error("hand-over refused (%s): restarting it here", move.refused, extra={"instance": inst})
            self.calls.event("drain", inst, spec.operator, spec.pipeline, action="handover", ok=False,
                             error=move.refused)
            self.calls.restart(move.local)
            return

        def reply(result: Dict[str, Any]) -> None:
            self.drain.moving.discard(inst)
            self.calls.changed()
            then = outcome(result, self.node, self.calls.stopping())
            if then == MOVED:
                log.info("handed over to %s (same identity)", result.get("node"), extra={"instance": inst})
                self.calls.moved(inst, result.get("node"))
                self.calls.forget(inst)  # hosted.forget + the state file: never re-adopted here
                self.calls.event("drain", inst, spec.operator, spec.pipeline, action="handover", ok=True,
                                 to=result.get("node"))
                return
            error = result.get("error") if not result.get("ok") else "placed on the draining node"
            log.error("hand-over failed (%s): restarting it here", error, extra={"instance": inst})
            self.calls.event("drain", inst, spec.operator, spec.pipeline, action="handover", ok=False,
                             error=str(error))
            if then == RESTART:
                self.calls.restart(move.local)

        log.info("keeper stopped for the drain: starting it elsewhere (epoch above %s%s)",
                 (move.spec.extra["handover_state"] or {}).get("epoch"),
                 f", keyed state of {move.keyed} bytes in {len(move.chunks)} chunks" if move.keyed is not None else "",
                 extra={"instance": inst})
        self.drain.moving.add(inst)
        self.calls.create_node(move.spec, reply, cause="handover", now=now, chunks=move.chunks)


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A small JSON object file (a worker's state or a source's position), or None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


__all__ = ["HandOver", "HandOverCalls", "HandOvers", "MOVED", "RESTART", "STAYS", "outcome", "prepare", "read_json"]
