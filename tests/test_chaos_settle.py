"""When `fog-agent chaos` calls a run settled (docs/reliability.md, "Numbers (session 12)"): every
operator at one active instance. Counting only the operators present called seed 12026 settled
with no source running. The monitor's retained states are set by hand: no broker needed."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

from agent.tools.chaos import _back_to_size
from agent.tools.demo import Monitor

OPS = ["source", "validate", "sink"]


def monitor(instances: Dict[str, List[Dict[str, Any]]], offline: tuple = ()) -> Monitor:
    mon = Monitor.__new__(Monitor)  # no connection: only the retained states matter here
    mon._lock = threading.Lock()
    mon.states = {node: {"instances": insts} for node, insts in instances.items()}
    mon.status = {node: ("offline" if node in offline else "online") for node in instances}
    return mon


def inst(op: str, status: str = "active", n: int = 0) -> Dict[str, Any]:
    return {"id": f"p.{op}.{n}", "operator": op, "status": status}


def test_every_operator_at_one_active_instance_is_back() -> None:
    assert _back_to_size(monitor({"n1": [inst("source"), inst("validate")], "n2": [inst("sink")]}), OPS)


def test_an_operator_with_no_instance_is_not_back() -> None:
    """Seed 12026: the re-homed source failed to start anywhere; validate and sink at one each."""
    assert not _back_to_size(monitor({"n1": [inst("validate")], "n2": [inst("sink")]}), OPS)


def test_an_instance_still_starting_or_a_second_instance_is_not_back() -> None:
    starting = monitor({"n1": [inst("source", "starting"), inst("validate")], "n2": [inst("sink")]})
    two = monitor({"n1": [inst("source"), inst("validate"), inst("validate", n=1)], "n2": [inst("sink")]})
    assert not _back_to_size(starting, OPS)
    assert not _back_to_size(two, OPS)


def test_an_instance_on_an_offline_node_does_not_count() -> None:
    assert not _back_to_size(monitor({"n1": [inst("source"), inst("validate")], "n2": [inst("sink")]},
                                     offline=("n2",)), OPS)
