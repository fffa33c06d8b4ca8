"""The record of the instances a node hosts, so that an agent restart brings them back.

Why: an operator instance lives in its neighbours' routing tables until the scaling protocol
removes it (a deletion round). If its agent stops (SIGTERM for an upgrade, a crash that systemd
restarts, a reboot) its workers drain and exit but stay in those tables: their predecessors keep
the batches they sent them (unacked, in the replay buffer) and their credit towards them runs
out. Nothing is lost, but those routes stall until the instance comes back. So the agent writes
one `<instance>.spec.json` per hosted instance into its state dir and, when it starts, restarts
every instance it finds there with the same identity (`restart = true`: the worker restores its
persisted protocol state and asks its predecessors to replay, see docs/runtime.md).

When a spec is written and removed (the rules that keep one identity on one node):
- written when the worker said "ready", i.e. when it may have been announced to anybody
  (invariant 2). An instance whose agent died before "ready" was never announced; its creator's
  spawn request times out and is placed elsewhere, so re-adopting it here would make a second
  process with the same identity;
- removed when the worker exits for good: terminated by the protocol (its exit line says
  `final`) or with a bad spec (restarting cannot help).
- removed when its pipeline is undeployed: at once when an undeploy stops it (`stop` with
  `forget`, before the agent answers), or when the retained pipeline record rules it out (a
  tombstone, another deploy's generation: `agent.control.records.stale_reason`), also for a spec
  whose instance does not run; re-adoption checks the record again (docs/fogctl.md, "Deploy and
  undeploy").

The stored spec carries no broker password (the state dir is not a secret store): the agent
fills in its own broker settings when it re-adopts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import List, Union

from agent.files import write_atomic
from agent.instance.spec import InstanceSpec

log = logging.getLogger(__name__)

__all__ = ["SUFFIX", "REFUSED", "HostedSpecs", "remember", "forget", "set_aside", "hosted", "since"]

SUFFIX = ".spec.json"
REFUSED = ".refused"  # appended to a stored spec the agent no longer admits (see set_aside)

PathLike = Union[str, Path]


def _path(state_dir: PathLike, instance: str) -> Path:
    return Path(state_dir) / f"{instance}{SUFFIX}"


def remember(state_dir: PathLike, spec: InstanceSpec) -> None:
    """Record `spec` as hosted here (atomic: a crash leaves the old file or the new one)."""
    stored = dataclasses.replace(spec, broker=dataclasses.replace(spec.broker, password=None))
    path = _path(state_dir, spec.instance)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, stored.to_json())


def forget(state_dir: PathLike, instance: str) -> None:
    try:
        _path(state_dir, instance).unlink()
    except FileNotFoundError:
        pass


def set_aside(state_dir: PathLike, instance: str) -> None:
    """Stop hosting a stored spec the node does not admit (its function is not on the node's
    allow-list, or it names a path outside the node's directories; docs/security.md): renamed to
    `<instance>.spec.json.refused`, so it is neither re-adopted nor published, and kept for a
    person to look at."""
    path = _path(state_dir, instance)
    try:
        os.replace(path, path.with_name(path.name + REFUSED))
        log.error("%s: not admitted on this node: set aside as %s%s", path, path.name, REFUSED)
    except FileNotFoundError:
        pass


def since(state_dir: PathLike, instance: str) -> float:
    """Wall time this node recorded the instance as hosted (0 when it does not)."""
    try:
        return _path(state_dir, instance).stat().st_mtime
    except OSError:
        return 0.0


def hosted(state_dir: PathLike) -> List[InstanceSpec]:
    """The recorded specs, sorted by instance id; an unreadable file is logged and skipped
    (kept on disk for a person to look at), never fatal for the agent."""
    specs: List[InstanceSpec] = []
    for path in sorted(Path(state_dir).glob(f"*{SUFFIX}")):
        try:
            specs.append(InstanceSpec.from_json(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.error("%s: not a hosted-instance spec (%s): skipped", path, exc)
    return specs


class HostedSpecs:
    """This node's stored specs (the functions above, on its state directory) and whether its
    retained hosted record, which lists them, is to be published again (`dirty`): every change of
    a stored spec sets it, so the record never lags behind what an agent restart would re-adopt."""

    def __init__(self, state_dir: PathLike) -> None:
        self.state_dir = state_dir
        self.dirty = True

    def specs(self) -> List[InstanceSpec]:
        return hosted(self.state_dir)

    def since(self, instance: str) -> float:
        return since(self.state_dir, instance)

    def remember(self, spec: InstanceSpec) -> None:
        remember(self.state_dir, spec)
        self.dirty = True

    def forget(self, instance: str) -> None:
        forget(self.state_dir, instance)
        self.dirty = True

    def set_aside(self, instance: str) -> None:
        set_aside(self.state_dir, instance)
        self.dirty = True
