"""The daemon's loop events (agent.node.loopevents): one table dispatches them by type, and it
names every event the other threads can enqueue, so none can arrive without a handler."""

from __future__ import annotations

import dataclasses

import pytest

from agent.node import loopevents
from agent.node.daemon import Agent


def test_the_loop_table_has_a_handler_for_every_event_and_nothing_else() -> None:
    kinds = set(loopevents.LoopEvent.__subclasses__())
    assert kinds and set(Agent._LOOP) == kinds
    assert set(loopevents.__all__) == {k.__name__ for k in kinds} | {"LoopEvent"}


def test_an_event_is_a_frozen_value() -> None:
    line = loopevents.WorkerLine("p.work.0", '{"event": "ready"}\n')
    with pytest.raises(dataclasses.FrozenInstanceError):
        line.instance = "other"  # type: ignore[misc]
    assert line == loopevents.WorkerLine("p.work.0", '{"event": "ready"}\n')
