"""Safety and liveness of 2-FGME, RA1 and RA2 over every / many delivery orders (agent.sim.gme_check)."""

from __future__ import annotations

import pytest

from agent.sim.gme_check import exhaustive_check, random_check

ALGS = ("2fgme", "ra1", "ra2")


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("sizes,requests", [((1, 1), 3), ((2, 1), 1)])
def test_exhaustive_small_systems_are_safe_and_live(alg, sizes, requests):
    r = exhaustive_check(alg, sizes, requests)
    assert r.ok, (r.first_failure, r.trace[-30:])
    assert r.schedules >= 1 and r.states > 10  # something was explored, and it terminated


def test_exhaustive_2fgme_two_plus_one_nodes_two_requests():
    # 62k distinct states with the partial-order reduction, 32k with the symmetry reduction
    r = exhaustive_check("2fgme", (2, 1), 2, symmetry=True)
    assert r.ok, (r.first_failure, r.trace[-30:])
    assert r.states > 10_000


def test_exhaustive_2fgme_two_plus_two_nodes_one_request():
    # ~250k states (symmetry + POR). 2+2 x 2 requests exceeds 8M states: not in the suite (docs/gme.md)
    r = exhaustive_check("2fgme", (2, 2), 1, symmetry=True)
    assert r.ok, (r.first_failure, r.trace[-30:])
    assert r.states > 100_000


def test_symmetry_reduction_keeps_the_fault_visible():
    r = exhaustive_check("2fgme", (2, 1), 2, fault="skip_acks_to_ign", symmetry=True)
    assert r.safety_violations == 1, r.first_failure


@pytest.mark.parametrize("alg,schedules", [("2fgme", 1500), ("ra1", 1500), ("ra2", 1500)])
def test_random_schedules_2_plus_2_nodes_2_requests(alg, schedules):
    r = random_check(alg, (2, 2), requests=2, schedules=schedules, seed=7)
    assert r.ok, r.first_failure
    assert r.schedules == schedules


@pytest.mark.parametrize("alg,schedules", [("2fgme", 10), ("ra1", 40), ("ra2", 40)])
def test_random_schedules_6_plus_6_nodes_two_requests(alg, schedules):
    # 2 requests per node: 2-FGME's authorization churn makes these runs ~10x longer (docs/gme.md)
    r = random_check(alg, (6, 6), requests=2, schedules=schedules, seed=11)
    assert r.ok, r.first_failure


@pytest.mark.parametrize("alg", ALGS)
def test_ten_thousand_random_schedules_6_plus_6(alg):
    """The issue's bar: >= 10,000 random schedules of 6+6 nodes, safe and live, for each algorithm.

    RA2 failed here at schedule 857 before the VF[self] fix (see test_ra2_ack_carries_own_entries).
    """
    r = random_check(alg, (6, 6), requests=1, schedules=10_000, seed=3)
    assert r.ok, r.first_failure
    assert r.schedules == 10_000


def test_2fgme_withdrawal_voids_an_in_flight_ack_too():
    """Regression (DEVIATION 3 in gme_fgme): the exhaustive 2+2 x 2 search found two groups in
    the CS at 6.1 M states; this random seed reaches the same defect at schedule 4,976."""
    r = random_check("2fgme", (2, 2), requests=2, schedules=5_000, seed=100)
    assert r.ok, r.first_failure


def test_ra2_ack_carries_own_entries_not_what_others_believe():
    """Regression (RA2 counterexample): a captured node whose Start is still in flight learns
    VF[self] = 1 from a same-forum node; its Ack to a higher-priority other-forum requester must
    still say 0 entries, otherwise the requester cannot tell the Ack out-of-date."""
    from agent.protocol.gme_ra2 import Ra2Ack, Ra2Node, Ra2Req

    groups = {0: 0, 1: 0, 2: 1}
    n0 = Ra2Node(0, groups)
    n0.request()  # sn = 1, k = 1
    n0.receive(Ra2Req(2, 1, 0, 1, (0, 0, 0)))  # forum 1 at sn 0: higher priority, acked
    n0.receive(Ra2Ack(1, 1, (1, 1, 0)))  # node 1 (a captain) believes node 0 entered once
    assert n0.vf[0] == 0 and n0.entries == 0
    outs = n0.receive(Ra2Req(2, 1, 0, 2, (0, 0, 0)))  # 2's next request, still higher priority
    acks = [o.message for o in outs if isinstance(o.message, Ra2Ack)]
    assert acks and all(a.vf[0] == 0 for a in acks)


def test_checker_catches_a_dropped_acks_to_ign_update():
    """Break 2-FGME on purpose (line 36/49 skipped): the checker must report two groups in the CS."""
    r = random_check("2fgme", (2, 2), requests=2, schedules=2000, seed=7, fault="skip_acks_to_ign")
    assert not r.ok
    assert r.safety_violations >= 1
    assert "two groups in the CS" in (r.first_failure or "")


def test_exhaustive_checker_catches_the_fault_too():
    r = exhaustive_check("2fgme", (2, 1), 2, fault="skip_acks_to_ign")
    assert r.safety_violations == 1, r.first_failure
