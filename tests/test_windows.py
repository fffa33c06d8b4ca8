"""Declarative windows (agent.operators.windows) and the offline harness (agent.testing).

Sans-IO: no broker, no agent, no worker process. The window runs inside the real keyed state
(agent.instance.keyed_state.KeyedState); the harness saves and restores it through its real files
and moves key groups with its real hand-out and take-in.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from agent.instance.keyed_state import KeyedState
from agent.operators.admission import BUILTIN, node_allow_list
from agent.operators.builtin import OperatorContext, check_params
from agent.operators.windows import late_split_sink, window
from agent.testing import KeyedHarness, run_pipeline

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples/windows-pipeline.toml"


def run_window(params: Dict[str, Any], records: List[Dict[str, Any]], tmp_path: Path, batch_size: int = 1,
               **kw: Any) -> KeyedHarness:
    """One record per batch: the outputs in the order the docs describe (a batch's timers fire after
    it; the outputs and their ids do not depend on the batching, their order across keys does)."""
    h = KeyedHarness("agent.operators.windows:window", params, key_field="sensor", state_dir=tmp_path, operator="w",
                     batch_size=batch_size, **kw)
    h.feed(records)
    h.end()
    return h


def r(sensor: str, t: float, **fields: Any) -> Dict[str, Any]:
    return dict(sensor=sensor, t=t, **fields)


# ---- results against hand-computed answers ---------------------------------------------------------

AGGS = {"n": ["count"], "s": ["sum", "temp"], "m": ["mean", "temp"], "lo": ["min", "temp"], "hi": ["max", "temp"],
        "top": ["top_k", "temp", 2]}


def test_a_tumbling_window_gives_every_aggregate_of_each_key_and_window(tmp_path: Path) -> None:
    recs = [r("a", 1, temp=20), r("a", 2, temp="warm"), r("a", 4, temp=22), r("b", 5, temp=10), r("a", 9, temp=21),
            r("a", 12, temp=30), r("b", 25, temp=11)]
    params = {"kind": "tumbling", "size_ms": 10_000, "time_field": "t", "aggregates": AGGS}
    h = run_window(params, recs, tmp_path / "one")
    assert h.records() == [
        # "warm" is counted by ["count"] and skipped by the aggregates that read temp
        {"key": "a", "start": 0, "end": 10_000, "n": 4, "s": 63, "m": 21.0, "lo": 20, "hi": 22, "top": [22, 21]},
        {"key": "b", "start": 0, "end": 10_000, "n": 1, "s": 10, "m": 10.0, "lo": 10, "hi": 10, "top": [10]},
        {"key": "a", "start": 10_000, "end": 20_000, "n": 1, "s": 30, "m": 30.0, "lo": 30, "hi": 30, "top": [30]},
        {"key": "b", "start": 20_000, "end": 30_000, "n": 1, "s": 11, "m": 11.0, "lo": 11, "hi": 11, "top": [11]},
    ]
    assert run_window(params, recs, tmp_path / "all", batch_size=10).sink.by_id == h.sink.by_id


def test_a_sliding_window_puts_each_record_in_every_window_that_covers_it(tmp_path: Path) -> None:
    recs = [r("a", 1, v=1), r("a", 6, v=2), r("a", 11, v=4)]
    params = {"kind": "sliding", "size_ms": 10_000, "slide_ms": 5_000, "time_field": "t",
              "aggregates": {"n": ["count"], "s": ["sum", "v"], "hi": ["max", "v"], "c": ["count", "v"]}}
    assert run_window(params, recs, tmp_path).records() == [
        {"key": "a", "start": -5_000, "end": 5_000, "n": 1, "s": 1, "hi": 1, "c": 1},
        {"key": "a", "start": 0, "end": 10_000, "n": 2, "s": 3, "hi": 2, "c": 2},
        {"key": "a", "start": 5_000, "end": 15_000, "n": 2, "s": 6, "hi": 4, "c": 2},
        {"key": "a", "start": 10_000, "end": 20_000, "n": 1, "s": 4, "hi": 4, "c": 1},
    ]


SESSION = [r("a", 1, v=1), r("a", 3, v=2), r("a", 20, v=4), r("a", 14, v=8), r("a", 17, v=16), r("b", 2, v=32)]


def test_a_session_ends_a_gap_after_its_last_record_and_sessions_a_record_bridges_merge(tmp_path: Path) -> None:
    params = {"kind": "session", "gap_ms": 5_000, "time_field": "t", "lateness_ms": 10_000, "late": "emit",
              "aggregates": {"n": ["count"], "s": ["sum", "v"], "hi": ["max", "v"], "m": ["mean", "v"]}}
    h = run_window(params, SESSION, tmp_path)
    assert [type(x["start"]) for x in h.records() if "start" in x] == [int, int]  # whole ms as integers
    assert h.records() == [
        {"key": "a", "start": 1_000, "end": 8_000, "n": 2, "s": 3, "hi": 2, "m": 1.5},  # fired when t=20 came
        # t=2 of b is older than the watermark (20 s - 10 s): the side output, as it came, marked
        dict(SESSION[5], late=True),
        # 14 and 20 are two sessions until 17 bridges them
        {"key": "a", "start": 14_000, "end": 25_000, "n": 3, "s": 28, "hi": 16, "m": 28 / 3},
    ]
    assert h.sink.order[1] == ("src", 5)  # under its own record id


# ---- late records ------------------------------------------------------------------------------------


def test_late_records_are_counted_and_emitted_marked_only_when_asked(tmp_path: Path) -> None:
    recs = [r("a", 1, v=1), r("a", 30, v=2), r("b", 3, v=4), r("a", 15, v=8)]
    base = {"kind": "tumbling", "size_ms": 10_000, "time_field": "t", "lateness_ms": 5_000, "aggregates": {"s": ["sum", "v"]}}
    counted = run_window(base, recs, tmp_path / "count")
    assert counted.records() == [{"key": "a", "start": 0, "end": 10_000, "s": 1},
                                 {"key": "a", "start": 30_000, "end": 40_000, "s": 2}]
    (stats,) = counted.stats().values()
    assert (stats["late_dropped"], stats["late_sent"]) == (2, 0)  # counted, not sent on
    emitted = run_window(dict(base, late="emit"), recs, tmp_path / "emit")
    assert [x for x in emitted.records() if x.get("late")] == [dict(recs[2], late=True), dict(recs[3], late=True)]
    assert "late" not in recs[2]  # marked on the instance's own copy
    (stats,) = emitted.stats().values()
    assert (stats["late_dropped"], stats["late_sent"]) == (2, 2)


def test_the_split_sink_publishes_the_side_output_to_a_topic_of_its_own() -> None:
    sink = late_split_sink.build(OperatorContext("p.out.0", "out", "n", "sink",
                                                 params={"topic": "lab/min", "late_topic": "lab/late"}))
    pubs = sink.record([("w#1", 1, {"key": "a", "s": 1}), ("w#1", 2, {"late": True, "key": "a"}), ("w#2", 1, {"key": "b"})])
    assert [(p.topic, json.loads(p.payload)) for p in pubs] == [
        ("lab/min", {"ids": [["w#1", 1], ["w#2", 1]], "records": [{"key": "a", "s": 1}, {"key": "b"}]}),
        ("lab/late", {"ids": [["w#1", 2]], "records": [{"late": True, "key": "a"}]})]
    assert check_params(late_split_sink, {"topic": "lab/min", "late_topic": "lab/#"}) == [
        ("late_topic", "expected a topic name (no + or #)", "lab/#")]


# ---- a user fold from the node's allow-list -----------------------------------------------------------

def docs_fold() -> str:
    """The fold printed in docs/operators.md ("Your own fold"), as printed."""
    text = (ROOT / "docs" / "operators.md").read_text()
    section = text[text.index("**Your own fold.**"):]
    return section[section.index("```python\n") + 10:section.index("\n```", section.index("```python"))]


FOLD_MODULE = docs_fold() + '''

def squares(acc, value):
    return (acc or 0) + value * value
'''


@pytest.fixture
def fold_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "winfold_ops.py").write_text(FOLD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FOG_AGENT_OPERATOR_MODULES", "winfold_ops")  # the node's [operators] modules
    node_allow_list.cache_clear()
    yield "winfold_ops"
    monkeypatch.delenv("FOG_AGENT_OPERATOR_MODULES")
    node_allow_list.cache_clear()
    sys.modules.pop("winfold_ops", None)


def test_a_user_fold_on_the_allow_list_aggregates_windows_and_merges_sessions(fold_module: str, tmp_path: Path) -> None:
    """The docs' fold (spread, with its merge) in session windows; one without merge is refused there."""
    params = {"kind": "session", "gap_ms": 5_000, "time_field": "t", "lateness_ms": 10_000,
              "aggregates": {"spread": ["fold", f"{fold_module}:spread", "v"], "n": ["count"]}}
    assert [x.get("spread") for x in run_window(params, SESSION, tmp_path / "s").records()] == [[1, 2], [4, 16]]
    tumbling = {"kind": "tumbling", "size_ms": 10_000, "time_field": "t",
                "aggregates": {"sq": ["fold", f"{fold_module}:squares", "v"]}}
    assert run_window(tumbling, [r("a", 1, v=2), r("a", 2, v=3), r("a", 3)], tmp_path / "t").records() == [
        {"key": "a", "start": 0, "end": 10_000, "sq": 13}]
    with pytest.raises(ValueError, match="needs winfold_ops:squares.merge"):  # sessions merge accumulators
        window.build(OperatorContext("w.0", "w", "n", "map", params=dict(params, aggregates={"q": ["fold", "winfold_ops:squares"]})))


