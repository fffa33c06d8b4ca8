"""The site manager's driver inside the agent (docs/site-manager.md).

Holds the election (the retained leader record on topics.site_manager) and, while this agent
leads, runs `site_manager.decide` every period on the agents' retained states. It returns its
effects (publish, steering request, hook, event) for the daemon to carry out, so that the daemon
stays the only owner of the MQTT client and the agent's loop never waits on a hook: hooks run in
a thread of their own (`run_hook`), their outcome comes back at a later tick.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from agent import topics
from agent.config import SiteManagerSection
from agent.control.rpc_schema import DrainRequest
from agent.node.site_manager import (
    Action, ActionKind, Lease, SiteConfig, SiteState, accept_lease, claim, decide, hook_node, lease_bound,
    parse_lease, spare, view_of,
)

log = logging.getLogger("fog.site")

__all__ = ["Publish", "Steer", "Hook", "Emit", "SiteDriver", "run_hook", "HOOK_TIMEOUT"]

HOOK_TIMEOUT = 120.0  # seconds a release/acquire hook may take (a power-off script, a relay)
MAX_LEASE_BYTES = 16 * 1024


@dataclass(frozen=True)
class Publish:
    topic: str
    payload: bytes
    retain: bool


@dataclass(frozen=True)
class Steer:
    """A DrainRequest to `node` (over its peer topic, or handled locally when it is this node)."""

    node: str
    body: Dict[str, Any]


@dataclass(frozen=True)
class Hook:
    argv: Tuple[str, ...]


@dataclass(frozen=True)
class Emit:
    """An event for the events topic (fogctl why): the action and its reason."""

    action: Dict[str, Any]


Effect = Union[Publish, Steer, Hook, Emit]


class SiteDriver:
    def __init__(self, section: SiteManagerSection, node: str, cluster: str, stale_after: float) -> None:
        self.section = section
        self.stale_after = stale_after  # a state older than this: its node counts as offline
        self.node = node
        self.cluster = cluster
        self.cfg = SiteConfig(target=section.target, min_nodes=section.min_nodes, max_nodes=section.max_nodes,
                              cooldown=section.cooldown, timeout=section.timeout)
        self.state = SiteState()
        self.lease: Optional[Lease] = None  # the lease this agent holds valid (`accept_lease`)
        self.max_ahead = lease_bound(section.lease, section.period)
        self.leading = False
        self.last_tick = float("-inf")
        self.last_spare: Optional[float] = None
        self.actions: List[Dict[str, Any]] = []  # the last few, for the leader record

    def on_lease(self, payload: bytes, now: Optional[float] = None) -> Optional[str]:
        """The retained record changed (empty payload: cleared). What it says is a claim by any
        node: `accept_lease` decides whether it replaces the lease this agent holds valid. Returns
        why it was refused (None: accepted); the daemon counts and logs it."""
        self.lease, refused = accept_lease(self.lease, lease_of(payload), time.time() if now is None else now,
                                           self.max_ahead)
        if self.lease is not None and self.lease.node != self.node and self.leading:
            # Another agent's record is the one the broker kept: it leads, this one stops.
            log.info("site manager: %s took the lead", self.lease.node)
            self.leading = False
        return refused

    def tick(self, now: float, docs: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool]) -> List[Effect]:
        """One period: renew or claim the lease, and decide when leading. `now`: unix seconds
        (the lease is read by other machines)."""
        if now - self.last_tick < self.section.period:
            return []
        self.last_tick = now
        if not claim(self.lease, self.node, now):
            self.leading = False
            return []
        # The agents accept a steering request only from the holder of the lease they have
        # received (daemon `_peer_may_steer`): a new leader publishes its record and decides
        # from the next period on, and every record goes out before the period's requests. A
        # drain sent with the first record reached its node before it, was refused, and the
        # manager then waited `timeout` for a drain that never started (found by
        # test_drain_keyed's consolidation run).
        first = not self.leading
        if first:
            log.info("site manager: %s leads (lease %.0f s)", self.node, self.section.lease)
            if self.lease is not None and self.lease.node != self.node:
                # the released nodes of the previous leader: only names of nodes this agent knows
                self.state = _adopt(self.lease.state, docs.keys())
            self.leading = True
        effects: List[Effect] = []
        view = view_of(docs, online, now, stale_after=self.stale_after)
        self.last_spare = spare([n for n in view if n.online and not n.draining and n.node not in self.state.released])
        if not first:
            self.state, actions = decide(view, self.state, self.cfg, now)
            for a in actions:
                effects.extend(self._effects(a, now, docs.keys()))
        record = Lease(self.node, now + self.section.lease, self.summary())
        return [Publish(topics.site_manager(self.cluster), json.dumps(record.to_dict()).encode(), True)] + effects

    def _effects(self, a: Action, now: float, known: Iterable[str] = ()) -> List[Effect]:
        self.actions = (self.actions + [dict(a.to_dict(), ts=now)])[-8:]
        log.info("site manager: %s %s: %s", a.kind.value, a.node, a.reason)
        out: List[Effect] = [Emit(a.to_dict())]
        if a.kind in (ActionKind.DRAIN, ActionKind.UNDRAIN):
            out.append(Steer(a.node, DrainRequest(a.node, undo=a.kind is ActionKind.UNDRAIN).to_dict()))
        elif a.kind in (ActionKind.RELEASE, ActionKind.ACQUIRE):
            hook = self.section.release_hook if a.kind is ActionKind.RELEASE else self.section.acquire_hook
            # The hook's only argument is a node name this agent knows from an ACL-proven topic
            # level (its state record), never a string from a payload (an adopted record's list).
            name = hook_node(a.node, known)
            if hook and name is not None:
                out.append(Hook(tuple(hook) + (name,)))
            elif hook:
                log.warning("site manager: no %s hook for %.80r: not a node this agent knows", a.kind.value, a.node)
        return out

    def summary(self) -> Dict[str, Any]:
        """What fogctl site shows (docs/site-manager.md, "fogctl site")."""
        p = self.state.pending
        return {
            "target": self.cfg.target, "min_nodes": self.cfg.min_nodes, "max_nodes": self.cfg.max_nodes,
            "spare": None if self.last_spare is None else round(self.last_spare, 4),
            "pending": None if p is None else {"action": p.kind.value, "node": p.node, "since": p.since},
            "released": list(self.state.released), "actions": list(self.actions),
        }


def lease_of(payload: bytes) -> Optional[Lease]:
    """The lease a retained payload states (None: empty, oversized or malformed)."""
    d: Any = None
    if payload and len(payload) <= MAX_LEASE_BYTES:
        try:
            d = json.loads(payload)
        except ValueError:
            d = None
    return parse_lease(d)


def _adopt(state: Mapping[str, Any], known: Iterable[str]) -> SiteState:
    """The released list a new leader inherits from the record: only names of nodes in `known`
    (the node names this agent read from topic levels), as this agent's own strings, at most 64."""
    released = state.get("released") if isinstance(state, Mapping) else None
    listed = [n for n in released[:1024] if isinstance(n, str)] if isinstance(released, list) else []
    names = [k for n in listed for k in (hook_node(n, known),) if k is not None]
    return SiteState(released=tuple(dict.fromkeys(names))[:64])


def run_hook(argv: Sequence[str], node: str) -> threading.Thread:
    """Run a hook without a shell, in a thread: the agent's loop never waits for it."""

    def run() -> None:
        try:
            done = subprocess.run(list(argv), timeout=HOOK_TIMEOUT, capture_output=True, check=False)
            level = logging.INFO if done.returncode == 0 else logging.WARNING
            log.log(level, "site hook %s exited %d", argv[0], done.returncode, extra={"node": node})
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("site hook %s failed: %s", argv[0], exc, extra={"node": node})

    t = threading.Thread(target=run, name="site-hook", daemon=True)
    t.start()
    return t
