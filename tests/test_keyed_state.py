"""Keyed stateful operators on the sans-IO core (agent.instance.keyed_state): the built-ins'
results, key groups shared with routing, and the two properties exactly-once rests on: outputs do
not depend on batch boundaries, and a crash at any point followed by restore + replay emits
exactly the outputs of the fault-free run."""

from __future__ import annotations

import json
import random
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import load_pipeline_text
from agent.dataplane.keygroups import groups_of, key_group, owner
from agent.dataplane.routing import Router
from agent.instance.applied import Applied
from agent.instance.keyed_state import KeyedState
from agent.operators.builtin import OperatorContext, check_params
from agent.operators.keyed import (
    KeyedOperator,
    keyed_config_problems,
    keyed_count,
    keyed_mean,
    parse_event_time,
    sliding_window,
    top_k,
    tumbling_window,
)


def state_of(cls: Any, **params: Any) -> KeyedState:
    op = cls.build(OperatorContext("w-0", "w", "n", "map", params=params))
    return KeyedState(op, "w", "k", 128)


def stream(n: int, seed: int, keys: int = 4, jitter: float = 3.0) -> List[Tuple[str, int, Dict[str, Any]]]:
    """n records of one source, event times rising ~1 s each with up to `jitter` s of disorder."""
    rng = random.Random(seed)
    return [("src", i, {"k": f"k{rng.randrange(keys)}", "t": i + rng.uniform(-jitter, 0), "v": rng.randrange(10)})
            for i in range(n)]


def run(ks: KeyedState, items: List[Any], cuts: List[int]) -> List[Any]:
    out, start = [], 0
    for i, end in enumerate(sorted(set(cuts)) + [len(items)]):
        if end > start:
            out += ks.apply("p", items[start:end], i + 1)
            start = end
    return out


# ---- key groups ---------------------------------------------------------------------------------


def test_routing_and_keyed_state_use_one_key_to_group_to_instance_mapping() -> None:
    instances = ["k-2", "k-0", "k-1"]
    r = Router(instances, key="sensor", groups=16)
    for s in range(200):
        g = key_group(s, 16)
        assert r.by_key({"sensor": s}) == owner(g, instances)
        assert g in groups_of(owner(g, instances), instances, 16)
    dealt = [groups_of(i, instances, 16) for i in instances]
    assert set().union(*dealt) == set(range(16)) and sum(map(len, dealt)) == 16  # a partition


def test_a_key_group_does_not_depend_on_the_process() -> None:
    # crc32 of the key's text, not hash() (salted per process): a constant, here and on every node
    assert [key_group(k, 128) for k in ("s1", 7, None)] == [zlib.crc32(b"s1") % 128, zlib.crc32(b"7") % 128,
                                                           zlib.crc32(b"None") % 128]


# ---- built-ins ------------------------------------------------------------------------------------


def test_a_tumbling_count_emits_each_window_once_the_watermark_passes_its_end() -> None:
    ks = state_of(tumbling_window, time_field="t", size_ms=10_000)
    items = [("s", i, {"k": "a", "t": t}) for i, t in enumerate([1, 2, 9.9, 10, 11, 25])]
    out = ks.apply("p", items, 1)
    assert [r for _, _, r in out] == [{"key": "a", "start": 0, "end": 10_000, "count": 3},
                                      {"key": "a", "start": 10_000, "end": 20_000, "count": 2}]
    assert [(s, q) for s, q, _ in out] == [(out[0][0], 1), (out[0][0], 2)]  # the key's 1st and 2nd output
    assert ks.stats()["timers"] == 1  # [20 s, 30 s) is still open


def test_records_older_than_the_watermark_are_counted_and_dropped() -> None:
    ks = state_of(tumbling_window, time_field="t", size_ms=10_000, lateness_ms=2000)
    out = ks.apply("p", [("s", 0, {"k": "a", "t": 5}), ("s", 1, {"k": "a", "t": 13}),
                         ("s", 2, {"k": "a", "t": 9}), ("s", 3, {"k": "a", "t": 12}),
                         ("s", 4, {"k": "a", "t": 11.5})], 1)
    # wm = 13 - 2 = 11 after record 1: the window [0, 10) fired; t=9 is late, t=12 and 11.5 are not
    assert [r["count"] for _, _, r in out] == [1]
    assert ks.counts["late_dropped"] == 1
    out = ks.apply("p", [("s", 5, {"k": "a", "t": 40})], 2)
    assert [(r["start"], r["count"]) for _, _, r in out] == [(10_000, 3)]


