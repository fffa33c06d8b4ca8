"""The createNode() requests of a duplication round (agent.instance.driver): each new copy's spec,
asked of the agent, and the answers waited for (docs/design.md invariant 2: the Sends announcing
a copy wait until the agent says it is subscribed).

Rules of this file: sans-IO, part of the `Instance` (agent.instance.core) through its driver. The
part owns its state (the requests waiting for their answer, the errors of the refused ones, the
request counter) and holds no instance: a request is returned as the commands that ask the agent;
it counts in the driver's counters. What the answers mean for the round (go on, shrink it or
withdraw it) is the driver's.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Dict, List, Optional

from agent.instance.commands import Command, CrashPoint, RequestSpawn

__all__ = ["CreateRequests"]


class CreateRequests:
    """The copies of the current round requested of the agent and not answered yet."""

    def __init__(self, spec: Any, counts: Dict[str, int]) -> None:
        self.spec = spec  # the instance's (agent.instance.spec.InstanceSpec): each copy's starts from it
        self.counts = counts  # the driver's counters
        # request -> instance: every copy of a round is requested at once (see ScalingDriver.run_outputs)
        self.waiting: Dict[str, str] = {}
        self.errors: List[str] = []  # of the refused requests, until every answer is in
        self._req = 0

    def request(self, out: Any) -> List[Command]:
        """Ask the agent for the copy of a `CreateInstance` output: our spec, idle, created by us."""
        own = self.spec
        self._req += 1
        request = f"{own.instance}-{self._req}"
        extra = dict(own.extra)
        extra["creator"] = own.instance
        spec = replace(
            own,
            instance=out.instance_id,
            succs=(),
            preds=(),
            keeper=False,
            active=False,
            restart=False,
            extra=extra,
        )
        self.waiting[request] = out.instance_id
        self.counts["spawns"] += 1
        # CrashPoint: the tests' crash in the middle of a duplication round
        return [RequestSpawn(request, json.loads(spec.to_json())), CrashPoint("spawn_requested")]

    def answered(self, msg: Dict[str, Any]) -> Optional[str]:
        """The instance a "spawned" answer is for (None: no request of ours); a refusal's error is
        kept for `take_errors`."""
        instance = self.waiting.pop(str(msg.get("request")), None)
        if instance is not None and not msg.get("ok"):
            self.counts["spawn_failures"] += 1
            self.errors.append(str(msg.get("error")))
        return instance

    def take_errors(self) -> List[str]:
        """The errors of the refused requests since the last call."""
        errors, self.errors = self.errors, []
        return errors
