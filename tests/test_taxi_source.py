"""The synthetic DEBS 2015 source, its rate profiles, and the validate / in_zone operators."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.operators.admission import AllowList
from agent.operators.builtin import OperatorContext, in_zone, load_operator, validate
from agent.operators.taxi import FIELDS, Sinusoid, Steps, TaxiGenerator, TaxiSource, profile_from_params, sample


def ctx(params, instance="source-0") -> OperatorContext:
    return OperatorContext(instance=instance, operator="source", node="n", kind="source", params=params)


def test_records_are_seeded_and_have_the_debs_schema() -> None:
    a, b = sample(7, 200, "s"), sample(7, 200, "s")
    assert a == b and sample(8, 200, "s") != a and sample(7, 200, "t") != a
    assert all(tuple(r) == FIELDS for r in a)


def test_validate_and_in_zone_filter_some_but_not_most() -> None:
    recs = TaxiGenerator(1, "x")
    rs = [recs.record() for _ in range(5000)]
    valid = [r for r in rs if validate(r, {}) is not None]
    zoned = [z for z in (in_zone(r, {}) for r in valid) if z is not None]
    assert 0.9 * len(rs) < len(valid) < len(rs)  # ~2% defects dropped
    assert 0.8 * len(valid) < len(zoned) < len(valid)  # trips outside the grid dropped
    assert all("pickup_cell" in z for z in zoned)
    assert validate({"bad": 1}, {}) is None and in_zone({}, {}) is None


def test_source_generates_the_integral_of_the_rate_and_respects_budget() -> None:
    src = TaxiSource(ctx({"profile": "constant", "rate": 1000.0}))
    src.start(0.0)
    got = []
    for k in range(1, 101):
        got += src.poll(k * 0.01, budget=10**6)
    assert 990 <= len(got) <= 1000
    assert [i[1] for i in got] == list(range(len(got))) and {i[0] for i in got} == {"source-0"}
    # with no budget (back pressure) nothing is generated, and a long stall is not made up
    src2 = TaxiSource(ctx({"profile": "constant", "rate": 1000.0, "max_lag_s": 0.1}))
    src2.start(0.0)
    assert src2.poll(5.0, budget=0) == []
    assert len(src2.poll(5.01, budget=10**6)) <= 111 and src2.deferred > 4000


def test_source_max_records_and_profiles(tmp_path: Path) -> None:
    src = TaxiSource(ctx({"rate": 1e6, "max_records": 123}))
    src.start(0.0)
    assert len(src.poll(1.0, 10**6)) == 123 and src.finished and src.poll(2.0, 10**6) == []
    steps = profile_from_params({"profile": "steps", "steps": [[0, 10], [5, 50], [10, 0]]})
    assert isinstance(steps, Steps) and [steps.rate(t) for t in (1, 6, 11)] == [10, 50, 0]
    sin = profile_from_params({"profile": "sinusoid", "rate": 100, "amplitude": 0.5, "period": 4})
    assert isinstance(sin, Sinusoid) and sin.rate(1.0) == pytest.approx(150) and sin.rate(3.0) == pytest.approx(50)
    f = tmp_path / "rates.csv"
    f.write_text("t,rate\n0,5\n2,7\n")
    assert profile_from_params({"profile": "csv", "csv": str(f)}).rate(3) == 7
    with pytest.raises(ValueError):
        profile_from_params({"profile": "zigzag"})


def test_load_operator_resolves_every_form() -> None:
    c = ctx({}, "x-0")
    assert load_operator("agent.operators.builtin:validate", c).process([("s", 1, {"a": 1})]) == []
    assert load_operator("agent.operators.builtin:identity", c).process([("s", 1, 5)]) == [("s", 1, 5)]
    assert hasattr(load_operator("agent.operators.taxi:source", c), "poll")
    with pytest.raises(ValueError):
        load_operator("agent.operators.builtin:nope", c)


def test_the_lab_bench_source_builds_each_record_kind_and_opens_no_file() -> None:
    """foglab.operators.bench: pooled taxi, tiny and keyed records through the taxi source; its
    params have no `csv` profile, whose path a node checks only for its built-in taxi source."""
    from agent.operators.builtin import check_params
    from foglab.operators.bench import bench_source

    def first(record: str, **more: Any) -> Any:
        c = ctx({"profile": "constant", "rate": 1000, "record": record, **more}, "b-0")
        src = load_operator("foglab.operators.bench:bench_source", c, AllowList.for_node(modules=["foglab.operators.bench"]))
        src.start(0.0)
        return src.poll(0.01, budget=3)

    assert [r for _, _, r in first("tiny")] == [{"v": 1}] * 3
    assert [r for _, _, r in first("keyed", keys=2)] == [{"k": 0, "t": 0, "v": 1}, {"k": 1, "t": 1, "v": 1},
                                                          {"k": 0, "t": 2, "v": 1}]
    assert all(set(FIELDS) <= set(r) for _, _, r in first("taxi"))
    assert check_params(bench_source, {"profile": "constant", "rate": 10, "record": "keyed", "keys": 4}) == []
    assert {key for key, _, _ in check_params(bench_source, {"profile": "csv", "csv": "/etc/passwd"})} == {"profile", "csv"}


def test_the_bench_pool_gives_a_batch_as_one_call_per_record_would() -> None:
    """`_Pool.many(n)` (the source builds a batch in one call) returns the records `n` calls
    would, wrapping around the pool, and the source numbers them as before."""
    from foglab.operators.bench import _Pool

    one, many = _Pool(1, "s", size=7), _Pool(1, "s", size=7)
    for n in (1, 3, 7, 20, 5):
        assert [one.pool.index(one()) for _ in range(n)] == [many.pool.index(r) for r in many.many(n)]
    assert one.i == many.i == 36
    ctx = OperatorContext(instance="src-0", operator="src", node="n", kind="source",
                          params={"profile": "constant", "rate": 1000})
    by_call, by_batch = TaxiSource(ctx, record_factory=lambda p=_Pool(1, "s", size=7): p()), \
        TaxiSource(ctx, record_factory=_Pool(1, "s", size=7))
    a, b = by_call._emit(12) + by_call._emit(5), by_batch._emit(12) + by_batch._emit(5)
    assert [(s, q) for s, q, _ in a] == [(s, q) for s, q, _ in b] == [("src-0", q) for q in range(17)]
    assert [r for _, _, r in a] == [r for _, _, r in b]


def test_a_paused_source_still_sends_again_what_its_previous_incarnation_may_have_sent() -> None:
    """Records from `resume_from` to the reserved position are a replay, not new load: a pause
    after a restart must not hold them back (they would never be sent: lost). New records wait."""
    src = TaxiSource(ctx({"profile": "constant", "rate": 1000.0}))
    src.resume(resume_from=100, catch_up_to=160, elapsed=5.0)
    src.paused = True
    src.start(10.0)
    assert src.catching_up
    first = src.poll(10.0, budget=40)
    assert [seq for _, seq, _ in first] == list(range(100, 140))  # budget-bound, as unpaused
    assert [seq for _, seq, _ in src.poll(10.1, budget=40)] == list(range(140, 160))
    assert not src.catching_up and src.poll(11.0, budget=40) == [] and src.generated == 160  # paused: nothing new
    src.paused = False
    assert src.poll(11.1, budget=1000)  # unpaused: the rate again