def test_a_fold_the_node_does_not_allow_is_refused_and_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "winfold_evil.py").write_text("import sys\nsys.modules[__name__].imported = True\ndef f(acc, v):\n    return v\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FOG_AGENT_OPERATOR_MODULES", raising=False)
    node_allow_list.cache_clear()
    params = {"time_field": "t", "size_ms": 1000, "aggregates": {"x": ["fold", "winfold_evil:f", "v"]}}
    assert check_params(window, params) == []  # the form is right: the node's list decides where it runs
    with pytest.raises(ValueError, match="refused: module 'winfold_evil' is not an operator module of this node"):
        window.build(OperatorContext("w.0", "w", "n", "map", params=params))
    assert "winfold_evil" not in sys.modules
    node_allow_list.cache_clear()


# ---- check-config ------------------------------------------------------------------------------------

GOOD = {"time_field": "t", "size_ms": 60_000, "aggregates": {"m": ["mean", "temp"]}}
AGG_LIST = '"count", "sum", "mean", "min", "max", "top_k", "fold"'
BAD: List[Tuple[Dict[str, Any], Tuple[str, str, Any]]] = [
    ({"aggregates": {"m": ["median", "temp"]}}, ("aggregates.m", f"expected the aggregate one of {AGG_LIST}", ["median", "temp"])),
    ({"time_field": None}, ("time_field", "missing required key (expected a string)", None)),
    ({"aggregates": None}, ("aggregates", "missing required key (expected a table)", None)),
    ({"aggregates": {"m": ["mean"]}}, ("aggregates.m", 'expected ["mean", "<field>"] (the numeric field it reads)', ["mean"])),
    ({"aggregates": {"m": "mean"}}, ("aggregates.m", f'expected an array ["<aggregate>", <args>...] with the aggregate one of {AGG_LIST}', "mean")),
    ({"aggregates": {"t": ["top_k", "temp", 0]}}, ("aggregates.t", 'expected ["top_k", "<field>", k] with k an integer 1..100', ["top_k", "temp", 0])),
    ({"aggregates": {"f": ["fold", "my fold"]}}, ("aggregates.f", 'expected ["fold", "package.module:function", ...] (a function on the node\'s operator allow-list)', ["fold", "my fold"])),
    ({"aggregates": {"start": ["count"]}}, ("aggregates.start", 'expected a name other than "key", "start", "end", "late" (fields of the output record)', "start")),
    ({"aggregates": {}}, ("aggregates", 'expected a table of at least one name = ["<aggregate>", <args>...]', {})),
    ({"kind": "hopping"}, ("kind", 'expected one of "tumbling", "sliding", "session"', "hopping")),
    ({"late": "drop"}, ("late", 'expected one of "count", "emit"', "drop")),
    ({"size_ms": 0}, ("size_ms", "expected an integer >= 1", 0)),
    ({"slide_ms": 1000}, ("slide_ms", 'expected no slide_ms with kind = "tumbling" (it takes size_ms)', 1000)),
    ({"kind": "sliding"}, ("slide_ms", 'missing required key (expected an integer >= 1: kind = "sliding" needs size_ms, slide_ms)', None)),
    ({"kind": "sliding", "slide_ms": 90_000}, ("slide_ms", "expected an integer <= size_ms (60000)", 90_000)),
    ({"kind": "sliding", "slide_ms": 500}, ("slide_ms", "expected an integer >= size_ms / 100 (600: at most 100 windows per record)", 500)),
    ({"kind": "session", "size_ms": None}, ("gap_ms", 'missing required key (expected an integer >= 1: kind = "session" needs gap_ms)', None)),
    ({"kind": "session", "gap_ms": 1000}, ("size_ms", 'expected no size_ms with kind = "session" (it takes gap_ms)', 60_000)),
    ({"sizems": 1}, ("sizems", "unknown key (allowed: aggregates, gap_ms, kind, late, lateness_ms, size_ms, slide_ms, time_field, time_unit)", 1)),
]


