"""The spool: rotation, fsync'ed closed files, disk cap with back pressure, restarts."""

from __future__ import annotations

import gzip
import random
import threading
from pathlib import Path
from typing import List

import pytest

from agent.spill.spool import Spool, file_id, parse_name, read_records


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def all_records(spool: Spool, kind: str = "records") -> List[dict]:
    out: List[dict] = []
    for f in spool.closed_files():
        if f.kind == kind:
            out.extend(read_records(f.path.read_bytes()))
    return out


def rec(i: int, rng: random.Random) -> dict:
    return {"record_id": i, "fare": round(rng.uniform(2, 60), 2), "pad": rng.getrandbits(64)}


def test_records_come_back_in_order_once_per_kind_across_rotations(tmp_path: Path) -> None:
    rng = random.Random(7)
    s = Spool(tmp_path, "n1", rotate_bytes=4000, sync_bytes=1000, clock=FakeClock())
    for i in range(3000):
        assert s.append("records", rec(i, rng))
        if i % 10 == 0:
            assert s.append("metrics", {"t": i, "load": i % 17})
    s.close()
    files = s.closed_files()
    assert len([f for f in files if f.kind == "records"]) > 5, "size rotation never happened"
    assert [r["record_id"] for r in all_records(s)] == list(range(3000))
    assert [r["t"] for r in all_records(s, "metrics")] == list(range(0, 3000, 10))
    for f in files:  # each closed file is a complete gzip stream of one kind from this node
        meta = parse_name(f.name)
        assert meta["kind"] == f.kind and meta["node"] == "n1"
        gzip.decompress(f.path.read_bytes())
    assert not list((tmp_path / "open").iterdir())
    assert s.stats["appended"] == 3000 + 300


def test_rotation_by_age_uses_the_injected_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    s = Spool(tmp_path, "n1", rotate_seconds=60, clock=clock)
    s.append("events", {"e": 1})
    clock.t += 59.0
    s.tick()
    assert s.closed_files() == []
    clock.t += 1.0
    s.tick()
    files = s.closed_files()
    assert len(files) == 1 and read_records(files[0].path.read_bytes()) == [{"e": 1}]
    s.tick()  # nothing open: no empty files
    assert len(s.closed_files()) == 1


def test_cap_applies_back_pressure_raises_one_event_and_loses_nothing(tmp_path: Path) -> None:
    rng = random.Random(3)
    events = []
    s = Spool(tmp_path, "n1", max_bytes=30_000, rotate_bytes=5_000, sync_bytes=2_000,
              clock=FakeClock(), on_event=events.append)
    i = 0
    while s.append("records", rec(i, rng)):
        i += 1
    stored_before = i
    assert s.full
    # More attempts while full: refused again, no second event, nothing written.
    for _ in range(50):
        assert not s.append("records", rec(i, rng))
    assert s.stats["rejected"] == 51
    full_events = [e for e in events if e.event == "spool_full"]
    assert len(full_events) == 1 and full_events[0].detail["max_bytes"] == 30_000
    assert s.used_bytes() <= 30_000 + 200  # soft by at most one record (+ gzip trailer)
    s.rotate_all()
    assert sorted(r["record_id"] for r in all_records(s)) == list(range(stored_before))
    # Shipping frees space: back pressure ends with an event, and the refused record goes in.
    shipped = []
    for f in s.closed_files()[:3]:
        shipped.extend(read_records(f.path.read_bytes()))
        s.release(f)
    assert not s.full and events[-1].event == "spool_resumed"
    assert s.append("records", rec(i, rng))
    s.close()
    got = sorted(r["record_id"] for r in shipped + all_records(s))
    assert got == list(range(stored_before + 1))


