"""Live signals of a running instance (docs/measurement.md, "Live signals"): the sans-IO
accumulator and the online capacity on constructed numbers, then a real fleet whose in_zone
instance is slowed down by a control message and reports a lower capacity within a few periods."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.measure.capacity import LiveCapacity
from agent.measure.signals import PeriodSignals


def test_backpressure_ratio_counts_blocked_time_within_the_period() -> None:
    s = PeriodSignals(0.0, cpu_seconds=10.0)
    s.blocked(1.0, True)
    s.blocked(2.0, True)  # still blocked: no double count
    s.blocked(3.5, False)  # 2.5 s blocked
    s.blocked(8.0, True)  # blocked again until the end of the period: 2 s more
    s.arrived(400)
    s.processed(300, 1.5)
    sig = s.take(10.0, cpu_seconds=12.0)
    assert sig.backpressure == pytest.approx(0.45)
    assert sig.input_rate == pytest.approx(40.0) and sig.processed_rate == pytest.approx(30.0)
    assert sig.cpu == pytest.approx(0.2) and sig.busy_ratio == pytest.approx(0.15)
    # the open interval carries over: the next period starts blocked
    s.blocked(11.0, False)
    nxt = s.take(20.0, cpu_seconds=12.0)
    assert nxt.backpressure == pytest.approx(0.1) and nxt.cpu == 0.0 and nxt.processed == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.booleans()), min_size=1, max_size=40))
def test_backpressure_ratio_equals_the_blocked_measure(steps: List[Any]) -> None:
    """Against a direct integration of the step function: ratio in [0, 1], equal to blocked/period."""
    s = PeriodSignals(0.0)
    t = 0.0
    blocked_total = 0.0
    state = False
    for dt, flag in steps:
        if state:
            blocked_total += dt
        t += dt
        s.blocked(t, flag)
        state = flag
    end = t + 1.0
    if state:
        blocked_total += 1.0
    sig = s.take(end)
    assert 0.0 <= sig.backpressure <= 1.0
    assert sig.backpressure == pytest.approx(blocked_total / end, abs=1e-9)


def test_live_capacity_follows_the_service_time_and_is_clamped() -> None:
    cap = LiveCapacity(200.0)  # 5 ms per record
    assert cap.value == 200.0  # nothing measured: the base
    cap.update(busy_seconds=0.5, records=100)  # 5 ms: unchanged
    assert cap.value == pytest.approx(200.0)
    values = [cap.update(busy_seconds=1.5, records=100) for _ in range(6)]  # 15 ms: 3x slower
    assert values == sorted(values, reverse=True)  # falls monotonically...
    assert values[-1] == pytest.approx(200.0 / 3, rel=0.05)  # ...to base/3 within 6 periods (EWMA 0.5)
    cap.update(busy_seconds=0.0, records=0)  # an idle period says nothing
    assert cap.value == pytest.approx(values[-1])
    for _ in range(30):
        cap.update(busy_seconds=100.0, records=10)  # absurdly slow: clamped at x0.25
    assert cap.value == pytest.approx(50.0)
    with pytest.raises(ValueError):
        LiveCapacity(0.0)


SLOW_PIPELINE = """
[pipeline]
name = "slow"
[scaling]
policy = "none"
period = 1.0
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
params = {{ seed = 3, profile = "constant", rate = {rate} }}
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
service_time_ms = 2.0
[operator.scaling]
policy = "none"
period = 1.0
capacity = 500.0
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


@pytest.mark.broker
@pytest.mark.slow
def test_a_slowed_instance_reports_a_lower_capacity_within_a_few_periods(tmp_path: Path, mosquitto: Any) -> None:
    """Real agent and workers: in_zone runs at 2 ms per record (capacity 500/s); a control message
    makes it 6 ms. Its published capacity must fall to about a third (166/s) within a few 1 s
    periods, and its signals must show the rates it works at."""
    from foglab.tools.demo import Fleet, Monitor

    fleet = Fleet(tmp_path, nodes=("n1",), slots=4, cluster="livesig", broker_host=mosquitto.host,
                  broker_port=mosquitto.port, shutdown_timeout=8.0)
    fleet.start()
    mon = Monitor(mosquitto.host, mosquitto.port, fleet.cluster)
    inst = "slow.in_zone.0"
    try:
        fleet.wait_online(mon)
        fleet.deploy(SLOW_PIPELINE.format(rate=100.0))

        def live(m: Monitor) -> Any:
            return m.stats_of(inst).get("live_capacity")

        def sig(m: Monitor) -> Any:
            return m.stats_of(inst).get("signals") or {}

        assert mon.wait(lambda m: (sig(m).get("processed_rate") or 0) > 50, 60), mon.stats_of(inst)
        time.sleep(3.0)  # a few periods at the configured service time
        before = live(mon)
        s0 = sig(mon)
        assert before == pytest.approx(500.0, rel=0.15), mon.stats_of(inst)
        assert s0["input_rate"] == pytest.approx(100.0, rel=0.3) and s0["backpressure"] < 0.2, s0
        assert 0.1 < s0["busy_ratio"] < 0.4, s0  # 100/s x 2 ms = 0.2
        assert mon.call(fleet.host, fleet.port, "n1",
                        {"op": "set", "instance": inst, "fields": {"service_time_ms": 6.0}})["ok"]
        t_set = time.monotonic()
        assert mon.wait(lambda m: (live(m) or 1e9) < 500.0 / 3 * 1.15, 15), mon.stats_of(inst)
        took = time.monotonic() - t_set
        time.sleep(3.0)  # settled: three more periods
        after = live(mon)
        s1 = sig(mon)
        print(f"capacity tracking: {before:.1f}/s at 2 ms -> {after:.1f}/s at 6 ms after {took:.1f} s; "
              f"signals before {s0}, after {s1}")
        assert after == pytest.approx(500.0 / 3, rel=0.1)
        assert 0.4 < s1["busy_ratio"] < 0.9, s1  # 100/s x 6 ms = 0.6
    finally:
        mon.close()
        fleet.stop(timeout=15)