@pytest.mark.parametrize("change,problem", BAD, ids=lambda x: str(x)[:40] if isinstance(x, dict) else None)
def test_check_config_says_what_is_wrong_with_each_param(change: Dict[str, Any], problem: Tuple[str, str, Any]) -> None:
    assert check_params(window, GOOD) == []
    params = {k: v for k, v in dict(GOOD, **change).items() if v is not None}  # None: the key left out
    assert check_params(window, params) == [problem]


def test_check_config_passes_the_example_and_names_file_key_expected_and_given(tmp_path: Path, capsys: Any) -> None:
    from agent.cli.main import main

    assert "agent.operators.windows:window" in BUILTIN and "agent.operators.windows:late_split_sink" in BUILTIN
    assert main(["check-config", str(EXAMPLE)]) == 0
    capsys.readouterr()
    bad = tmp_path / "p.toml"
    bad.write_text(EXAMPLE.read_text().replace('readings = ["count"]', 'readings = ["median", "temp"]'))
    assert main(["check-config", str(bad)]) == 1
    assert (f'p.toml: [operator[1]].params.aggregates.readings: expected the aggregate one of {AGG_LIST}, '
            'got ["median", "temp"]') in capsys.readouterr().err
    with pytest.raises(ValueError, match="window: params.aggregates.m: expected"):  # and the worker, at build
        window.build(OperatorContext("w.0", "w", "n", "map", params=dict(GOOD, aggregates={"m": ["mean"]})))


