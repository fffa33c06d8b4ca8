"""When `fog-agent chaos` calls a run settled: every operator at one active instance. Counting
only the operators present would call a run settled with no source running (CHANGELOG.md, "A run
counted settled during a re-home"). The monitor's retained states are set by hand: no broker needed. And when
its load ends: on conditions (faults injected, records generated), not at a fixed time."""

from __future__ import annotations

import json
import threading
from typing import Any, Dict, List

import pytest

from foglab.tools.chaos import ChaosConfig, _back_to_size, chaos_pipeline, faults_wanted, load_lacks
from foglab.tools.demo import Monitor

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
    """The re-homed source failed to start anywhere; validate and sink at one each."""
    assert not _back_to_size(monitor({"n1": [inst("validate")], "n2": [inst("sink")]}), OPS)


def test_an_instance_still_starting_or_a_second_instance_is_not_back() -> None:
    starting = monitor({"n1": [inst("source", "starting"), inst("validate")], "n2": [inst("sink")]})
    two = monitor({"n1": [inst("source"), inst("validate"), inst("validate", n=1)], "n2": [inst("sink")]})
    assert not _back_to_size(starting, OPS)
    assert not _back_to_size(two, OPS)


def test_an_instance_on_an_offline_node_does_not_count() -> None:
    assert not _back_to_size(monitor({"n1": [inst("source"), inst("validate")], "n2": [inst("sink")]},
                                     offline=("n2",)), OPS)


# ---- when the load ends (docs/reliability.md, "The chaos command"): on conditions, not a time ----


def test_random_faults_go_on_past_the_duration_until_min_faults_were_injected() -> None:
    """At load ~30 a kill-agent took 37 s to recover: 2 faults by `duration` - 5 s, not 3."""
    cfg = ChaosConfig(duration=40.0, min_faults=3)
    assert faults_wanted(cfg, 10.0, 0, 0)
    assert faults_wanted(cfg, 60.0, 2, 0)  # past the duration, one fault short
    assert not faults_wanted(cfg, 60.0, 3, 0)
    assert not faults_wanted(ChaosConfig(duration=40.0), 36.0, 2, 0)  # no minimum: the duration alone


def test_a_schedule_is_injected_to_its_last_fault_whatever_the_time() -> None:
    cfg = ChaosConfig(duration=62.0, schedule=[(5.0, "kill-worker", None), (33.0, "partition", None)])
    assert faults_wanted(cfg, 90.0, 1, 1)
    assert not faults_wanted(cfg, 20.0, 2, 0)
    assert load_lacks(cfg, 90.0, 1, 1, 9000) == ["1 scheduled fault(s) not injected"]


def test_the_load_ends_once_duration_faults_and_records_are_there() -> None:
    cfg = ChaosConfig(duration=40.0, min_faults=3, min_records=3500)
    assert load_lacks(cfg, 39.0, 3, 0, 9000) == ["40 s of load"]
    assert load_lacks(cfg, 45.0, 3, 0, 2000) == ["3500 records generated (2000)"]
    assert load_lacks(cfg, 45.0, 2, 0, 3500) == ["3 faults (2 injected)"]
    assert load_lacks(cfg, 45.0, 3, 0, 3500) == []


def test_the_load_cap_is_the_profiles_end_and_bounds_the_conditions() -> None:
    """The source's last, low step lasts until the cap: the tool pauses the source when the
    conditions hold; a lost pause still ends the load there."""
    steps = json.loads(chaos_pipeline(40.0, 1, until=120.0).split("steps = ")[1].splitlines()[0])
    assert steps[-2:] == [[30.0, 60], [120.0, 0]]
    assert json.loads(chaos_pipeline(40.0, 1).split("steps = ")[1].splitlines()[0])[-1] == [40.0, 0]
    assert ChaosConfig(duration=40.0).load_cap_s == 120.0
    with pytest.raises(ValueError, match="load_cap"):
        ChaosConfig(duration=40.0, load_cap=30.0)
    with pytest.raises(ValueError, match="min_faults"):
        ChaosConfig(duration=40.0, min_faults=2, schedule=[(5.0, "kill-worker", None)])


# ---- a copy that left while its agent was killed ----


def _state_file(workdir: Any, node: str, instance: str, state: str) -> None:
    d = workdir / f"state-{node}"
    d.mkdir(exist_ok=True)
    (d / f"{instance}.state.json").write_text(json.dumps({"epoch": 1, "scaling": {"state": state}}))


def test_a_copy_whose_state_file_says_terminated_has_left_without_its_agents_event(tmp_path: Any) -> None:
    """A cells copy finished its scale-in as its agent was killed; the agent died before it
    published "terminated", and without the state file the fault would wait for the copy to be
    active again (CHANGELOG.md, "A copy that finished its scale-in as its agent was killed was
    waited for as not recovered")."""
    from foglab.tools.chaos import _waiting_for

    mon = monitor({"n1": [inst("source"), inst("validate"), inst("sink")], "n3": []})
    mon.events = []  # no "terminated" event: the agent that would have sent it was killed
    (tmp_path / "sink").mkdir()
    before = {"p.source.0", "p.validate.0", "p.sink.0", "cells-e2d0"}
    args = (mon, ["n1", "n3"], before, 0.0, 0.0, tmp_path / "sink", 0.0, False)
    assert _waiting_for(*args) == ["cells-e2d0 not active"]
    assert _waiting_for(*args, tmp_path) == ["cells-e2d0 not active"]  # no state file: not known to have left
    _state_file(tmp_path, "n3", "cells-e2d0", "departing")
    assert _waiting_for(*args, tmp_path) == ["cells-e2d0 not active"]  # still leaving: may be re-homed
    _state_file(tmp_path, "n3", "cells-e2d0", "terminated")
    assert _waiting_for(*args, tmp_path) == []
