"""The demo's decision -> first record per operator (foglab.tools.rescale_split): a keyed copy is
timed to its first APPLIED record and split into round, hand-over and first record; the parts
add up to the total; a stateless copy has no hand-over. The stamps themselves are checked in
order on a real keyed scale-out in tests/test_group_wiring.py."""

from __future__ import annotations

import pytest

from foglab.tools.rescale_split import rescale_by_operator, split_one

AT = 1_800_000_000.0


def _stats():
    return {
        "p.in_zone.0": {"decisions": [{"kind": "scale_out", "at": AT, "spawned_at": AT + 0.2, "new": ["iz-1"]},
                                      {"kind": "scale_in", "at": AT + 9}]},
        "iz-1": {"activated_at": AT + 0.3, "first_record_at": AT + 0.35},
        "p.route_counts.0": {"handover": {"groups_out": 64},
                             "decisions": [{"kind": "scale_out", "at": AT + 1, "spawned_at": AT + 1.1,
                                            "chunks_at": AT + 2.5, "new": ["rc-1"]}]},
        # arrived at +1.3 (held), installed at +2.6, applied at +2.7
        "rc-1": {"handover": {"groups_in": 64}, "activated_at": AT + 1.2, "first_record_at": AT + 1.3,
                 "first_installed_at": AT + 2.6, "first_applied_at": AT + 2.7},
    }


OPS = {"p.in_zone.0": "in_zone", "iz-1": "in_zone", "p.route_counts.0": "route_counts", "rc-1": "route_counts"}


def test_per_operator_with_the_keyed_copy_split_into_round_handover_and_first_record() -> None:
    out = rescale_by_operator(_stats(), OPS, warm={"iz-1": 3.5, "rc-1": None}, ready={"iz-1": 0.12})
    assert set(out) == {"in_zone", "route_counts"}
    assert out["in_zone"]["cold_spawns"] == 0 and out["route_counts"]["cold_spawns"] == 1
    assert out["in_zone"]["each"][0]["warm_age"] == 3.5 and out["route_counts"]["each"][0]["warm_age"] is None
    assert out["in_zone"]["each"][0]["start_to_ready"] == 0.12  # the worker's own part of the spawn
    assert out["route_counts"]["each"][0]["start_to_ready"] is None
    iz, rc = out["in_zone"], out["route_counts"]
    assert iz["keyed"] is False and rc["keyed"] is True
    assert iz["decision_to_first_record_s"] == {"median": 0.35, "max": 0.35, "n": 1}
    assert iz["parts_median_s"] == {"round": 0.3, "spawn": 0.2, "announce": 0.1, "first": 0.05}
    # the first APPLIED record (+2.7), not the first that arrived to be held (+1.3)
    assert rc["decision_to_first_record_s"]["median"] == pytest.approx(1.7)
    p = rc["parts_median_s"]
    assert p["round"] == pytest.approx(0.2) and p["handover"] == pytest.approx(1.4)
    assert p["eos_wait"] == pytest.approx(1.3) and p["transfer"] == pytest.approx(0.1)
    assert p["first"] == pytest.approx(0.1)
    for row in rc["each"] + iz["each"]:
        assert row["round"] + (row.get("handover") or 0) + row["first"] == pytest.approx(row["total"], abs=0.002)
        assert 0 <= row["round"] <= row["total"]
    assert rc["each"][0]["handover"] <= rc["each"][0]["total"]


def test_a_copy_that_never_applied_a_record_is_left_out_and_missing_stamps_stay_none() -> None:
    st = _stats()
    del st["rc-1"]["first_applied_at"]  # it left before its groups came
    del st["iz-1"]["activated_at"]
    out = rescale_by_operator(st, OPS)
    assert "route_counts" not in out
    assert out["in_zone"]["each"] == [{"total": 0.35, "round": None, "spawn": 0.2, "announce": None, "first": None,
                                       "cold": False, "warm_age": None, "start_to_ready": None}]
    assert split_one({"kind": "scale_out", "new": ["x"]}, [{"first_record_at": AT}], keyed=False) is None