def test_sink_blocked_by_the_cap_resumes_when_the_shipper_releases(tmp_path: Path) -> None:
    """A sink thread that waits on back pressure and a shipper thread: all records, once."""
    rng = random.Random(5)
    s = Spool(tmp_path, "n1", max_bytes=20_000, rotate_bytes=3_000, sync_bytes=1_000)
    shipped: List[dict] = []
    done = threading.Event()
    N = 4000

    def sink() -> None:
        for i in range(N):
            r = rec(i, rng)
            while not s.append("records", r):
                s.wait_writable(timeout=0.05)
        s.close()
        done.set()

    def shipper() -> None:
        while True:
            finished = done.is_set()
            files = s.closed_files()
            # A link slower than the sink: ship only while the cap holds the sink back, one file
            # at a time, so that the sink really waits (deterministic whatever the machine load).
            for f in files if finished else (files[:1] if s.full else []):
                shipped.extend(read_records(f.path.read_bytes()))
                s.release(f)
            if finished:
                return
            done.wait(0.005)

    threads = [threading.Thread(target=sink), threading.Thread(target=shipper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert s.stats["full_events"] >= 1, "the cap was never reached: the test proves nothing"
    assert [r["record_id"] for r in shipped] == list(range(N))


def test_restart_resumes_closed_files_and_salvages_the_open_one(tmp_path: Path) -> None:
    clock = FakeClock()
    s1 = Spool(tmp_path, "n1", rotate_bytes=2_000, sync_bytes=500, clock=clock)
    rng = random.Random(11)
    for i in range(600):
        s1.append("records", rec(i, rng))
    s1.flush()  # a checkpoint: what is in the open file reached the disk
    closed_before = {f.name for f in s1.closed_files()}
    assert closed_before and list((tmp_path / "open").iterdir())
    # "Crash": s1 is abandoned without close(); a new agent process opens the same directory.
    events = []
    s2 = Spool(tmp_path, "n1", rotate_bytes=2_000, clock=clock, on_event=events.append)
    assert closed_before <= {f.name for f in s2.closed_files()}
    assert not list((tmp_path / "open").iterdir())
    assert [e.event for e in events].count("recovered") == 1
    ids = [r["record_id"] for r in all_records(s2)]
    assert ids == list(range(600))  # flushed before the crash: nothing lost, nothing twice
    # New files continue the sequence instead of reusing names of files still waiting to ship.
    s2.append("records", {"record_id": 600})
    s2.close()
    seqs = [f.seq for f in s2.closed_files()]
    assert len(seqs) == len(set(seqs)) and max(seqs) == seqs[-1]
    assert [r["record_id"] for r in all_records(s2)] == list(range(601))


def test_truncated_open_file_keeps_only_complete_records(tmp_path: Path) -> None:
    s1 = Spool(tmp_path, "n1", sync_bytes=300)
    for i in range(200):
        s1.append("records", {"record_id": i, "text": "x" * 20})
    s1.flush()
    (open_file,) = list((tmp_path / "open").iterdir())
    data = open_file.read_bytes()
    open_file.write_bytes(data[: len(data) * 2 // 3])  # torn write at a power cut
    s2 = Spool(tmp_path, "n1")
    got = [r["record_id"] for r in all_records(s2)]
    assert got == list(range(len(got))) and 0 < len(got) < 200
    assert s2.stats["recovered_records"] == len(got)


def test_file_id_is_content_derived_and_distinct_for_distinct_files(tmp_path: Path) -> None:
    clock = FakeClock()
    s = Spool(tmp_path, "n1", clock=clock)
    s.append("records", {"a": 1})
    s.rotate_all()
    s.append("records", {"a": 1})  # same records, another file
    s.rotate_all()
    a, b = s.closed_files()
    assert file_id(a.path.read_bytes()) == file_id(a.path.read_bytes())
    assert file_id(a.path.read_bytes()) != file_id(b.path.read_bytes())


def test_bad_kind_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    s = Spool(tmp_path, "n1")
    with pytest.raises(ValueError, match="invalid kind"):
        s.append("a+b", {})


def test_batch_lines_are_expanded_by_readers(tmp_path: Path) -> None:
    """A sink may spill a batch as received (one JSON array per line): no re-encoding."""
    import json

    s = Spool(tmp_path, "n1")
    batch = [{"record_id": i} for i in range(5)]
    assert s.append_lines("records", [json.dumps(batch).encode() + b"\n"]) == 1
    s.append("records", {"record_id": 5})
    s.close()
    assert [r["record_id"] for r in all_records(s)] == list(range(6))
