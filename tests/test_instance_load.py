"""agent.instance.load alone: what an instance measures of its load, on fake clocks, without an instance."""

from __future__ import annotations

from typing import List

import pytest

from agent.instance.load import Load, no_clock


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_load_is_the_records_received_and_produced_per_second_of_the_period() -> None:
    load = Load()
    load.begin(10.0)
    load.arrived(30)
    load.produced(10)
    assert load.measure(12.0) == pytest.approx(20.0) and load.last == pytest.approx(20.0)
    load.arrived(5)  # the next period begins where the last one ended
    assert load.measure(17.0) == pytest.approx(1.0)
    assert load.measure(17.0) == 0.0  # nothing in an empty period, and no division by zero


def test_only_records_taken_in_count_as_arrivals_of_the_live_signals() -> None:
    load = Load()
    load.begin(0.0)
    load.arrived(40)
    load.produced(100)
    sig = load.take_signals(4.0)
    assert sig.input_rate == pytest.approx(10.0) and load.last_signals is sig


def test_processing_time_is_the_interval_clock_plus_the_modelled_service_time() -> None:
    perf, cpu = FakeClock(), FakeClock()
    load = Load(perf, cpu)
    load.begin(0.0)
    perf.t = 5.0
    t0 = load.clock()
    perf.t = 5.5
    load.processed(100, t0, 0.25)
    cpu.t = 1.0
    sig = load.take_signals(2.0)
    assert sig.busy == pytest.approx(0.75) and sig.processed == 100
    assert sig.cpu == pytest.approx(0.5)


def test_the_signals_feed_the_capacity_started_from_the_scaling_parameters() -> None:
    load = Load()
    assert load.capacity.value == 500.0
    load.set_capacity(200.0)
    assert load.capacity.value == 200.0
    load.begin(0.0)
    values: List[float] = []
    for period in range(1, 30):
        load.processed(100, 0.0, 1.0)  # 10 ms per record: 100 records/s
        load.take_signals(float(period))
        values.append(load.capacity.value)
    assert values[-1] == pytest.approx(100.0, rel=0.05)


def test_backpressure_is_measured_from_the_blocked_calls() -> None:
    load = Load(no_clock, no_clock)
    load.begin(0.0)
    load.blocked(1.0, True)
    load.blocked(3.0, False)
    assert load.take_signals(4.0).backpressure == pytest.approx(0.5)
