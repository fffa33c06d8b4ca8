"""The built-in file sink (agent.operators.filesink), sans-IO: no broker, no worker.

It keeps the sink contract of the counting sink: each record id written once, whatever the
replays, also after a crash between the data write and the ids write; one JSON line per record;
rotation by size and by age (an injected clock); the fsync policy it states.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from agent.operators.admission import AllowList
from agent.operators.builtin import OperatorContext, load_operator, read_sink_ids

REF = "agent.operators.filesink:file_sink"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, clock: Any = None, **params: Any) -> Any:
    from agent.operators.filesink import FileSink

    ctx = OperatorContext("p.out.0", "out", "n1", "sink", params=params, sink_dir=tmp_path)
    return FileSink(ctx, clock=clock or Clock())


def files(tmp_path: Path) -> List[str]:
    return sorted(f.name for f in (tmp_path / "p.out.0").iterdir())


def batch(src: str, seqs: Any) -> List[Tuple[str, int, Dict[str, Any]]]:
    return [(src, q, {"n": q, "text": f"r{q}"}) for q in seqs]


def test_one_json_line_per_record_with_its_id_and_duplicates_dropped(tmp_path: Path) -> None:
    sink = make(tmp_path)
    assert sink.record(batch("s.0", range(3))) == []
    sink.record(batch("s.0", [1, 2, 3, 3]))  # a replay, and a record twice in one batch
    sink.record(batch("s.1", [0]))
    assert sink.settle() == 3  # every call recorded before it returned
    part = tmp_path / "p.out.0" / "p.out.0-000001.jsonl.part"
    lines = part.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"id": ["s.0", q], "record": {"n": q, "text": f"r{q}"}} for q in range(4)] + [
        {"id": ["s.1", 0], "record": {"n": 0, "text": "r0"}}]
    assert sink.stats()["duplicates_dropped"] == 3 and sink.stats()["recorded"] == 5
    ids, dup = read_sink_ids(tmp_path)  # the counting sink's ids file: verifiers read it as they read one
    assert ids == {"s.0": {0, 1, 2, 3}, "s.1": {0}} and dup == 0
    sink.close()  # a clean close completes the open file
    assert files(tmp_path) == ["p.out.0-000001.jsonl"]
    # restarted: ids seen before are duplicates still, numbering goes on
    again = make(tmp_path)
    again.record(batch("s.0", [3, 4]))
    again.close()
    assert files(tmp_path) == ["p.out.0-000001.jsonl", "p.out.0-000002.jsonl"]
    from agent.operators.filesink import read_lines

    assert [rid for rid, _ in read_lines(tmp_path / "p.out.0")] == [("s.0", q) for q in range(4)] + [("s.1", 0), ("s.0", 4)]


def test_rotation_by_size_and_by_age(tmp_path: Path) -> None:
    clock = Clock()
    sink = make(tmp_path, clock, rotate_bytes=200, rotate_seconds=60)
    for i in range(4):
        sink.record(batch("s.0", range(3 * i, 3 * i + 3)))  # ~150 bytes a call: every second call rotates
    assert files(tmp_path) == ["p.out.0-000001.jsonl", "p.out.0-000002.jsonl"]
    sink.record(batch("s.0", [12]))
    clock.now += 59
    sink.settle()
    assert files(tmp_path)[-1] == "p.out.0-000003.jsonl.part"
    clock.now += 1
    sink.settle()  # 60 s old: closed, even with nothing new
    assert files(tmp_path) == ["p.out.0-000001.jsonl", "p.out.0-000002.jsonl", "p.out.0-000003.jsonl"]
    clock.now += 600
    sink.settle()  # no open file: none is made empty
    assert len(files(tmp_path)) == 3
    for name in files(tmp_path):
        raw = (tmp_path / "p.out.0" / name).read_bytes()
        assert raw.endswith(b"\n") and all(json.loads(x)["id"][0] == "s.0" for x in raw.splitlines())
    # rotate_seconds = 0: by size only
    other = make(tmp_path / "b", clock, rotate_seconds=0)
    other.record(batch("s.0", [0]))
    clock.now += 10 ** 6
    other.settle()
    assert files(tmp_path / "b") == ["p.out.0-000001.jsonl.part"]


@pytest.mark.parametrize("policy, per_batch", [("batch", 2), ("rotate", 0)])
def test_the_fsync_policy_is_the_stated_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str,
                                            per_batch: int) -> None:
    synced: List[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    sink = make(tmp_path, rotate_bytes=10 ** 6, fsync=policy)
    for i in range(5):
        sink.record(batch("s.0", [i]))
    assert len(synced) == 5 * per_batch  # "batch": the data file and the ids file before each ack
    synced.clear()
    sink.close()  # any policy: a rotation fsyncs the file, the ids file and the directory
    assert len(synced) >= 3


def test_a_crash_between_the_two_writes_and_a_torn_line_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    """Seeded runs: batches with replays, the process "crashing" at a random write (after the
    data, before the ids; or in the middle of a data line), a new sink on the same directory,
    then the predecessors' replay of everything not acked. Each id is written exactly once."""
    from agent.operators.filesink import FileSink, read_lines

    class Crash(Exception):
        pass

    for seed in range(40):
        rng = random.Random(seed)
        d = tmp_path / str(seed)
        batches = [batch("s.0", range(5 * i, 5 * i + 5)) for i in range(12)]
        acked = 0
        crashes = 0
        while acked < len(batches):
            sink = make(d, rotate_bytes=rng.choice([150, 400, 10 ** 6]))
            crash_at = rng.randrange(len(batches) - acked + 2) if crashes < 3 else None
            torn = rng.random() < 0.5
            calls = {"n": 0}

            def write_ids(lines: str, s: Any = sink) -> None:
                calls["n"] += 1
                if calls["n"] == crash_at:
                    raise Crash()
                FileSink._write_ids(s, lines)

            def write_data(data: bytes, s: Any = sink) -> None:
                if torn and calls["n"] + 1 == crash_at:  # half a line reaches the file, then the crash
                    s._data.write(data[: len(data) // 2 + 1])
                    s._data.flush()
                    raise Crash()
                FileSink._write_data(s, data)

            sink._write_ids, sink._write_data = write_ids, write_data
            try:
                # a replay of the last acked batch first (the predecessor did not see our ack)
                for b in batches[max(0, acked - 1):]:
                    sink.record(b + (b[:2] if rng.random() < 0.3 else []))
                    acked = max(acked, batches.index(b) + 1)
                sink.close()
            except Crash:
                crashes += 1
                sink._ids.close()
                if sink._data is not None:
                    sink._data.close()
        got = [rid for rid, _ in read_lines(d / "p.out.0")]
        want = [("s.0", q) for q in range(60)]
        assert sorted(got) == want, (seed, len(got))
        ids, dup = read_sink_ids(d)
        assert ids == {"s.0": set(range(60))} and dup == 0, seed


def test_check_config_and_the_loader_know_the_file_sink(tmp_path: Path, capsys: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli import config_cmd

    monkeypatch.setenv("FOG_AGENT_CONFIG", str(tmp_path / "no-such-agent.toml"))
    p = tmp_path / "p.toml"
    text = ('[pipeline]\nname = "p"\n[[operator]]\nname = "source"\nkind = "source"\n'
            'function = "agent.operators.taxi:source"\n[[operator]]\nname = "out"\nkind = "sink"\n'
            f'function = "{REF}"\nparams = {{ {{}} }}\n')
    for params, line in (("rotate_bytes = 1048576, fsync = \"batch\"", None),
                         ('fsync = "sometimes"', f'error: {p}: [operator[1]].params.fsync: expected one of "rotate", '
                                                 f'"batch", got "sometimes"'),
                         ("rotate_seconds = -1", f"error: {p}: [operator[1]].params.rotate_seconds: expected a finite "
                                                 f"number >= 0, got -1")):
        p.write_text(text.replace("{ {} }", "{ " + params + " }"))
        rc = config_cmd.run(argparse.Namespace(file=str(p), kind=None, json=False, agent_config=None))
        err = [x for x in capsys.readouterr().err.splitlines() if x]
        assert (rc, err) == ((0, []) if line is None else (1, [line])), err
    ctx = OperatorContext("p.out.0", "out", "n1", "sink", params={"fsync": "batch"}, sink_dir=tmp_path)
    sink = load_operator(REF, ctx, AllowList.for_node())
    assert sink.deferred and sink.fsync == "batch" and sink.dir == tmp_path / "p.out.0"
