"""A keyed operator that forwards (`forwards = True`, TopRoutes with `forward = true`): every record
it applies goes on unchanged with its own id, once, before its own outputs; replays are neither
applied nor forwarded again, and a restart from the saved state resends what was not acked."""

from __future__ import annotations

from pathlib import Path

from agent.instance.keyed_state import KeyedState
from agent.operators.builtin import OperatorContext, in_zone, validate
from foglab.operators.debs import top_routes
from agent.operators.taxi import TaxiGenerator

PARAMS = {"time_field": "dropoff_datetime", "size_ms": 300_000, "lateness_ms": 3_600_000, "forward": True}


def build() -> KeyedState:
    op = top_routes.build(OperatorContext("routes-0", "routes", "n", "map", params=dict(PARAMS)))
    return KeyedState(op, "routes", "all", 16)


def trips(n: int):
    gen = TaxiGenerator(2, "s0")
    out = []
    for seq in range(n):
        rec = in_zone(validate(gen.record(), {}), {})
        if rec is not None:
            out.append(("s0", seq, rec))
    return out


def test_every_applied_record_is_forwarded_once_with_its_id_and_the_windows_follow(tmp_path: Path) -> None:
    items = trips(6000)
    ks = build()
    out = ks.apply("p0", items[:3000], 1) + ks.apply("p0", items[1000:], 2)  # 1000..2999 replayed
    fwd = [(s, q) for s, q, _ in out if s == "s0"]
    assert fwd == [(s, q) for s, q, _ in items]  # each once, in order, ids unchanged
    assert [r for s, _, r in out if s == "s0"] == [r for _, _, r in items]  # content unchanged
    windows = [r for s, _, r in out if s != "s0"]
    assert windows and all(s.startswith("routes#") for s, _, _ in out if s != "s0")
    assert ks.counts["duplicates_skipped"] == 2000

    # crash after a save: the reloaded state resends its unacked outputs, forwarded trips included
    path = tmp_path / "routes-0.keyed.json"
    ks.save(path)
    again = build()
    resent = again.restore(KeyedState.load(path))
    assert [(s, q) for s, q, _ in resent] == [(s, q) for s, q, _ in out]
    assert again.apply("p0", items, 3) == []  # everything is a replay now


def test_without_forward_only_the_windows_go_on() -> None:
    op = top_routes.build(OperatorContext("routes-0", "routes", "n", "map",
                                          params=dict(PARAMS, forward=False)))
    ks = KeyedState(op, "routes", "all", 16)
    out = ks.apply("p0", trips(6000), 1)
    assert out and all(s.startswith("routes#") for s, _, _ in out)
