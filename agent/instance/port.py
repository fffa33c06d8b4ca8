"""What the scaling driver, the group moves and the key groups' side may ask of their instance: the
seam between `agent.instance.core.Instance` and the parts that call back into it
(agent.instance.driver, agent.instance.moves, agent.instance.group_side). The driver's own parts
(agent.instance.adoption, .creates, .scaling_events) hold no instance: they return commands,
which the driver hands on with `perform`.

Why a Protocol instead of the class: the parts are driven by the instance and call back into it
(the instance's clock, its channels, its persistence), so they need its type; importing the class
made core -> driver -> core a cycle that only a type-only import hid. Typed against this port, a
part imports nothing of the instance, and the list below is every member a part may use: a member
a part starts to use must be named here, which keeps the back-references visible and countable
(the way to a part with no back-reference at all: `handle(event, now) -> [command]`).

Rules of this file: types only; it imports nothing from agent.instance.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Tuple

__all__ = ["InstancePort"]


class InstancePort(Protocol):
    # identity, configuration
    spec: Any  # agent.instance.spec.InstanceSpec
    pipeline: Any  # agent.config.PipelineConfig
    stage: int
    ctx: Dict[str, Any]
    is_source: bool
    epoch: int
    stopping: bool
    stats: Dict[str, int]

    # the instance's clock: the last time it was handed (sans-IO), and the wall clock derived from it
    now: float

    def wall(self) -> float: ...

    # the data plane the parts route through or read
    router: Any  # agent.dataplane.routing.Router
    outputs: Any  # agent.instance.outputs.Outputs: the links the idle copies' messages are numbered on
    outbox: Any  # agent.dataplane.routing.Outbox
    tracker: Any  # agent.dataplane.flow.AckTracker
    keyed: Any  # Optional[agent.instance.keyed_state.KeyedState]
    moves: Any  # Optional[agent.instance.moves.GroupMoves]
    load: Any  # agent.instance.load.Load: the load and live signals the scaling decision reads

    # what the parts ask the instance to do
    def send_envelope(self, dest: str, kind: Any, body: Any) -> None: ...

    def send_handover(self, dest: str, msg: Any, extra: Optional[Dict[str, Any]] = None) -> None: ...

    def send_handover_body(self, dest: str, body: Dict[str, Any]) -> None: ...

    def forward_outputs(self, items: List[Any], index: int) -> None: ...

    def forget_sender(self, sender: str) -> None: ...

    def persist(self, force: bool = False) -> None: ...

    def save_keyed_now(self) -> None: ...

    def mark_state_changed(self) -> None: ...

    def emit(self, event: str, **fields: Any) -> None: ...

    def perform(self, commands: List[Any]) -> None: ...

    def stamp_decision(self, key: str) -> None: ...

    def handover_error(self, sender: str, why: str) -> None: ...

    def groups_moved(self) -> None: ...

    def lowest_forwarding(self) -> Optional[int]: ...

    # the seeded faults' hooks (foglab.sim.instance_faults replaces them in a subclass)
    def await_joined_pred(self, moves: Any, pred: str) -> None: ...

    def forget_departed_pred(self, moves: Any, pred: str) -> None: ...

    def send_eos(self, dest: str, eos: Any) -> None: ...

    # the scaling round's hooks into the instance
    def set_routes(self, succs: Tuple[str, ...], now: float) -> None: ...

    def after_start(self, copy: str, preds: Any) -> None: ...

    def flush(self, now: float, force: bool = False) -> None: ...

    def drained(self) -> bool: ...

    def terminate(self, reason: str) -> None: ...

    def on_preds_changed(self, added: Tuple[str, ...], removed: Tuple[str, ...]) -> None: ...

    def start_field(self, copy: str) -> Optional[Dict[str, Any]]: ...

    def on_start_field(self, field: Any, succs: Tuple[str, ...]) -> None: ...

