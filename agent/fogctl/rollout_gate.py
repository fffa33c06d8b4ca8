"""The health gate of a rolling change: is a restarted node back, with what it hosted before?

Why: the fog node play restarts the agents one `serial` batch at a time so that the instances of
a restarting agent find room on the nodes that are up. That only holds if a batch has come back
before the next one goes down: a systemd restart returns as soon as the unit is started, long
before the agent is connected and has re-adopted (or re-homed) its instances. The role therefore
waits, after a restart it made, until the node's retained records on the broker say so.

The verdict is pure (`verdict`: two `fogctl status --json` documents and a time in, one line
out) so that every case is tested without a broker; `wait` is the loop around it, which reads
the fleet with `fogctl status --json` (the node's own identity can: its ACL lets it read every
node's state and status, docs/security.md) until the verdict is "ready" or the deadline passes.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["Verdict", "hosted_before", "verdict", "wait"]

Doc = Dict[str, Any]


@dataclass(frozen=True)
class Verdict:
    ready: bool
    reason: str  # one line: what is missing, or what was found


def _node(doc: Optional[Doc], node: str) -> Optional[Doc]:
    for row in (doc or {}).get("nodes") or []:
        if isinstance(row, dict) and row.get("node") == node:
            return row
    return None


def hosted_before(doc: Optional[Doc], node: str) -> List[str]:
    """The instances `node` hosted in a `fogctl status --json` document read before the restart
    (none when the node was not there yet: a fresh node has nothing to get back; none when it was
    offline: a replacement of a lost node, whose instances the survivors re-home or the protocol
    ends, is not to wait for what its dead predecessor's record lists)."""
    row = _node(doc, node)
    if row is None or row.get("status") != "online":
        return []
    return sorted(str(i) for i in row.get("instances") or [])


def verdict(doc: Optional[Doc], node: str, before: Sequence[str], restarted_at: float) -> Verdict:
    """Ready when `node` is online, not draining, has published a state since `restarted_at`
    (a record of the old process, retained or published while it drained, says nothing about the
    new one; the caller passes a time when the old process is known gone), and every
    instance of `before` is listed by an online node again: re-adopted by this one, or re-homed
    by the drain to another (both mean it runs; which node is the placement's business)."""
    row = _node(doc, node)
    if row is None:
        return Verdict(False, f"{node}: no retained state on the broker")
    if row.get("status") != "online":
        return Verdict(False, f"{node}: {row.get('status') or 'unknown'}")
    if row.get("error"):
        return Verdict(False, f"{node}: bad state ({row['error']})")
    ts = row.get("ts")
    if not isinstance(ts, (int, float)) or ts < restarted_at:
        return Verdict(False, f"{node}: online, but no state published since the restart")
    if row.get("draining"):
        return Verdict(False, f"{node}: draining")
    running = set()
    for other in (doc or {}).get("nodes") or []:
        if isinstance(other, dict) and other.get("status") == "online":
            running.update(str(i) for i in other.get("instances") or [])
    missing = sorted(set(before) - running)
    if missing:
        return Verdict(False, f"{node}: online, {len(missing)} of {len(before)} instances not back: "
                              + ", ".join(missing))
    return Verdict(True, f"{node}: online, {len(before)} instance(s) of before running again")


Reader = Callable[[], Optional[Doc]]


def fogctl_reader(fogctl: str, agent_config: str, timeout: float = 30.0) -> Reader:
    """Read the fleet as the node itself (its agent.toml names broker, cluster and credentials)."""

    def read() -> Optional[Doc]:
        try:
            out = subprocess.run([fogctl, "--agent-config", agent_config, "status", "--json"],
                                 capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0:
            return None
        try:
            doc = json.loads(out.stdout)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    return read


def wait(read: Reader, node: str, before: Sequence[str], restarted_at: float, timeout: float,
         period: float = 2.0, clock: Callable[[], float] = time.time,
         sleep: Callable[[float], None] = time.sleep) -> Verdict:
    """Poll `read` until the verdict is ready or `timeout` s have passed; the last verdict."""
    deadline = clock() + timeout
    last = Verdict(False, f"{node}: not read yet")
    while True:
        last = verdict(read(), node, before, restarted_at)
        if last.ready or clock() >= deadline:
            return last
        sleep(min(period, max(0.0, deadline - clock())))
