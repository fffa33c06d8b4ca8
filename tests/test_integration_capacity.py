"""The agent puts its own calibrated capacity into a worker's spec when the pipeline says
capacity = "calibrate" (and leaves numeric capacities and uncalibrated nodes alone)."""

from __future__ import annotations

from pathlib import Path

from agent.measure.capacity import CapacityRecord, CapacityStore
from agent.node.requests import spec_with_capacity
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec

TOML = """
[pipeline]
name = "cal"
[scaling]
policy = "decentralized"
capacity = "calibrate"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
[operator.scaling]
capacity = 123.0
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def spec(operator: str, extra: dict) -> InstanceSpec:
    return InstanceSpec(instance=f"cal.{operator}.0", operator=operator, node="", cluster="c", pipeline="cal",
                        pipeline_toml=TOML, broker=BrokerSpec(host="127.0.0.1", port=1), succs=(), preds=(),
                        keeper=True, active=True, extra=extra)


def test_calibrated_capacity_of_this_node_wins_over_the_inherited_one(tmp_path: Path) -> None:
    CapacityStore(tmp_path).put(CapacityRecord(node="n1", operator="sink", capacity=321.0))
    CapacityStore(tmp_path).put(CapacityRecord(node="n2", operator="sink", capacity=999.0))
    s = spec_with_capacity(spec("sink", {"capacity": 999.0, "seed": 3}), tmp_path, "n1")
    assert s.extra["capacity"] == 321.0 and s.extra["seed"] == 3  # n1's own value, extra kept


def test_numeric_capacity_and_missing_calibration_leave_the_spec_alone(tmp_path: Path) -> None:
    CapacityStore(tmp_path).put(CapacityRecord(node="n1", operator="in_zone", capacity=5.0))
    s = spec("in_zone", {"capacity": 123.0})
    assert spec_with_capacity(s, tmp_path, "n1") == s  # its [operator.scaling] capacity is a number
    s2 = spec("sink", {})
    assert spec_with_capacity(s2, tmp_path, "n9") == s2  # not calibrated on n9: worker's fallback