def test_a_sliding_mean_puts_each_record_in_every_window_that_covers_it() -> None:
    ks = state_of(sliding_window, time_field="t", size_ms=10_000, slide_ms=5000, agg="mean", field="v")
    items = [("s", i, {"k": "a", "t": t, "v": v}) for i, (t, v) in enumerate([(1, 2), (6, 4), (11, 6), (40, 0)])]
    got = {(r["start"], r["end"]): (r["count"], r["mean"]) for _, _, r in ks.apply("p", items, 1)}
    assert got == {(-5000, 5000): (1, 2.0), (0, 10_000): (2, 3.0), (5000, 15_000): (2, 5.0),
                   (10_000, 20_000): (1, 6.0)}


def test_top_k_ranks_values_by_count_then_by_value() -> None:
    ks = state_of(top_k, time_field="t", size_ms=60_000, by="dst", k=2)
    dsts = ["x", "y", "y", "z", "x", "y", "w"]
    out = ks.apply("p", [("s", i, {"k": "c", "t": i, "dst": d}) for i, d in enumerate(dsts)]
                   + [("s", 99, {"k": "c", "t": 61})], 1)
    assert [r for _, _, r in out] == [{"key": "c", "start": 0, "end": 60_000, "count": 7, "top": [["y", 3], ["x", 2]]}]


def test_a_running_mean_emits_one_output_per_record_and_skips_non_numbers() -> None:
    ks = state_of(keyed_mean, field="v")
    out = ks.apply("p", [("s", 0, {"k": "a", "v": 2}), ("s", 1, {"k": "a", "v": "x"}), ("s", 2, {"k": "a", "v": 4})], 1)
    assert [r for _, _, r in out] == [{"key": "a", "count": 1, "mean": 2.0}, {"key": "a", "count": 2, "mean": 3.0}]
    assert ks.stats()["skipped"] == 1


def test_event_times_are_read_from_numbers_and_iso_text_as_utc() -> None:
    assert parse_event_time(1.5) == 1500.0 and parse_event_time(1500, "ms") == 1500.0
    assert parse_event_time("1970-01-01 00:00:02") == 2000.0 == parse_event_time("1970-01-01T00:00:02Z")
    assert parse_event_time(True) is None and parse_event_time("soon") is None and parse_event_time(float("nan")) is None


def test_check_params_knows_the_window_params() -> None:
    assert check_params(tumbling_window, {"time_field": "t"}) == [("size_ms", "missing required key (expected an integer >= 1)", None)]
    assert check_params(tumbling_window, {"time_field": "t", "size_ms": 10, "agg": "sum"})[0][0] == "field"
    assert check_params(sliding_window, {"time_field": "t", "size_ms": 10, "slide_ms": 20})[0][0] == "slide_ms"
    assert check_params(top_k, {"time_field": "t", "size_ms": 10, "by": "x", "sizee": 1})[0][0] == "sizee"
    assert check_params(top_k, {"time_field": "t", "size_ms": 10, "by": "x", "lateness_ms": 5}) == []


