"""The agent's control lines to a running instance, but a stop (agent.instance.spec; the shell turns
each into a `Control` event): `set` (service time, a source paused, the scaling pinned, the
policy's context), `scale` (a forced decision), `spawned` (a createNode() answer), `hosts` (the
instance -> node bindings) and `replicated` (the standby copy holds a keyed save).

Rules of this file: `ControlLines` owns no state and holds no reference to the instance; it is
handed the parts a line changes at construction, and per call the scaling driver (None before the
start) and the time `now`. A call that sends returns its commands. No I/O, no clock, no random.
A `stop` or `eof` line is the instance's own (`Instance.request_stop`): it changes its phase.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from agent.instance.commands import Command
from agent.instance.hosts import Hosts
from agent.instance.keyed_state import KeyedState
from agent.instance.moves import GroupMoves
from agent.instance.outputs import Outputs
from agent.instance.pace import Pace

__all__ = ["ControlLines"]

log = logging.getLogger("agent.instance.worker")


class ControlLines:
    """`source_operator`: the operator a `set` line may pause (None at an instance that is no
    source); `keyed`, `moves`: None where there are none."""

    def __init__(self, pace: Pace, source_operator: Any, hosts: Hosts, outputs: Outputs,
                 keyed: Optional[KeyedState], moves: Optional[GroupMoves], ctx: Dict[str, Any]) -> None:
        self.pace = pace
        self.source_operator = source_operator
        self.hosts = hosts
        self.outputs = outputs
        self.keyed = keyed
        self.moves = moves
        self.ctx = ctx

    def apply(self, msg: Dict[str, Any], scaling: Any, now: float) -> List[Command]:
        """Control line `msg` taken; an unknown one is logged and ignored."""
        event = msg.get("event")
        if event == "spawned":
            if scaling is not None:
                return scaling.on_spawned({"request": str(msg.get("request")), "ok": bool(msg.get("ok")),
                                           "error": str(msg.get("error"))})
        elif event == "scale":
            if scaling is not None:
                scaling.force(str(msg.get("action")), int(msg.get("count", 1)))
        elif event == "set":
            self._set(msg, scaling)
        elif event == "hosts":
            return self._hosts(msg, now)
        elif event == "replicated":
            if self.keyed is not None and isinstance(msg.get("gen"), int) and isinstance(msg.get("log"), int):
                self.keyed.replicated(msg["gen"], msg["log"])
                if self.moves is not None:
                    return self.moves.replicated((msg["gen"], msg["log"]))
        else:
            log.warning("unknown control event %r ignored", event, extra=self.ctx)
        return []

    def _set(self, msg: Dict[str, Any], scaling: Any) -> None:
        if "service_time_ms" in msg:
            self.pace.service_time = float(msg["service_time_ms"]) / 1000.0
            log.info("service time set to %.3f ms", self.pace.service_time * 1000, extra=self.ctx)
        if "paused" in msg and self.source_operator is not None:
            self.source_operator.paused = bool(msg["paused"])
        if "pinned" in msg and scaling is not None:
            scaling.pinned = bool(msg["pinned"])
        if "context" in msg and scaling is not None and scaling.live is not None:
            if not scaling.live.set_context(msg["context"]):
                log.warning("malformed policy context ignored: %.200r", msg["context"], extra=self.ctx)

    def _hosts(self, msg: Dict[str, Any], now: float) -> List[Command]:
        """The agent's instance -> node bindings (agent.node.hostmap): replace ours; what they now
        bind is released from the hold buffer at the next Tick (`Admission.release`); receivers
        that moved get what we sent them again, and what waited for a binding goes out
        (`Outputs.on_hosts`)."""
        before = self.hosts.update(msg, self.ctx)
        return self.outputs.on_hosts(before, now) if before is not None else []
