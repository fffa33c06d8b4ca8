"""What the instance reads of a source (agent.operators.sources: `Source`, `SourceState`,
`with_state`) and how its source part paces on it (agent.instance.source.Source), on the
operators alone: no worker, no broker."""

from __future__ import annotations

from typing import Any, Dict, List

from agent.instance.source import SOURCE_RESERVE, Source
from agent.operators.builtin import OperatorContext
from agent.operators.sources import SourceState, with_state
from agent.operators.taxi import MqttIngestSource, TaxiSource


class BareSource:
    """A user's source written against the protocol's methods only: no `generated`, `paused`
    or `catching_up` of its own."""

    kind = "source"

    def __init__(self) -> None:
        self.n = 0

    def start(self, now: float) -> None:
        pass

    def poll(self, now: float, budget: int) -> List[Any]:
        return []

    def next_due(self, now: float) -> float:
        return now + 1.0

    def close(self) -> None:
        pass

    def stats(self) -> Dict[str, Any]:
        return {}


def _ctx(**params: Any) -> OperatorContext:
    return OperatorContext(instance="p.source.0", operator="source", node="n", kind="source", params=params)


def test_the_built_in_sources_inherit_the_state_defaults() -> None:
    for src in (TaxiSource(_ctx(rate=10)), MqttIngestSource(_ctx(topic="lab/t"))):
        assert isinstance(src, SourceState)
        assert (src.generated, src.paused, src.catching_up) == (0, False, False)
        assert with_state(src) is src


def test_a_source_without_the_state_is_given_its_defaults_at_load() -> None:
    bare = BareSource()
    assert with_state(bare) is bare
    assert (bare.generated, bare.paused, bare.catching_up) == (0, False, False)


def test_with_state_keeps_what_a_source_has_already() -> None:
    bare = BareSource()
    bare.generated, bare.paused = 7, True  # type: ignore[attr-defined]
    with_state(bare)
    assert (bare.generated, bare.paused, bare.catching_up) == (7, True, False)


def test_a_paused_source_cannot_produce_and_an_unpaused_one_can() -> None:
    part = Source("p.source.0", BareSource(), {})
    assert part.can_produce()
    part.operator.paused = True
    assert not part.can_produce()


def test_a_paused_source_that_is_catching_up_still_produces() -> None:
    src = TaxiSource(_ctx(rate=10))
    part = Source("p.source.0", src, {})
    src.resume(100, 160, 10.0)
    src.paused = True
    assert src.catching_up and part.can_produce()
    src.poll(10.0, budget=60)
    assert not src.catching_up and not part.can_produce()


def test_the_reservation_and_the_resume_point_follow_generated() -> None:
    src = TaxiSource(_ctx(rate=10))
    part = Source("p.source.0", src, {})
    assert part.reserve(0.0, 50) and part.reserved == 50 + SOURCE_RESERVE
    assert not part.reserve(0.0, 50)  # within the reservation: nothing to write
    src.generated = 1234
    assert part.resume_seq(lambda: None) == 1234  # nothing pending: resume after the last generated


def test_an_instance_that_is_no_source_reads_the_defaults() -> None:
    part = Source("p.map.0", None, {})
    assert (part.replayable, part.sensor, part.topic) == (False, False, None)
    assert part.can_produce() and part.resume_seq(lambda: None) == 0
