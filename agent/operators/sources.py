"""What the instance asks of a source: the `Source` protocol and the two kinds the agent knows how
to keep exactly once, told apart once, at load, by `source_caps` (docs/operators.md, "Sources").

- A **replayable** source (`ReplayableSource`, e.g. taxi.TaxiSource) can make its records again
  from a position: restarted, it is wound to the first record its successors had not acked and
  regenerates up to what its previous incarnation reserved (`resume`); while it does so,
  `catching_up` is true and a pause (`paused`) does not hold those records back.
- A **sensor** source (`SensorSource`, taxi.MqttIngestSource) reads an MQTT topic and cannot ask
  for a reading again: the worker reads `topic` on a connection of its own and hands each delivery
  to `ingest` with its ack token; the instance logs what the source numbers (`take_log`), acks a
  delivery once its record is acked downstream (`settled`), numbers each incarnation above the
  last (`number_from`) and sends the logged records again after a restart (`replay`).
- Any other source is polled and never resumed: restarted, it starts over (logged once).

The state the instance reads of every source (`generated`, `paused`, `catching_up`) has
defaults in `SourceState`, which the built-in sources inherit; `with_state` gives them, once at
load, to a source that does not inherit it, so that the instance reads the attributes as they are
and never guesses.

Rules of this file: the API only, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from agent.dataplane.envelope import Item

try:  # Python 3.8+: typing.Protocol
    from typing import Protocol
except ImportError:  # pragma: no cover
    Protocol = object  # type: ignore[assignment,misc]

__all__ = ["Source", "ReplayableSource", "SensorSource", "SourceCaps", "SourceState", "source_caps",
           "with_state"]


class Source(Protocol):
    """Every source: `poll` returns up to `budget` items (instance, number, record), numbers
    increasing; `generated` is the next number it will give. `paused` is set by the instance
    (a `set` RPC); while it is true the instance polls only a source that is `catching_up`."""

    kind: str
    generated: int
    paused: bool

    @property
    def catching_up(self) -> bool: ...

    def start(self, now: float) -> None: ...

    def poll(self, now: float, budget: int) -> List[Item]: ...

    def next_due(self, now: float) -> float: ...

    def close(self) -> None: ...

    def stats(self) -> Dict[str, Any]: ...


class ReplayableSource(Source, Protocol):
    def resume(self, resume_from: int, catch_up_to: int, elapsed: float) -> None: ...


class SensorSource(Source, Protocol):
    topic: str

    def ingest(self, topic: str, payload: bytes, token: Any = None, dup: bool = False) -> None: ...

    def number_from(self, first: int) -> None: ...

    def replay(self, entries: List[Any], resume_from: int) -> None: ...

    def take_log(self) -> List[List[Any]]: ...

    def settled(self, below: int) -> List[Any]: ...


_SENSOR = ("ingest", "number_from", "replay", "take_log", "settled")


@dataclass(frozen=True)
class SourceCaps:
    """What a source can do, found once at load. replayable: `resume`; sensor: the whole
    `SensorSource` protocol; topic: the topic a source with `ingest` reads (sensor or not: a
    plain `ingest(topic, payload)` gets its deliveries acked at once)."""

    replayable: bool = False
    sensor: bool = False
    topic: Optional[str] = None


def source_caps(operator: Any) -> SourceCaps:
    topic = getattr(operator, "topic", None) if callable(getattr(operator, "ingest", None)) else None
    return SourceCaps(
        replayable=callable(getattr(operator, "resume", None)),
        sensor=all(callable(getattr(operator, name, None)) for name in _SENSOR),
        topic=topic if isinstance(topic, str) and topic else None,
    )


class SourceState:
    """The defaults of what the instance reads of a source: nothing generated yet, not paused,
    never catching up (only a replayable source that regenerates after a restart does). The
    built-in sources inherit it; a source class may too."""

    kind = "source"
    generated: int = 0
    paused: bool = False

    @property
    def catching_up(self) -> bool:
        return False


_STATE_DEFAULTS = (("generated", 0), ("paused", False), ("catching_up", False))


def with_state(operator: Any) -> Source:
    """`operator`, given at load the `SourceState` attributes it lacks (a source that does not
    inherit `SourceState`): the instance then reads `generated`, `paused` and `catching_up` as
    they are. A source that inherits `SourceState` is returned untouched."""
    if not isinstance(operator, SourceState):
        for name, default in _STATE_DEFAULTS:
            if not hasattr(operator, name):
                setattr(operator, name, default)
    return operator
