"""agent.instance.pace alone: the emulated service time keeps an instance busy."""

from __future__ import annotations

import pytest

from agent.instance.pace import Pace


def test_records_keep_the_instance_busy_for_their_service_time_after_what_came_before() -> None:
    pace = Pace(0.004)
    assert not pace.busy(0.0)
    pace.processed(100, 1.0)
    assert pace.busy(1.39) and not pace.busy(1.4 + 1e-9)
    assert pace.busy_until == pytest.approx(1.4)
    pace.processed(50, 1.2)  # still busy: queued behind the first batch
    assert pace.busy_until == pytest.approx(1.6) and pace.cost(50) == pytest.approx(0.2)


def test_without_a_service_time_nothing_waits() -> None:
    pace = Pace(0.0)
    pace.processed(1000, 5.0)
    assert pace.busy_until == 0.0 and not pace.busy(5.0) and pace.cost(1000) == 0.0