def _pipeline_text(policy: str, key: Optional[str], params: str = 'time_field = "t", size_ms = 1000') -> str:
    key_line = f'key = "{key}"' if key else ""
    return f"""
[pipeline]
name = "p"
[[operator]]
name = "src"
kind = "source"
function = "agent.operators.taxi:source"
{key_line}
[[operator]]
name = "win"
function = "agent.operators.keyed:tumbling_window"
params = {{ {params} }}
[operator.scaling]
policy = "{policy}"
[[operator]]
name = "out"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def _pipeline(policy: str, key: Optional[str]) -> Any:
    return load_pipeline_text(_pipeline_text(policy, key))


def test_a_keyed_operator_may_scale_and_needs_a_key_before_it() -> None:
    """Its key groups move with their state (agent.instance.moves): any policy; the key field
    routing its records is the one thing it cannot do without."""
    assert keyed_config_problems(_pipeline("none", "k"), 1, tumbling_window) == []
    assert keyed_config_problems(_pipeline("decentralized", "k"), 1, tumbling_window) == []
    (line,) = keyed_config_problems(_pipeline("decentralized", None), 1, tumbling_window)
    assert "the operator before it, 'src', must set key" in line
    (line,) = keyed_config_problems(_pipeline("none", None), 1, tumbling_window)
    assert "the operator before it, 'src', must set key" in line
    assert keyed_config_problems(_pipeline("decentralized", None), 1, object()) == []  # not keyed


def test_check_config_names_the_window_params_and_the_scaling_policy(tmp_path: Any, capsys: Any) -> None:
    from agent.cli.main import main

    pipe = tmp_path / "p.toml"
    pipe.write_text(_pipeline_text("none", "k", 'time_field = "t", size_ms = 1000, slide_ms = 500, agg = "mean"'))
    assert main(["check-config", str(pipe)]) == 1
    err = capsys.readouterr().err
    assert '[operator[1]].params.slide_ms: unknown key' in err  # tumbling: no slide
    pipe.write_text(_pipeline_text("decentralized", None))
    assert main(["check-config", str(pipe)]) == 1
    assert 'p.toml: [operator[1]]: operator \'win\' keeps keyed state' in capsys.readouterr().err
    for policy in ("none", "decentralized"):
        pipe.write_text(_pipeline_text(policy, "k"))
        assert main(["check-config", str(pipe)]) == 0


# ---- exactly-once: batching, duplicates, crashes ----------------------------------------------------


def as_set(out: List[Any]) -> Dict[Tuple[str, int], str]:
    got: Dict[Tuple[str, int], str] = {}
    for s, q, r in out:
        text = json.dumps(r, sort_keys=True)
        assert got.setdefault((s, q), text) == text, f"id {(s, q)} emitted with two contents"
    return got


WINDOWS = [(tumbling_window, {"size_ms": 5000}), (sliding_window, {"size_ms": 6000, "slide_ms": 2000, "agg": "sum", "field": "v"}),
           (top_k, {"size_ms": 8000, "by": "v", "k": 3})]


@settings(max_examples=60, deadline=None)
@given(which=st.integers(0, 2), seed=st.integers(0, 10**6), cuts=st.lists(st.integers(0, 120), max_size=30),
       lateness=st.sampled_from([0, 1500, 4000]))
def test_outputs_do_not_depend_on_how_records_are_batched(which: int, seed: int, cuts: List[int], lateness: int) -> None:
    cls, params = WINDOWS[which]
    items = stream(120, seed)
    ref = as_set(run(state_of(cls, time_field="t", lateness_ms=lateness, **params), items, []))
    got = as_set(run(state_of(cls, time_field="t", lateness_ms=lateness, **params), items, cuts))
    assert got == ref and len(ref) > 10


def test_a_replayed_record_is_skipped_not_applied_twice() -> None:
    ks = state_of(tumbling_window, time_field="t", size_ms=5000)
    items = stream(40, 1)
    a = ks.apply("p", items[:30], 1)
    b = ks.apply("p", items[10:], 2)  # 10..29 again (a replay), then 30..39
    assert ks.counts["duplicates_skipped"] == 20 and ks.counts["keyed_applied"] == 40
    assert as_set(a + b) == as_set(run(state_of(tumbling_window, time_field="t", size_ms=5000), items, []))


@settings(max_examples=20, deadline=None)
@given(which=st.integers(0, 2), seed=st.integers(0, 10**6), log_min=st.sampled_from([0, 1 << 20]), data=st.data())
def test_a_crash_anywhere_then_restore_and_replay_emits_exactly_the_fault_free_outputs(
        which: int, seed: int, log_min: int, data: Any) -> None:
    """The worker's protocol, without the worker, on the real files: batches are applied; at a
    save the inputs so far are acked (the predecessor forgets them) and the outputs acked
    downstream are pruned; a crash loses memory, then the files are loaded, the saved outputs are
    sent again, and the predecessor replays everything after the last ack (plus, as after a
    redelivery, some acked records again). `log_min` 0 folds the log into a new snapshot at
    almost every other save; 1 MiB never (only the first save and the one after a restore)."""
    import tempfile

    from agent.instance import keyed_state

    cls, params = WINDOWS[which]
    items = stream(100, seed)
    ref = as_set(run(state_of(cls, time_field="t", lateness_ms=1000, **params), items, []))

    def fresh() -> KeyedState:
        return state_of(cls, time_field="t", lateness_ms=1000, **params)

    old_min, keyed_state.LOG_MIN = keyed_state.LOG_MIN, log_min
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "w-0.keyed.json"
            ks, acked, pos, index = fresh(), 0, 0, 0
            delivered: List[Any] = []  # what reached the sink (copies included)
            pending: List[Any] = []  # outputs sent but not acked downstream yet
            while pos < len(items) or pending:
                step = data.draw(st.sampled_from(["batch", "batch", "save", "deliver", "crash"]))
                if step == "batch" and pos < len(items):
                    n = data.draw(st.integers(1, 25))
                    index += 1
                    out = ks.apply("p", items[pos:pos + n], index)
                    pos = min(len(items), pos + n)
                    pending += out
                elif step == "deliver" or (step == "batch" and pos >= len(items)):
                    delivered += pending
                    pending = []
                elif step == "save":
                    ks.prune_outputs(None if not pending else min(i for i, it in ks.outputs if it in pending))
                    ks.save(path)
                    acked = pos
                else:  # crash: memory and unsent outputs lost
                    pending = []
                    ks = fresh()
                    saved = KeyedState.load(path)
                    if saved is not None:
                        again = ks.restore(saved)
                        index += 1
                        ks.outputs = [(index, it) for it in again]
                        pending += again
                    back = data.draw(st.integers(0, 10))
                    pos = max(0, acked - back)  # replay from the ack, and a few acked ones again
            assert as_set(delivered) == ref
    finally:
        keyed_state.LOG_MIN = old_min


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=120))
def test_applied_numbers_are_a_floor_and_ranges_equal_to_the_set_they_stand_for(ops: List[Tuple[bool, int]]) -> None:
    a, model, floor = Applied(), set(), 0
    for is_floor, n in ops:
        if is_floor:
            a.raise_floor(n)
            floor = max(floor, n)
        else:
            assert a.add(n) == (n not in model and n >= floor), (n, a)
            model.add(n)
        assert all((m in a) == (m in model or m < floor) for m in range(45)), a
        assert a.los == sorted(a.los) and all(lo > a.floor for lo in a.los), a
        assert all(a.his[i] + 1 < a.los[i + 1] for i in range(len(a.los) - 1)), a  # merged when adjacent
        assert Applied.from_json(a.to_json()) == a


class _Collect(KeyedOperator):
    """Keeps the number of every record it is given, per key: each must appear exactly once."""

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        return [], (state or []) + [r["n"] for r in records]


def test_a_replayed_older_batch_after_a_newer_one_is_applied_not_skipped() -> None:
    """A restarted predecessor delivers records 8-11 before the replay of 4-7, which it had lost;
    "the highest number applied" (11) would skip 4-7 (CHANGELOG.md, "A keyed operator skipped
    replayed records that came after newer ones")."""
    ks = KeyedState(_Collect.build(OperatorContext("c-0", "c", "n", "map")), "c", "k", 128)
    items = [("src", n, {"k": "a", "n": n}) for n in range(12)]
    ks.apply("p", items[:4], 1)
    ks.apply("p", items[8:], 2)
    ks.apply("p", items[:8], 3, floors={"src": 4})  # the replay: 0-3 again (below the floor), 4-7 new
    assert sorted(ks.states[key_group("a", 128)]["a"]) == list(range(12))
    assert ks.counts["duplicates_skipped"] == 4 and ks.applied["src"] == Applied(12)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), log_min=st.sampled_from([0, 1 << 20]), data=st.data())
