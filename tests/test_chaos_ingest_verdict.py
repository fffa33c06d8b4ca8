"""The verdict of `fog-agent chaos --pipeline mqtt-ingest` (foglab.tools.chaos_ingest.ingest_verdict)
on fixed inputs: every published reading against the window rows at the sink. No broker, no fleet."""

from __future__ import annotations

from foglab.tools.chaos_ingest import CLOSER, attribute_twice, duplicates_allowed, ingest_verdict

W = 5000
# (rid, sensor, t ms): s1 has 2 readings in window 0 and 1 in window 5000; s2 one in window 0
PUBLISHED = [(1, "s1", 100), (2, "s2", 200), (3, "s1", 4999), (4, "s1", 5000), (5, CLOSER, 99000)]


def _row(key: str, start: int, count: int, total: float) -> dict:
    return {"key": key, "start": start, "end": start + W, "count": count, "sum": total}


EXACT = [_row("s1", 0, 2, 4.0), _row("s2", 0, 1, 2.0), _row("s1", 5000, 1, 4.0)]


def test_every_window_as_published_is_exact_and_the_closer_is_not_checked() -> None:
    v = ingest_verdict(PUBLISHED, EXACT + [_row(CLOSER, 95000, 1, 5.0)], W)
    assert (v.published, v.windows_expected, v.windows_emitted, v.exact) == (4, 3, 3, 3)
    assert (v.missing, v.extra, v.different, v.readings_lost, v.readings_counted_twice) == (0, 0, 0, 0, 0)
    assert v.ok and v.at_least_once


def test_a_missing_window_loses_its_readings() -> None:
    v = ingest_verdict(PUBLISHED, EXACT[:2], W)
    assert (v.exact, v.missing, v.readings_lost, v.readings_counted_twice) == (2, 1, 1, 0)
    assert not v.ok and not v.at_least_once
    assert v.samples == ("missing s1 window 5000: 1 readings",)


def test_a_reading_counted_twice_is_named_by_its_rid_and_is_not_a_loss() -> None:
    # rid 3 counted again (a delivery of the broker again after a crash, under a new number)
    v = ingest_verdict(PUBLISHED, [_row("s1", 0, 3, 7.0)] + EXACT[1:], W)
    assert (v.exact, v.different, v.readings_counted_twice, v.readings_lost, v.missing) == (2, 1, 1, 0, 0)
    assert not v.ok and v.at_least_once
    assert "rid 3" in v.samples[0] and v.twice_rids == (3,)
    # a window emitted twice, a window nobody published in, one lost and another counted twice
    v = ingest_verdict(PUBLISHED, EXACT + [EXACT[1], _row("s9", 0, 1, 1.0), ], W)
    assert (v.exact, v.extra) == (3, 2) and not v.at_least_once
    v = ingest_verdict(PUBLISHED, [_row("s1", 0, 2, 5.0)] + EXACT[1:], W)
    assert (v.mixed, v.readings_lost, v.readings_counted_twice) == (1, 0, 0) and not v.at_least_once


def test_duplicates_are_allowed_only_after_the_source_lost_its_node() -> None:
    src = ["chaos.source.0"]
    drained = [{"kind": "kill-agent", "target": "n1", "t": 9.0, "detail": {"instances": src}},
               {"kind": "restart-broker", "target": "broker", "t": 20.0, "detail": {}},
               {"kind": "kill-worker", "target": "chaos.windows.0", "t": 30.0, "detail": {}},
               {"kind": "partition", "target": "n1", "t": 40.0,  # healed before a re-homing
                "detail": {"instances": src, "active_elsewhere_at_heal": []}},
               {"kind": "kill-worker", "target": "chaos.source.0", "t": 50.0, "detail": {}}]  # its ingest log
    assert duplicates_allowed(drained, src) == []
    crashed = [{"kind": "kill-node", "target": "n1", "t": 20.0, "detail": {"instances": src}},
               {"kind": "kill-broker", "target": "broker", "t": 30.0, "detail": {}},
               {"kind": "partition", "target": "n2", "t": 40.0,  # re-homed, the original fenced
                "detail": {"instances": src, "active_elsewhere_at_heal": src}}]
    assert len(duplicates_allowed(crashed, src)) == 3
    # each reading counted twice is owed to the first fault after its publication: rid 3
    # (published at 4.999 s) to the broker's restart at 4.9995 s, rid 4 (at 5 s) to the loss of the
    # source's node at 8 s; only the latter allows it
    faults = [{"kind": "restart-broker", "target": "broker", "t": 4.9995, "detail": {}},
              {"kind": "kill-node", "target": "n1", "t": 8.0, "detail": {"instances": src}}]
    owed = attribute_twice([3, 4], 0, {r: t for r, _, t in PUBLISHED}, faults, 0.0, src, slack_s=0.0)
    assert (owed["allowed"], owed["not_allowed"]) == (1, 1)
    assert owed["by_fault"] == {"restart-broker broker at 4.9995 s": [3], "kill-node n1 at 8.0 s": [4]}
