"""The site manager's driver inside the agent (docs/site-manager.md).

Takes part in the election (each candidate's retained claim on its own topic,
topics.site_manager(cluster, node); the leader derived by `site_manager.leader`) and, while this
agent leads, runs `site_manager.decide` every period on the agents' retained states. It returns its
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
    MAX_LEASE_BYTES, Action, ActionKind, Lease, LeaseBoard, SiteConfig, SiteState, decide, hook_node, lease_bound,
    lease_of, spare, view_of,
)

log = logging.getLogger("fog.site")

__all__ = ["Publish", "Steer", "Hook", "Emit", "SiteDriver", "run_hook", "HOOK_TIMEOUT", "lease_of",
           "MAX_LEASE_BYTES"]

HOOK_TIMEOUT = 120.0  # seconds a release/acquire hook may take (a power-off script, a relay)


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
    def __init__(self, section: SiteManagerSection, node: str, cluster: str, stale_after: float,
                 board: Optional[LeaseBoard] = None) -> None:
        self.section = section
        self.stale_after = stale_after  # a state older than this: its node counts as offline
        self.node = node
        self.cluster = cluster
        self.cfg = SiteConfig(target=section.target, min_nodes=section.min_nodes, max_nodes=section.max_nodes,
                              cooldown=section.cooldown, timeout=section.timeout)
        self.state = SiteState()
        self.max_ahead = lease_bound(section.lease, section.period)
        # The claims this agent read (shared with the daemon, which checks drains against it).
        self.board = board if board is not None else LeaseBoard(node, self.max_ahead)
        # A leader that claimed at the same time as a node of a smaller name yields to it within
        # this window (both saw the role free); after it, it yields to nobody while its lease
        # runs, so a claim written beside a running lease takes nothing.
        self.settle = 2.0 * section.period
        self.leading = False
        self.since = float("-inf")  # when this agent began leading (its own clock)
        self.last_tick = float("-inf")
        self.last_spare: Optional[float] = None
        self.actions: List[Dict[str, Any]] = []  # the last few, for the leader record

    @property
    def lease(self) -> Optional[Lease]:
        """The lease of the leader this agent follows (its own while it leads), None: nobody."""
        held = self.board.held
        if held is None:
            return None
        return self.board.own if held == self.node else self.board.claims.get(held)

    def on_reconnect(self) -> List[Publish]:
        """The agent's connection was lost and is back. Its Will said offline meanwhile, which
        voided its lease for every reader, and another node may lead now: a leader stops and
        clears its record, and claims again at a tick only if the role is still free (two
        leaders, each followed by the readers that saw it first, otherwise)."""
        if not self.leading and self.board.own is None:
            return []
        log.info("site manager: %s stops leading (its connection was lost)", self.node)
        self.leading = False
        self.board.withdraw()
        return [Publish(topics.site_manager(self.cluster, self.node), b"", True)]

    def on_claim(self, writer: str, payload: bytes, now: Optional[float] = None) -> Optional[str]:
        """A record on node `writer`'s own claim topic (empty: cleared). Returns why it was refused
        (None: kept); the daemon counts and logs it."""
        return self.board.on_record(writer, payload, time.time() if now is None else now)

    def tick(self, now: float, docs: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool]) -> List[Effect]:
        """One period: claim, renew or yield the role, and decide when leading. `now`: unix
        seconds (the lease is read by other machines). `online`: the nodes' retained statuses."""
        if now - self.last_tick < self.section.period:
            return []
        self.last_tick = now
        own_topic = topics.site_manager(self.cluster, self.node)
        others = {n: c for n, c in self.board.valid(online, now).items() if n != self.node}
        if self.leading and now - self.since < self.settle and any(n < self.node for n in others):
            # Claimed at the same time as another candidate: the smaller name keeps the role, the
            # other clears its record, and every reader then sees one claim.
            log.info("site manager: %s yields to %s (claimed at once)", self.node, min(others))
            self.leading = False
            self.board.withdraw()
            return [Publish(own_topic, b"", True)]
        current = self.board.current(online, now)
        if current is not None and current.node != self.node or current is None and others:
            # Another node leads, or several claim (none leads until one remains): no claim, and
            # a record of this node's own that still runs (a term before a restart) is cleared,
            # or it would stand beside the leader's for the readers that start meanwhile.
            was = self.leading
            if was:
                log.info("site manager: %s stops leading (%s)", self.node,
                         current.node if current is not None else "claims of " + ", ".join(sorted(others)[:4]))
                self.leading = False
            if was or self.node in self.board.claims or self.board.own is not None:
                self.board.withdraw()
                return [Publish(own_topic, b"", True)]
            return []
        # The agents accept a steering request only from the holder of the lease they derive
        # (`Gate.peer_may_steer`, agent.node.gate): a new leader publishes its record and decides from the
        # next period on, and every record goes out before the period's requests. A drain sent
        # with the first record reached its node before it, was refused, and the manager then
        # waited `timeout` for a drain that never started (found by test_drain_keyed's
        # consolidation run).
        first = not self.leading
        if first:
            log.info("site manager: %s leads (lease %.0f s)", self.node, self.section.lease)
            prev = self.board.claims.get(self.board.previous) if self.board.previous not in (None, self.node) else None
            if prev is not None:
                # the released nodes of the previous leader, from its own record: only names of
                # nodes this agent knows
                self.state = _adopt(prev.state, docs.keys())
            self.leading = True
            self.since = now
        effects: List[Effect] = []
        view = view_of(docs, online, now, stale_after=self.stale_after)
        self.last_spare = spare([n for n in view if n.online and not n.draining and n.node not in self.state.released])
        if not first:
            self.state, actions = decide(view, self.state, self.cfg, now)
            for a in actions:
                effects.extend(self._effects(a, now, docs.keys()))
        record = Lease(self.node, now + self.section.lease, self.summary())
        self.board.lead(record)
        return [Publish(own_topic, json.dumps(record.to_dict()).encode(), True)] + effects

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