def test_each_record_is_applied_exactly_once_in_any_order_with_floors_and_crashes(
        seed: int, log_min: int, data: Any) -> None:
    """Records of two sources come in any order, in batches, with copies of ones already
    applied, and with floor claims no larger than the sound one (every record below it saved,
    or filtered upstream: never delivered). Saves make records safe (the predecessor forgets
    them); a crash loses what was not saved, which the predecessors then deliver again. At the
    end every delivered record is in its key's state exactly once."""
    import tempfile

    from agent.instance import keyed_state

    rng = random.Random(seed)
    records = [(src, n) for src in ("s1", "s2") for n in range(40)]
    filtered = {r for r in records if rng.random() < 0.2}
    live = [r for r in records if r not in filtered]

    def fresh() -> KeyedState:
        return KeyedState(_Collect.build(OperatorContext("c-0", "c", "n", "map")), "c", "k", 8)

    def item(r: Tuple[str, int]) -> Any:
        return (r[0], r[1], {"k": f"k{r[1] % 3}", "n": f"{r[0]}:{r[1]}"})

    old_min, keyed_state.LOG_MIN = keyed_state.LOG_MIN, log_min
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "c-0.keyed.json"
            ks, saved, unsaved, index = fresh(), set(), set(), 0
            for _ in range(data.draw(st.integers(5, 40))):
                step = data.draw(st.sampled_from(["batch", "batch", "batch", "save", "crash"]))
                if step == "batch":
                    todo = [r for r in live if r not in saved]
                    pick = rng.sample(todo, min(len(todo), rng.randrange(1, 8)))
                    pick += rng.sample(sorted(saved), min(len(saved), rng.randrange(0, 3)))  # copies
                    rng.shuffle(pick)
                    floors = {}
                    for src in ("s1", "s2"):
                        sound = min([n for s_, n in live if s_ == src and (s_, n) not in saved] + [40])
                        if rng.random() < 0.5:
                            floors[src] = rng.randrange(0, sound + 1)
                    index += 1
                    ks.apply(rng.choice(["p1", "p2"]), [item(r) for r in pick], index, floors)
                    unsaved |= set(pick)
                elif step == "save":
                    ks.save(path)
                    saved |= unsaved
                    unsaved = set()
                else:
                    ks, unsaved = fresh(), set()
                    loaded = KeyedState.load(path)
                    if loaded is not None:
                        ks.restore(loaded)
            rest = [r for r in live if r not in saved]
            rng.shuffle(rest)
            ks.apply("p1", [item(r) for r in rest], index + 1)
            got = Counter(n for states in ks.states.values() for lst in states.values() for n in lst)
            assert got == Counter(f"{s_}:{n}" for s_, n in live), (got, live)
    finally:
        keyed_state.LOG_MIN = old_min


