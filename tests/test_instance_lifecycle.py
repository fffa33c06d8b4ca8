"""agent.instance.lifecycle alone: phases, the stop and its drain deadline, the exit decided."""

from __future__ import annotations

import pytest

from agent.instance.events import Started, Tick
from agent.instance.lifecycle import EXIT_DRAIN_TIMEOUT, EXIT_OK, Lifecycle, Phase
from agent.protocol.errors import LocalProtocolError


def test_an_event_the_phase_does_not_accept_is_an_error_naming_the_phase() -> None:
    life = Lifecycle("op-0")
    with pytest.raises(LocalProtocolError, match="op-0: Tick in phase new"):
        life.check(Tick(0.0))
    life.check(Started(0.0))
    life.run()
    life.check(Tick(0.0))
    with pytest.raises(LocalProtocolError, match="Started in phase running"):
        life.check(Started(0.0))


def test_a_stop_drains_until_its_deadline_then_exits_with_the_drain_timeout() -> None:
    life = Lifecycle("op-0")
    life.run()
    assert life.stop(1.0, 10.0) and life.stopping and life.phase is Phase.STOPPING
    assert not life.stop(5.0, 10.0)  # the first deadline holds
    life.check_stopped(11.0, False)
    assert life.exit is None and life.due() is None
    life.check_stopped(11.5, False)
    assert life.due() == (EXIT_DRAIN_TIMEOUT, "drain timeout: successors did not ack everything", False)


def test_a_drained_stop_exits_once() -> None:
    life = Lifecycle("op-0")
    life.run()
    life.stop(0.0, 10.0)
    life.check_stopped(1.0, True)
    assert life.due() == (EXIT_OK, "stopped", False)
    life.exited()
    assert life.phase is Phase.EXITED and life.due() is None


def test_a_termination_exits_for_good_with_its_reason_but_a_timeout_keeps_its_own() -> None:
    life = Lifecycle("op-0")
    life.run()
    life.terminate(2.0, 30.0, "terminated by the scaling protocol")
    assert life.final and life.stopping
    life.check_stopped(3.0, True)
    assert life.due() == (EXIT_OK, "terminated by the scaling protocol", True)
    late = Lifecycle("op-1")
    late.run()
    late.terminate(2.0, 30.0, "terminated by the scaling protocol")
    late.check_stopped(40.0, False)
    assert late.due() == (EXIT_DRAIN_TIMEOUT, "drain timeout: successors did not ack everything", True)
