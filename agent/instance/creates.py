"""The createNode() requests of a duplication round (agent.instance.driver): each new copy's spec,
asked of the agent, and the answers waited for (docs/design.md invariant 2: the Sends announcing
a copy wait until the agent says it is subscribed).

Rules of this file: sans-IO, part of the `Instance` (agent.instance.core) through its driver. The
part owns its state (the requests waiting for their answer, the errors of the refused ones, the
request counter) and asks through the instance's port; it counts in the driver's counters. What
the answers mean for the round (go on, shrink it or withdraw it) is the driver's.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Dict, List, Optional

from agent.instance.port import InstancePort

__all__ = ["CreateRequests"]


class CreateRequests:
    """The copies of the current round requested of the agent and not answered yet."""

    def __init__(self, w: InstancePort, counts: Dict[str, int]) -> None:
        self.w = w
        self.counts = counts  # the driver's counters
        # request -> instance: every copy of a round is requested at once (see ScalingDriver.run_outputs)
        self.waiting: Dict[str, str] = {}
        self.errors: List[str] = []  # of the refused requests, until every answer is in
        self._req = 0

    def request(self, out: Any) -> None:
        """Ask the agent for the copy of a `CreateInstance` output: our spec, idle, created by us."""
        w = self.w
        self._req += 1
        request = f"{w.spec.instance}-{self._req}"
        extra = dict(w.spec.extra)
        extra["creator"] = w.spec.instance
        spec = replace(
            w.spec,
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
        w.request_spawn(request, json.loads(spec.to_json()))
        w.crash_point("spawn_requested")  # tests: a crash in the middle of a duplication round

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