def test_a_state_saved_in_format_1_restores_its_positions_as_floors() -> None:
    ks = KeyedState(_Collect.build(OperatorContext("c-0", "c", "n", "map")), "c", "k", 128)
    ks.restore({"format": 1, "key_groups": 128, "positions": {"p1 src": 9, "p2 src": 5, "p1 other": 3},
                "max_time": None, "outputs": [], "groups": {}})
    assert ks.applied == {"src": Applied(6), "other": Applied(4)}


def test_the_log_folds_into_a_snapshot_and_both_restore_the_same_state(tmp_path: Any) -> None:
    from agent.instance import keyed_state

    items = stream(200, 5, keys=30)
    ks = state_of(tumbling_window, time_field="t", size_ms=5000)
    path = tmp_path / "w-0.keyed.json"
    for i in range(0, 200, 10):
        ks.apply("p", items[i:i + 10], i + 1)
        ks.save(path)
    log = path.with_name(path.name + ".log")
    assert log.stat().st_size > 0 and path.stat().st_size < log.stat().st_size  # small snapshot, long log
    a = state_of(tumbling_window, time_field="t", size_ms=5000)
    a.restore(KeyedState.load(path))
    assert (a.states, a.emitted, a.applied, a.max_time) == (ks.states, ks.emitted, ks.applied, ks.max_time)
    old_min, keyed_state.LOG_MIN = keyed_state.LOG_MIN, 0
    try:
        ks.apply("p", items[:0] + [("src", 500, {"k": "k1", "t": 300, "v": 1})], 99)
        ks.save(path)  # the log is longer than the snapshot: folded
    finally:
        keyed_state.LOG_MIN = old_min
    assert log.stat().st_size == 0
    b = state_of(tumbling_window, time_field="t", size_ms=5000)
    b.restore(KeyedState.load(path))
    assert (b.states, b.emitted, b.applied, b.max_time) == (ks.states, ks.emitted, ks.applied, ks.max_time)
    with open(log, "ab") as fh:
        fh.write(b'{"gen": 1, "torn')  # a power cut in the middle of a line: ignored
    assert KeyedState.load(path) == json.loads(path.read_text())


def test_a_snapshot_is_the_stdlib_json_of_the_state_and_is_written_without_holding_it_whole(tmp_path: Any) -> None:
    import tracemalloc

    ks = state_of(tumbling_window, time_field="t", size_ms=5000)
    ks.apply("p", stream(300, 7, keys=40), 1)
    # outputs not acked yet are saved with the state: many of them make a large snapshot
    ks.outputs += [(i, ["src", i, {"k": f"k{i % 40}", "pad": "x" * 200, "v": None, "f": 0.1 * i, "u": "\u00e9"}])
                   for i in range(2, 6000)]
    # after a keyed stage every key of it is an output source: thousands of applied sets
    ks.applied.update({f"up#{i:016x}": Applied.from_json([i, [i + 2, i + 3]]) for i in range(3000)})
    doc = {"format": 2, "gen": ks._gen, "operator": ks.operator, "key_groups": ks.groups,
           "applied": {s: a.to_json() for s, a in ks.applied.items()}, "max_time": ks.max_time,
           "outputs": [it for _, it in ks.outputs],
           "groups": {str(g): ks._group_json(g) for g in sorted(set(ks.states) | set(ks.emitted) | set(ks.floors))}}
    whole = json.dumps(doc, separators=(",", ":"))
    assert ks.to_text() == whole  # character for character what encoding it whole writes
    path = tmp_path / "w-0.keyed.json"
    ks._full_next = True
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        ks.save(path)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    text = path.read_text()
    assert len(text) > 1_000_000 and json.loads(text)["gen"] == ks._gen
    assert json.loads(text) == json.loads(ks.to_text())
    assert peak < len(text) / 4, (peak, len(text))  # whole, it took 4-5 times the text
    again = state_of(tumbling_window, time_field="t", size_ms=5000)
    again.restore(KeyedState.load(path))
    assert (again.states, again.emitted, again.applied, again.max_time) == (ks.states, ks.emitted, ks.applied, ks.max_time)


