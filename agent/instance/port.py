"""What the group moves may ask of their instance: the seam between `agent.instance.core.Instance`
and the one part that still calls back into it (agent.instance.moves). The scaling driver and the
key groups' side hold no instance: they act through the parts they are handed
(agent.instance.driver_parts, agent.instance.group_side), and the driver's own parts return
commands.

Why a Protocol instead of the class: the parts are driven by the instance and call back into it
(the instance's clock, its channels, its persistence), so they need its type; importing the class
made core -> driver -> core a cycle that only a type-only import hid. Typed against this port, a
part imports nothing of the instance, and the list below is every member a part may use: a member
a part starts to use must be named here, which keeps the back-references visible and countable
(the way to a part with no back-reference at all: `handle(event, now) -> [command]`).

Rules of this file: types only; it imports nothing from agent.instance.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol

__all__ = ["InstancePort"]


class InstancePort(Protocol):
    # identity, configuration
    spec: Any  # agent.instance.spec.InstanceSpec
    epoch: int

    # the instance's clock: the last time it was handed (sans-IO), and the wall clock derived from it
    now: float

    def wall(self) -> float: ...

    # the data plane the parts route through or read
    tracker: Any  # agent.dataplane.flow.AckTracker
    keyed: Any  # Optional[agent.instance.keyed_state.KeyedState]

    # what the parts ask the instance to do
    def send_handover(self, dest: str, msg: Any, extra: Optional[Dict[str, Any]] = None) -> None: ...

    def send_handover_body(self, dest: str, body: Dict[str, Any]) -> None: ...

    def forward_outputs(self, items: List[Any], index: int) -> None: ...

    def persist(self, force: bool = False) -> None: ...

    def save_keyed_now(self) -> None: ...

    def mark_state_changed(self) -> None: ...

    def stamp_decision(self, key: str) -> None: ...

    def handover_error(self, sender: str, why: str) -> None: ...

    def groups_moved(self) -> None: ...

    def lowest_forwarding(self) -> Optional[int]: ...
