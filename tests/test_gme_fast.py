"""The compiled exhaustive search (foglab.sim.gme_fast) against the Python one (foglab.sim.gme_check).

The compiled loop is only trusted because it visits exactly what the Python search visits: same
states, transitions, terminal states and full expansions, in every mode, and the same first
violation for the seeded faults.
"""

from __future__ import annotations

import pytest

from foglab.sim.gme_check import exhaustive_check
from foglab.sim.gme_fast import fast_check

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
    import foglab.sim.gme_check as gc
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
    from foglab.sim.gme_check import ReductionUnsound

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


def test_cli_bench_gme_check_sweep(capsys, tmp_path):
    import json

    from agent.cli.main import main

    args = ["bench", "gme-check", "--groups", "2,1", "--requests", "2", "--json", "--fast", "--sweep", str(tmp_path)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sweep"] and report["verdict"] == "ok" and 0 < report["fingerprints_held_peak"] < report["states"]
    assert main(args + ["--memory-gb", "1e-5"]) == 2  # no room: one line, no verdict
    err = capsys.readouterr().err
    assert "digest table full" in err and "--memory-gb" in err and "Traceback" not in err


# --- the sweep (fast_check(sweep_dir=...)): the same expansion in the order of a progress measure


@pytest.mark.parametrize("alg,sizes,requests,reduction", [
    ("2fgme", (2, 1), 2, False),
    ("2fgme", (2, 1), 2, True),
    ("2fgme", (2, 2), 1, True),
    ("ra1", (2, 1), 2, True),
    ("ra2", (2, 1), 2, False),
])
def test_the_sweep_visits_exactly_what_the_dfs_visits_without_symmetry(tmp_path, alg, sizes, requests, reduction):
    """Without symmetry and merging a key is the state itself: the reduced graph is one, whatever the order."""
    kw = dict(symmetry=False, reduction=reduction, merge_dead=False)
    dfs = fast_check(alg, sizes, requests, **kw)
    sweep = fast_check(alg, sizes, requests, sweep_dir=str(tmp_path), **kw)
    assert dfs.ok and sweep.ok
    assert COUNTS(sweep) == COUNTS(dfs)
    assert 0 < sweep.held < dfs.states / 2  # it forgets: never more than half the fingerprints at once
    assert sweep.sublayers > 10 and not list(tmp_path.iterdir())  # every sub-layer file read and removed


@pytest.mark.parametrize("alg,sizes,requests,kb", [("2fgme", (2, 1), 2, 300), ("ra2", (2, 1), 2, 1200)])
def test_the_sweep_short_of_memory_checks_later_states_when_it_reaches_them(tmp_path, alg, sizes, requests, kb):
    """Past three quarters of the memory, states for later sub-layers wait on disk unchecked
    (duplicates included) and are checked when their sub-layer is explored: the same counts."""
    kw = dict(symmetry=False, reduction=True, merge_dead=False)
    dfs = fast_check(alg, sizes, requests, **kw)
    short = fast_check(alg, sizes, requests, sweep_dir=str(tmp_path), memory_gb=kb / 2**20, **kw)
    assert short.unchecked > 1000 and short.ok
    assert COUNTS(short) == COUNTS(dfs)


def test_the_sweep_with_symmetry_and_merging_gives_the_dfs_verdict(tmp_path):
    """Another representative per class, so another (equally valid) reduced graph: the verdict and
    the one good terminal class agree; the run is deterministic."""
    dfs = fast_check("2fgme", (2, 2), 1)
    a = fast_check("2fgme", (2, 2), 1, sweep_dir=str(tmp_path / "a"))
    b = fast_check("2fgme", (2, 2), 1, sweep_dir=str(tmp_path / "b"))
    assert dfs.ok and a.ok and (dfs.schedules, a.schedules) == (1, 1)
    assert COUNTS(a) == COUNTS(b) and a.held == b.held
    assert a.held < a.states / 4


@pytest.mark.parametrize("fault,sizes,requests", [
    ("skip_acks_to_ign", (2, 1), 2), ("undo_deviation_3", (2, 2), (2, 2, 1, 1)),  # 2+2 x 2 would take 30 s
])
def test_the_sweep_finds_the_seeded_faults(tmp_path, fault, sizes, requests):
    r = fast_check("2fgme", sizes, requests, fault=fault, sweep_dir=str(tmp_path))
    assert r.safety_violations == 1 and "two groups in the CS" in (r.first_failure or "")
    assert not list(tmp_path.iterdir())  # the files of the sub-layers not reached are removed too


def test_the_sweep_refuses_a_measure_that_goes_back_and_a_full_memory(tmp_path, monkeypatch):
    """Forgetting is only sound if no step lowers the measure: checked on every successor."""
    import foglab.sim.gme_fast as gf

    with pytest.raises(RuntimeError, match="digest table full"):
        fast_check("2fgme", (2, 2), 1, sweep_dir=str(tmp_path), memory_gb=2e-4)
    right = gf._sweep_counter
    monkeypatch.setattr(gf, "_sweep_counter", lambda ls, sid, left: 100 - right(ls, sid, left))
    with pytest.raises(RuntimeError, match="lowered the sweep's progress measure"):
        fast_check("2fgme", (2, 1), 2, sweep_dir=str(tmp_path))


def test_the_sweep_refuses_a_counter_that_is_not_a_function_of_the_class(tmp_path, monkeypatch):
    """An idle node with no request left forgets its epoch (merged): counting the epoch there
    would put one class at two measures (explored twice, counted twice). Refused."""
    import foglab.sim.gme_fast as gf
    from foglab.sim.gme_check import ReductionUnsound

    monkeypatch.setattr(gf, "_node_counter", lambda ls, sid, left: ls.progress[sid])
    with pytest.raises(ReductionUnsound, match="one progress measure"):
        fast_check("2fgme", (2, 1), 2, sweep_dir=str(tmp_path))