def test_a_key_group_round_trips_through_snapshot_and_restore() -> None:
    ks = state_of(tumbling_window, time_field="t", size_ms=5000)
    ks.apply("p", stream(30, 2), 1)
    g = next(iter(ks.states))
    blob = ks.group_snapshot(g)
    other = state_of(tumbling_window, time_field="t", size_ms=5000)
    other.restore_group(g, blob)
    assert other.states[g] == ks.states[g] and other.emitted[g] == ks.emitted[g]
    assert all(other.timers[k] == ks.timers[k] for k in other.states[g])


def test_a_state_saved_with_other_key_groups_is_refused() -> None:
    ks = state_of(tumbling_window, time_field="t", size_ms=5000)
    ks.apply("p", stream(10, 3), 1)
    data = ks.to_json()
    op = tumbling_window.build(OperatorContext("w-0", "w", "n", "map", params={"time_field": "t", "size_ms": 5000}))
    with pytest.raises(ValueError, match="saved with 128 key groups, the pipeline says 64"):
        KeyedState(op, "w", "k", 64).restore(data)


class _Fragile(KeyedOperator):
    """Counts records per key; raises on a record with "bad"."""

    def on_batch(self, key: Any, records: List[Any], state: Any) -> Tuple[List[Any], Any]:
        n = state or 0
        for r in records:
            if r.get("bad"):
                raise ValueError("bad record")
        n += len(records)
        return [n], n


def test_a_record_the_operator_fails_on_is_counted_and_the_others_of_its_key_are_kept() -> None:
    ks = KeyedState(_Fragile.build(OperatorContext("f-0", "f", "n", "map")), "f", "k", 128)
    out = ks.apply("p", [("s", 0, {"k": "a"}), ("s", 1, {"k": "a", "bad": 1}), ("s", 2, {"k": "a"})], 1)
    assert [r for _, _, r in out] == [1, 2] and ks.counts["keyed_errors"] == 1
    assert Counter(s for s, _, _ in out) == Counter({out[0][0]: 2})


