"""The compiled exhaustive search (agent.sim.gme_fast) against the Python one (agent.sim.gme_check).

The compiled loop is only trusted because it visits exactly what the Python search visits: same
states, transitions, terminal states and full expansions, in every mode, and the same first
violation for the seeded faults.
"""

from __future__ import annotations

import pytest

from agent.sim.gme_check import exhaustive_check
from agent.sim.gme_fast import fast_check

COUNTS = lambda r: (r.states, r.transitions, r.schedules, r.full_expansions)  # noqa: E731


@pytest.mark.parametrize("alg,sizes,requests,symmetry,reduction,merge", [
    ("2fgme", (1, 1), 3, True, True, True),
    ("2fgme", (2, 1), 2, True, True, True),
    ("2fgme", (2, 1), 2, False, True, False),
    ("2fgme", (2, 2), 1, True, True, True),
    ("2fgme", (2, 2), 1, False, False, False),
    ("2fgme", (3, 1), 1, True, True, False),
    ("ra1", (2, 1), 1, False, True, False),
    ("ra2", (2, 1), 1, False, True, False),
    ("ra2", (1, 1), 3, False, False, False),
    ("2fgme", (2, 1), (2, 1, 2), True, True, True),  # one budget per node
])
def test_the_compiled_search_visits_exactly_what_the_python_search_visits(alg, sizes, requests, symmetry,
                                                                          reduction, merge):
    kw = dict(symmetry=symmetry, reduction=reduction, merge_dead=merge)
    slow = exhaustive_check(alg, sizes, requests, hash_states=True, **kw)
    fast = fast_check(alg, sizes, requests, **kw)
    assert slow.ok and fast.ok
    assert COUNTS(fast) == COUNTS(slow)
    assert (fast.symmetry, fast.merged) == (slow.symmetry, slow.merged)
    assert fast.collision_bound is not None and fast.collision_bound < 1e-9


@pytest.mark.parametrize("fault,sizes,requests", [
    ("skip_acks_to_ign", (2, 1), 2), ("skip_acks_to_ign", (2, 2), 1), ("undo_deviation_3", (2, 2), 2),
])
def test_the_compiled_search_stops_at_the_same_first_violation(fault, sizes, requests):
    fast = fast_check("2fgme", sizes, requests, fault=fault)
    assert fast.safety_violations == 1 and "two groups in the CS" in (fast.first_failure or "")
    if sizes != (2, 2) or requests == 1:  # the Python search of 2+2 x 2 takes ~10 s: not twice
        slow = exhaustive_check("2fgme", sizes, requests, fault=fault, symmetry=True, merge_dead=True,
                                hash_states=True)
        assert (fast.states, fast.first_failure) == (slow.states, slow.first_failure)


def test_the_compiled_search_reports_a_raising_core_and_a_full_table(monkeypatch):
    import agent.sim.gme_check as gc
    from agent.protocol.gme_fgme import FgmeNode

    with pytest.raises(RuntimeError, match="digest table full"):
        fast_check("2fgme", (2, 1), 2, table_bits=10)

    class Brittle(FgmeNode):
        def _on_end(self, m):
            raise ValueError("boom")

    monkeypatch.setattr(gc, "_algorithms", lambda: {"2fgme": Brittle})
    r = fast_check("2fgme", (1, 1), 1)
    assert r.protocol_errors == 1 and "ValueError: boom" in (r.first_failure or "")


def test_the_compiled_search_keeps_the_reduction_checks(monkeypatch):
    """The soundness checks run in Python on every local transition the C loop asks for."""
    from agent.protocol.gme_base import GmeState
    from agent.protocol.gme_fgme import FgmeNode
    from agent.sim.gme_check import ReductionUnsound

    right = FgmeNode.live_snapshot

    def wrong(self, requests_left):  # forgets the Lamport clock of an idle node
        s = right(self, requests_left)
        return (s[0],) + s[2:] if self.state is GmeState.IDLE and requests_left else s

    monkeypatch.setattr(FgmeNode, "live_snapshot", wrong)
    with pytest.raises(ReductionUnsound, match="equal live snapshots"):
        fast_check("2fgme", (2, 1), 2)


def test_cli_bench_gme_check_fast(capsys):
    import json

    from agent.cli.main import main

    args = ["bench", "gme-check", "--groups", "2,1", "--requests", "2", "--json", "--fast", "--table-bits", "16"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compiled"] and report["verdict"] == "ok" and report["states"] == 5862
    assert main(args + ["--fault", "skip_acks_to_ign"]) == 1
    assert json.loads(capsys.readouterr().out)["safety_violations"] == 1
