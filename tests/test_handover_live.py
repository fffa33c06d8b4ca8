"""`fog-agent bench handover --live` (foglab.tools.handover_live): a real agent and its workers on a
private Mosquitto run the keyed count, forced to scale out and in; the figures come from the
instances' stats, their log and the sink's stamped outputs. The smallest size only (~15-20 s on
the shared 2-core machine; the table in docs/operators.md comes from the command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foglab.tools.handover_live import LiveParams, check_outputs, run_live_bench

pytestmark = [pytest.mark.broker]


def test_live_handover_moves_the_groups_of_a_scale_out_and_in_exactly_once(tmp_path: Path) -> None:
    """Half the keeper's 128 groups go to the copy and all come back; their hand-over messages
    and bytes are the instances' own counters, the rounds' times their own stamps; every output
    is the reference's, once."""
    res = run_live_bench(sizes=(0,), rounds=1, workdir=tmp_path, baseline=False, params={"hold": 1.5},
                         say=lambda _line: None)
    run = res["sizes"][0]["stateful"][0]
    v = run["verdict"]
    assert v["exactly_once"] and res["exactly_once"], v
    assert v["outputs"] == v["generated"] > 500, v
    for phase in ("scale_out", "scale_in"):
        r = run[phase]
        assert r["groups_moved"] == 64, (phase, r)  # split_share: half of the keeper's 128 groups
        assert r["handover_messages"] >= 2 * 64, (phase, r)  # at least a chunk and an Installed per group
        assert r["handover_bytes"] > 64 * 20, (phase, r)
        assert r["protocol_messages"] >= 1, (phase, r)
        assert r["round_ms"] is not None and 0 < r["round_ms"] < 60_000, (phase, r)
        assert 0 < r["moving_keys"] < 64 and r["moved_groups_seen"] > 0, (phase, r)
        assert r["group_ms_median"] is not None and r["group_ms_median"] > 0, (phase, r)
        assert 0 < r["min_ratio_1s"] <= 2.0, (phase, r)
        assert r["p99_ms_moving"] >= r["p50_ms_moving"] > 0 and r["p99_ms_other"] >= r["p50_ms_other"] > 0, r
    assert run["keys_held_at_end"] == 64  # every hot key back at the keeper
    summary = res["sizes"][0]["summary"]["scale_out"]
    assert summary["round_ms"] == run["scale_out"]["round_ms"] and summary["stateless_round_ms"] is None


def test_the_verdict_sees_a_lost_a_doubled_and_a_reordered_output() -> None:
    """`check_outputs` against the stream's reference: the keyed count's n-th output of a key
    comes from that key's n-th record."""
    p = LiveParams(0, stateful=True, hot_keys=2)
    good = [("h0", 1, 0, 0.0, "a", 0.0), ("h1", 1, 1, 0.0, "a", 0.0), ("h0", 2, 2, 0.0, "b", 0.0)]
    assert check_outputs(good, 3, p, 0)["exactly_once"]
    lost = check_outputs(good[:2], 3, p, 0)
    assert (lost["lost"], lost["exactly_once"]) == (1, False)
    applied_twice = check_outputs(good + [("h0", 3, 2, 0.0, "b", 0.0)], 3, p, 0)  # a record counted twice
    assert (applied_twice["differing"], applied_twice["exactly_once"]) == (1, False)
    swapped = [("h0", 2, 0, 0.0, "a", 0.0), good[1], ("h0", 1, 2, 0.0, "b", 0.0)]  # per-key order broken
    assert check_outputs(swapped, 3, p, 0)["lost"] == 2
    assert check_outputs(good + [good[0]], 3, p, 0)["duplicated"] == 1
    assert check_outputs(good, 3, p, 1)["duplicated"] == 1  # an id at two sinks