def test_a_worker_refuses_a_keyed_operator_without_its_key_with_one_line(tmp_path: Any) -> None:
    """What a deploy reports (the instance exits before "ready" with this reason): one line."""
    import subprocess
    import sys

    from agent.mqtt.settings import BrokerSpec
    from foglab.tools.dataplane_bench import initial_specs

    spec = initial_specs(_pipeline_text("decentralized", None), BrokerSpec("127.0.0.1", 1), str(tmp_path))[1]
    p = subprocess.run([sys.executable, "-m", "agent.instance.worker"], input=spec.to_json() + "\n",
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    last = json.loads(p.stdout.splitlines()[-1])
    assert last["event"] == "exit" and "the operator before it, 'src', must set key" in last["reason"]
    assert "\n" not in last["reason"]


def test_the_worked_example_of_the_guide_runs_as_printed() -> None:
    """docs/operators.md, "Worked example: the peak reading per sensor and minute": its code,
    executed as printed, over readings of two sensors (one reading late, one not a number)."""

    text = (Path(__file__).resolve().parent.parent / "docs" / "operators.md").read_text()
    section = text[text.index("#### Worked example"):]
    code = section[section.index("```python\n") + 10:section.index("\n```", section.index("```python"))]
    ns: Dict[str, Any] = {}
    exec(compile(code, "docs/operators.md", "exec"), ns)
    cls = ns["PeakPerMinute"]
    params = {"field": "celsius", "time_field": "ts", "lateness_ms": 5000}
    assert check_params(cls, params) == [] and check_params(cls, {"time_field": "ts"})[0][0] == "field"
    ks = KeyedState(cls.build(OperatorContext("p-0", "peaks", "n", "map", params=params)), "peaks", "sensor", 128)
    t0 = 1_764_000_000  # a minute boundary (s)
    readings = [("s1", t0 + 1, 20.5), ("s2", t0 + 2, 18.0), ("s1", t0 + 30, 22.0), ("s1", t0 + 40, "warm"),
                ("s2", t0 + 61, 19.0), ("s1", t0 + 66, 21.0), ("s1", t0 + 50, 30.0), ("s2", t0 + 125, 17.0)]
    items = [("r-0", i, {"sensor": s, "ts": t, "celsius": c}) for i, (s, t, c) in enumerate(readings)]
    out = [r for _, _, r in ks.apply("readings-0", items, 1)]
    m = t0 * 1000
    # t0+66 moves the watermark to t0+61: t0+50 is late (dropped); after the batch the watermark is
    # t0+120: both sensors' first two minutes close, the third stays open
    assert sorted(out, key=lambda r: (r["minute"], r["sensor"])) == [{"sensor": "s1", "minute": m, "readings": 2, "peak": 22.0},
                   {"sensor": "s2", "minute": m, "readings": 1, "peak": 18.0},
                   {"sensor": "s1", "minute": m + 60_000, "readings": 1, "peak": 21.0},
                   {"sensor": "s2", "minute": m + 60_000, "readings": 1, "peak": 19.0}]
    assert ks.counts["late_dropped"] == 1 and ks.stats()["keys_held"] == 1  # s2's third minute


def _steered_agent(tmp_path: Any, instances: Dict[str, bool]) -> Tuple[Any, List[Any]]:
    """An agent (no broker, no workers) hosting `instances` of the keyed operator `win` (id ->
    keeper?), each with stats that say it keeps keyed state; what it sends its workers (and
    which it stops) is appended to the list returned."""
    import subprocess
    import sys

    from agent.config import load_agent_config
    from agent.instance.spec import InstanceSpec
    from agent.mqtt.settings import BrokerSpec
    from agent.node.daemon import Agent
    from agent.node.workers import Worker, WorkerStatus

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}/state"\n[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    sent: List[Any] = []
    agent.supervisor.send = lambda inst, event, **kw: sent.append((inst, event)) or True  # type: ignore[assignment]
    agent.supervisor.stop = lambda inst, now: sent.append((inst, "stop"))  # type: ignore[assignment]
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    for iid, keeper in instances.items():
        spec = InstanceSpec(iid, "win", "me", "c", "p", _pipeline_text("none", "k"), BrokerSpec("h", 1),
                            keeper=keeper, state_dir=str(tmp_path / "state"))
        agent.supervisor.workers[iid] = Worker(spec=spec, proc=proc, started_at=1.0, status=WorkerStatus.ACTIVE,
                                               stats={"keyed_state": True})
    return agent, sent


def _save_keyed(tmp_path: Any, instance: str) -> Path:
    ks = KeyedState(keyed_count.build(OperatorContext(instance, "win", "me", "map", params={})), "win", "k", 128)
    ks.apply("s", [("s", i, {"k": i}) for i in range(50)], 1)
    (tmp_path / "state").mkdir(exist_ok=True)
    path = tmp_path / "state" / f"{instance}.keyed.json"
    ks.save(path)
    return path


def test_an_agent_drains_away_an_instance_with_keyed_state_unless_its_state_is_too_large(
        tmp_path: Any, monkeypatch: Any) -> None:
    """fogctl scale and drain reach the agent (`Requests.steer`): an instance whose stats say it
    keeps keyed state is copied and terminated through the protocol (its key groups move with
    their state), and a drain stops it to move it with its keyed state (agent.node.statexfer),
    unless that state is larger than a hand-over carries: then nothing is changed and the reply
    names the size and the limit."""
    from agent.control.rpc_schema import DrainRequest, ScaleRequest
    from agent.node import statexfer

    agent, sent = _steered_agent(tmp_path, {"p.win.0": True})
    size = len(statexfer.snapshot_bytes(_save_keyed(tmp_path, "p.win.0")) or b"")
    monkeypatch.setattr(statexfer, "MAX_STATE_BYTES", size - 1)
    reply = agent.core.requests.steer(DrainRequest(node="me").to_dict(), 5.0)
    assert not reply["ok"] and reply["error"] == (f"p.win.0 cannot move: its keyed state is {size} bytes, "
                                                  f"more than the {size - 1} a hand-over carries"), reply
    assert sent == [] and not agent.core.drain.draining
    assert agent.core.requests.steer(ScaleRequest(operator="win", delta=1).to_dict(), 5.0)["ok"]
    assert sent == [("p.win.0", "scale")]
    monkeypatch.setattr(statexfer, "MAX_STATE_BYTES", size)
    reply = agent.core.requests.steer(DrainRequest(node="me").to_dict(), 5.0)
    assert reply["ok"] and reply["result"]["leaving"] == ["p.win.0"], reply
    assert sent[-1] == ("p.win.0", "stop") and agent.core.drain.draining and "p.win.0" in agent.core.drain.handing_over


