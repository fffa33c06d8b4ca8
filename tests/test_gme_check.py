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
    # ~60k distinct states with the partial-order reduction; 2+2 x 2 is out of reach (docs/gme.md)
    r = exhaustive_check("2fgme", (2, 1), 2)
    assert r.ok, (r.first_failure, r.trace[-30:])
    assert r.states > 10_000


@pytest.mark.parametrize("alg,schedules", [("2fgme", 1500), ("ra1", 1500), ("ra2", 1500)])
def test_random_schedules_2_plus_2_nodes_2_requests(alg, schedules):
    r = random_check(alg, (2, 2), requests=2, schedules=schedules, seed=7)
    assert r.ok, r.first_failure
    assert r.schedules == schedules


@pytest.mark.parametrize("alg,schedules", [("2fgme", 25), ("ra1", 100), ("ra2", 100)])
def test_random_schedules_6_plus_6_nodes(alg, schedules):
    r = random_check(alg, (6, 6), requests=2, schedules=schedules, seed=11)
    assert r.ok, r.first_failure


@pytest.mark.slow
@pytest.mark.parametrize("alg", [
    "2fgme",  # passed: 10,000 schedules, 220 s on the shared 2 cores
    "ra1",  # passed: 10,000 schedules, 133 s
    # KNOWN BUG of our RA2 reconstruction (Joung's paper unavailable): schedule 857 of seed 3
    # puts both groups in the CS. Strict xfail so that a fix shows up as XPASS.
    pytest.param("ra2", marks=pytest.mark.xfail(strict=True, reason="RA2 reconstruction unsafe, docs/gme.md")),
])
def test_ten_thousand_random_schedules_6_plus_6(alg):
    r = random_check(alg, (6, 6), requests=1, schedules=10_000, seed=3)
    assert r.ok, r.first_failure


def test_checker_catches_a_dropped_acks_to_ign_update():
    """Break 2-FGME on purpose (line 36/49 skipped): the checker must report two groups in the CS."""
    r = random_check("2fgme", (2, 2), requests=2, schedules=2000, seed=7, fault="skip_acks_to_ign")
    assert not r.ok
    assert r.safety_violations >= 1
    assert "two groups in the CS" in (r.first_failure or "")


def test_exhaustive_checker_catches_the_fault_too():
    r = exhaustive_check("2fgme", (2, 1), 2, fault="skip_acks_to_ign")
    assert r.safety_violations == 1, r.first_failure