# ---- exactly once through the harness: crashes and scaling --------------------------------------------


def sensor_stream(n: int, seed: int) -> List[Dict[str, Any]]:
    """n readings of 6 sensors, ~1 s apart with up to 2 s of disorder; every 37th is 60 s old (late)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = 1_764_000_000 + i - rng.uniform(0, 2) - (60 if i % 37 == 36 else 0)
        out.append({"sensor": f"s{rng.randrange(6)}", "t": round(t, 3), "temp": rng.randrange(150, 300) / 10})
    return out


KINDS = [
    {"kind": "tumbling", "size_ms": 10_000},
    {"kind": "sliding", "size_ms": 15_000, "slide_ms": 5_000},
    {"kind": "session", "gap_ms": 4_000},
]


def params_of(i: int) -> Dict[str, Any]:
    return dict(KINDS[i], time_field="t", lateness_ms=3_000, late="emit",
                aggregates={"mean_temp": ["mean", "temp"], "max_temp": ["max", "temp"], "n": ["count"],
                            "top": ["top_k", "temp", 3]})


def harness_run(tmp: Path, kind: int, records: List[Any], steps: List[Tuple[int, str]], **kw: Any) -> KeyedHarness:
    h = KeyedHarness("agent.operators.windows:window", params_of(kind), key_field="sensor", state_dir=tmp,
                     operator="w", key_groups=16, **kw)
    done = 0
    for at, action in steps:
        h.feed(records[done:at])
        done = at
        getattr(h, action)(**({"resend": 3} if action == "crash" else {}))
    h.feed(records[done:])
    h.end()
    return h


def by_id(h: KeyedHarness) -> Dict[Tuple[str, int], str]:
    return {k: json.dumps(v, sort_keys=True) for k, v in h.sink.by_id.items()}


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["tumbling", "sliding", "session"])
def test_crashes_and_scaling_give_exactly_the_outputs_of_an_undisturbed_run(tmp_path: Path, kind: int) -> None:
    records = sensor_stream(260, seed=kind)
    ref = harness_run(tmp_path / "ref", kind, records, [], batch_size=7)
    outs = ref.records()
    assert sum(1 for x in outs if x.get("late")) == 7  # every 37th reading
    assert sum(x["n"] for x in outs if not x.get("late")) == 253 * (3 if kind == 1 else 1)  # sliding: 3 windows each
    # crashes (saving every 3rd batch: the replay re-applies up to 3 batches, plus 3 saved records sent again)
    crashed = harness_run(tmp_path / "crash", kind, records, [(40, "crash"), (111, "crash"), (112, "crash"), (200, "crash")],
                          batch_size=5, save_every=3)
    assert by_id(crashed) == by_id(ref)
    assert crashed.sink.duplicates > 0 and crashed.stats()["p.w.0"]["duplicates_skipped"] >= 3
    # a crash just before a late record, everything saved: nothing replayed re-learns the watermark
    right_after_save = harness_run(tmp_path / "crash-late", kind, records, [(73, "crash"), (184, "crash")], batch_size=1)
    assert by_id(right_after_save) == by_id(ref)
    # scale out, more crashes on both instances, scale in
    scaled = KeyedHarness("agent.operators.windows:window", params_of(kind), key_field="sensor", state_dir=tmp_path / "scale",
                          operator="w", key_groups=16, batch_size=4, save_every=2)
    scaled.feed(records[:90])
    copy = scaled.scale_out()
    assert scaled.table.groups_of(copy) and scaled.table.groups_of("p.w.0")
    scaled.feed(records[90:150])
    scaled.crash(copy)
    scaled.crash("p.w.0")
    scaled.feed(records[150:210])
    scaled.scale_in(copy)
    assert list(scaled.instances) == ["p.w.0"] and len(scaled.table.groups_of("p.w.0")) == 16
    scaled.feed(records[210:])
    scaled.end()
    assert by_id(scaled) == by_id(ref)


def test_run_pipeline_runs_the_example_file_with_a_crash_and_a_scale_out(tmp_path: Path) -> None:
    """The docs' sensor example, as the guide tests it: the pipeline file alone, readings with
    their event times, the answer per sensor and minute computed by hand."""
    t0 = 1_764_000_000  # a minute boundary: 29,400,000 minutes
    readings = [{"sensor": "s1", "t": t0 + 1, "temp": 20.0}, {"sensor": "s2", "t": t0 + 2, "temp": 18.0},
                {"sensor": "s1", "t": t0 + 30, "temp": 23.0}, {"sensor": "s1", "t": t0 + 61, "temp": 21.0},
                {"sensor": "s2", "t": t0 + 66, "temp": 17.0},  # the watermark passes t0 + 60 s: minute 0 closes
                {"sensor": "s1", "t": t0 + 50, "temp": 99.0},  # 16 s older than the newest: late
                {"sensor": "s2", "t": t0 + 70, "temp": 19.0}]
    plain = run_pipeline(EXAMPLE, readings, state_dir=tmp_path / "plain", batch_size=1).records()
    m0, m1 = t0 * 1000, t0 * 1000 + 60_000
    assert plain == [
        {"key": "s1", "start": m0, "end": m1, "mean_temp": 21.5, "max_temp": 23.0, "readings": 2},
        {"key": "s2", "start": m0, "end": m1, "mean_temp": 18.0, "max_temp": 18.0, "readings": 1},
        dict(readings[5], late=True),
        {"key": "s1", "start": m1, "end": m1 + 60_000, "mean_temp": 21.0, "max_temp": 21.0, "readings": 1},
        {"key": "s2", "start": m1, "end": m1 + 60_000, "mean_temp": 18.0, "max_temp": 19.0, "readings": 2},
    ]
    disturbed = run_pipeline(EXAMPLE, readings, state_dir=tmp_path / "disturbed", batch_size=2,
                             at={3: ["scale_out"], 5: ["crash", "crash:sensor_minutes.minute.1"]})
    assert sorted(map(json.dumps, disturbed.records())) == sorted(map(json.dumps, plain))


def test_the_harness_allows_your_own_modules_named_as_operators_modules_names_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline with a map of your own: refused as on a node that does not list its module,
    run with `allowed=["<module>"]`; a name [operators] modules would refuse is refused here too."""
    from agent.operators.admission import OperatorRefused

    (tmp_path / "harness_own_ops.py").write_text("def hot(rec):\n    return rec if rec['temp'] > 19 else None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FOG_AGENT_OPERATOR_MODULES", raising=False)
    node_allow_list.cache_clear()
    text = EXAMPLE.read_text().replace('key = "sensor"', 'key = "sensor"\n\n[[operator]]\nname = "hot"\n'
                                       'function = "harness_own_ops:hot"\nkey = "sensor"', 1)
    assert "harness_own_ops:hot" in text
    t0 = 1_764_000_000
    readings = [{"sensor": "s1", "t": t0 + 1, "temp": 20.0}, {"sensor": "s1", "t": t0 + 2, "temp": 18.0}]
    with pytest.raises(OperatorRefused, match="not an operator module of this node"):
        run_pipeline(text, readings, state_dir=tmp_path / "refused")
    h = run_pipeline(text, readings, state_dir=tmp_path / "allowed", allowed=["harness_own_ops"])
    assert [(r["key"], r["readings"], r["max_temp"]) for r in h.records()] == [("s1", 1, 20.0)]
    with pytest.raises(ValueError, match="standard library"):
        run_pipeline(text, readings, state_dir=tmp_path / "os", allowed=["os"])
    sys.modules.pop("harness_own_ops", None)


def test_a_restarted_window_reads_the_largest_event_time_its_keyed_state_restores(tmp_path: Path) -> None:
    """The side output depends on it: after a crash the first late record must still be late."""
    ctx = OperatorContext("p.w.0", "w", "n", "map", params=params_of(0), state_dir=tmp_path)
    ks = KeyedState(window.build(ctx), "w", "sensor", 16)
    ks.apply("p", [("src", 0, {"sensor": "a", "t": 100.0, "temp": 1})], 1)
    ks.save(tmp_path / "p.w.0.keyed.json")
    again = window.build(OperatorContext("p.w.0", "w", "n", "map", params=params_of(0), state_dir=tmp_path, restart=True))
    ks2 = KeyedState(again, "w", "sensor", 16)
    loaded = KeyedState.load(tmp_path / "p.w.0.keyed.json")
    assert loaded is not None
    ks2.restore(loaded)
    (late,) = ks2.apply("p", [("src", 1, {"sensor": "b", "t": 50.0, "temp": 2})], 2)
    assert late[2]["late"] is True and ks2.stats()["late_sent"] == 1