@pytest.mark.parametrize("then", ["copy_left", "wait_over", "undrain"])
def test_a_drained_keeper_stops_once_the_keyed_copies_on_the_node_have_left(tmp_path: Any, then: str) -> None:
    """A drain of a node with a keyed keeper and a copy: the copy gets its termination at once
    (its groups go to the keeper), the keeper is stopped for its hand-over only once the copy has
    exited, so that it leaves with every group installed and nothing held for one; a copy that
    has not left after COPIES_FIRST_WAIT does not hold the drain up longer; an undrain meanwhile
    keeps the keeper."""
    from agent.control.rpc_schema import DrainRequest
    from agent.node.drain import COPIES_FIRST_WAIT

    agent, sent = _steered_agent(tmp_path, {"p.win.0": True, "p.win.1": False})
    _save_keyed(tmp_path, "p.win.0")
    reply = agent.core.requests.steer(DrainRequest(node="me").to_dict(), 5.0)
    assert reply["ok"] and set(reply["result"]["leaving"]) == {"p.win.0", "p.win.1"}, reply
    assert sent == [("p.win.1", "scale")] and "p.win.0" in agent.core.drain.handing_over  # the keeper still runs
    agent.core.exits.release_keepers(6.0)
    assert sent == [("p.win.1", "scale")]
    if then == "copy_left":
        agent.core.exits.release_keepers(7.0, left="p.win.1")  # `_on_reaped` of the copy
    elif then == "wait_over":
        agent.core.exits.release_keepers(5.0 + COPIES_FIRST_WAIT)  # `_periodic`
    else:
        assert agent.core.requests.steer(DrainRequest(node="me", undo=True).to_dict(), 7.0)["ok"]
        agent.core.exits.release_keepers(8.0, left="p.win.1")
        assert sent == [("p.win.1", "scale")] and "p.win.0" not in agent.core.drain.handing_over and not agent.core.drain.draining
        return
    assert sent == [("p.win.1", "scale"), ("p.win.0", "stop")]
    agent.core.exits.release_keepers(5.0 + 2 * COPIES_FIRST_WAIT)
    assert len(sent) == 2  # stopped once


def test_a_group_whose_counters_were_lost_numbers_its_outputs_above_its_floor_wherever_it_goes(tmp_path: Path) -> None:
    """Re-homed without its state, a keyed instance numbered each key's outputs from 1 again: the
    ids of outputs the sink had recorded from the dead incarnation, dropped there as copies (a
    chaos run lost every window of the re-homed keys). A floored group numbers a key without a
    counter above the floor; the floor is saved with the group and moves with it."""
    from agent.operators.keyed import keyed_count

    def state(name: str) -> KeyedState:
        return KeyedState(keyed_count.build(OperatorContext(name, "cnt", "me", "map", params={})), "cnt", "k", 8)

    ks = state("p.cnt.1")
    g = key_group("a", 8)
    ks.floor_groups([g], 5_000)
    (out,) = ks.apply("p", [("src", 0, {"k": "a"})], 1)
    assert out[1] == 5_001
    other = next(k for k in (f"k{i}" for i in range(1000)) if key_group(k, 8) != g)
    (plain,) = ks.apply("p", [("src", 1, {"k": other})], 2)
    assert plain[1] == 1  # a group with its counters numbers from 1 as before
    ks.save(tmp_path / "k.keyed.json")
    again = state("p.cnt.1")
    again.restore(KeyedState.load(tmp_path / "k.keyed.json"))  # type: ignore[arg-type]
    assert again.floors == {g: 5_000}
    moved = state("p.cnt.0")
    moved.take_in(g, again.hand_out(g))
    fresh = next(k for k in (f"k{i}" for i in range(1000)) if key_group(k, 8) == g)
    (o,) = moved.apply("p", [("src", 2, {"k": fresh})], 1)
    assert o[1] == 5_001  # a key of the moved group without a counter: above the floor there too
    assert moved.floors == {g: 5_000} and again.floors == {}
