"""BatchSpool, the counting sink's spool: a line is in the OS file when append_line returns (no
thread hand-off before the ack), files are gzip'ed by a helper thread only after the caller's
`before_close` (the sink's ids fsync), the cap holds appends back with one event and loses
nothing, and a crash loses nothing that reached the disk, lands nothing twice."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any, List

import pytest

from agent.dataplane.envelope import Item
from agent.operators.builtin import CountingSink, OperatorContext, _line_ids
from agent.spill.batchspool import BatchSpool, gzip_engine
from agent.spill.spool import SpoolEvent, file_id, parse_name, read_records

ENGINES = ["zlib"] + (["isal"] if gzip_engine() == "isal" else [])


def line(i: int) -> bytes:
    """A JSON line about as compressible as a taxi record (hex digits: ratio ~0.6)."""
    pad = hashlib.sha256(str(i).encode()).hexdigest()[: 20 + i % 40]
    return json.dumps({"record_id": i, "pad": pad}).encode() + b"\n"


def closed_ids(d: Path) -> List[int]:
    files = sorted((d / "closed").iterdir(), key=lambda p: parse_name(p.name)["seq"])
    return [r["record_id"] for p in files for r in read_records(p.read_bytes())]


@pytest.mark.parametrize("engine", ENGINES)
def test_lines_are_in_the_os_file_at_once_and_come_back_in_order(tmp_path: Path, engine: str) -> None:
    s = BatchSpool(tmp_path, "n1", rotate_bytes=3000, engine=engine)
    for i in range(500):
        assert s.append_line("records", line(i))
        # The file appended to is the newest (older ones may wait for the compressor).
        open_file = max((tmp_path / "open").glob("*.jsonl"), key=lambda p: parse_name(p.name + ".gz")["seq"])
        # Handed to the OS: another reader (a crash's successor) sees the whole line now.
        assert open_file.read_bytes().endswith(line(i))
        s.close_full_files()
    s.close()
    assert not list((tmp_path / "open").iterdir())
    files = list((tmp_path / "closed").iterdir())
    assert len(files) >= 4, "no rotation by size: test too weak"
    assert all(p.read_bytes()[:2] == b"\x1f\x8b" for p in files)
    assert closed_ids(tmp_path) == list(range(500))
    assert s.stats["files_closed"] == len(files)


def test_append_never_closes_a_file_before_the_caller_says_so(tmp_path: Path) -> None:
    calls: List[int] = []
    s = BatchSpool(tmp_path, "n1", rotate_bytes=500,
                   before_close=lambda: calls.append(len(list((tmp_path / "closed").iterdir()))))
    for i in range(100):
        s.append_line("records", line(i))
    assert s.wait_idle(5) and not calls and not list((tmp_path / "closed").iterdir())
    s.close_full_files()
    assert s.wait_idle(5)
    assert calls == [0] and len(list((tmp_path / "closed").iterdir())) == 1
    for i in range(100, 300):
        s.append_line("records", line(i))
        s.close_full_files()
    s.close()
    # before_close ran once per file, each time BEFORE that file reached closed/.
    n = len(list((tmp_path / "closed").iterdir()))
    assert calls == list(range(n))
    assert closed_ids(tmp_path) == list(range(300))


def test_cap_holds_appends_back_with_one_event_and_resumes_after_a_release(tmp_path: Path) -> None:
    events: List[SpoolEvent] = []
    s = BatchSpool(tmp_path, "n1", max_bytes=6000, rotate_bytes=1500, on_event=events.append)
    stored, refused = 0, 0
    while refused < 50:
        if s.append_line("records", line(stored)):
            stored += 1
            s.close_full_files()
        else:
            refused += 1
            s.wait_idle(5)
    assert s.full and s.used_bytes() < 6000 + 200
    # One event per episode: compressing counted-as-raw bytes may end one (resumed), never twice.
    cap = [e.event for e in events if e.event in ("spool_full", "spool_resumed")]
    assert cap[0] == cap[-1] == "spool_full" and all(a != b for a, b in zip(cap, cap[1:])), cap
    # Another process (the daemon's shipper) ships and releases every closed file.
    for p in (tmp_path / "closed").iterdir():
        p.unlink()
    s._last_refresh = 0.0  # noqa: SLF001 - the 0.2 s recount limit, not what this test is about
    assert s.append_line("records", line(stored))
    stored += 1
    assert not s.full and events[-1].event == "spool_resumed"
    for p in (tmp_path / "closed").iterdir():
        p.unlink()
    s.close()
    # Nothing was dropped: what was released earlier plus what is in closed/ now is every line.
    assert s.stats["appended"] == stored and s.stats["rejected"] == refused


def test_a_full_spool_closes_its_open_files_so_that_they_can_ship(tmp_path: Path) -> None:
    s = BatchSpool(tmp_path, "n1", max_bytes=4000, rotate_bytes=100_000, rotate_seconds=3600)
    n = 0
    while s.append_line("records", line(n)):
        n += 1
        s.close_full_files()
    assert s.full and s.wait_idle(5)
    assert list((tmp_path / "open").iterdir()), "no open file at the cap: test too weak"
    s.tick()  # full: the open file is closed too, long before rotate_seconds
    assert s.wait_idle(5) and not list((tmp_path / "open").iterdir())
    assert closed_ids(tmp_path) == list(range(n))
    for p in (tmp_path / "closed").iterdir():
        p.unlink()  # shipped and released
    s.tick()
    assert not s.full and s.append_line("records", line(n))
    s.close()


def test_a_crash_keeps_the_complete_lines_of_the_open_file(tmp_path: Path) -> None:
    s1 = BatchSpool(tmp_path / "sp", "n1", rotate_bytes=1 << 20)
    for i in range(200):
        s1.append_line("records", line(i))
    (open_file,) = list((tmp_path / "sp" / "open").iterdir())
    with open(open_file, "ab") as fh:
        fh.write(b'{"record_id": 200, "pa')  # torn last line: the process died inside a write
    # "kill -9": s1 is abandoned; a new process opens the directory.
    events: List[SpoolEvent] = []
    fsyncs: List[int] = []
    s2 = BatchSpool(tmp_path / "sp", "n1", on_event=events.append, before_close=lambda: fsyncs.append(1))
    s2.close()
    assert [e.event for e in events if e.event == "recovered"] == ["recovered"]
    assert s2.stats["recovered_records"] == 200 and fsyncs
    assert not list((tmp_path / "sp" / "open").iterdir())
    assert closed_ids(tmp_path / "sp") == list(range(200))
    s3 = BatchSpool(tmp_path / "sp", "n1")  # the sequence continues: no name is reused
    s3.append_line("records", line(200))
    s3.close()
    names = [p.name for p in (tmp_path / "sp" / "closed").iterdir()]
    assert len(names) == len(set(names)) == 2
    assert closed_ids(tmp_path / "sp") == list(range(201))


def test_a_crash_between_compression_and_delete_lands_nothing_twice(tmp_path: Path) -> None:
    s1 = BatchSpool(tmp_path / "sp", "n1", rotate_bytes=1 << 20)
    for i in range(300):
        s1.append_line("records", line(i))
    (plain,) = list((tmp_path / "sp" / "open").iterdir())
    kept = plain.read_bytes()
    s1.close()
    (gz,) = list((tmp_path / "sp" / "closed").iterdir())
    shipped = gz.read_bytes()
    # Crash after the rename into closed/, before the plain file was deleted: the gzip is there.
    plain.write_bytes(kept)
    BatchSpool(tmp_path / "sp", "n1").close()
    assert [p.name for p in (tmp_path / "sp" / "closed").iterdir()] == [gz.name]
    assert not list((tmp_path / "sp" / "open").iterdir())
    # Same crash, but the shipper had shipped and released the gzip: compressed again, to the
    # same bytes, so the collector recognises the same file id (duplicate, not landed twice).
    gz.unlink()
    plain.write_bytes(kept)
    BatchSpool(tmp_path / "sp", "n1").close()
    (again,) = list((tmp_path / "sp" / "closed").iterdir())
    assert again.name == gz.name and file_id(again.read_bytes()) == file_id(shipped)
    assert shipped[4:8] == b"\0\0\0\0", "gzip mtime must not depend on when it was compressed"


def test_an_open_file_of_the_older_gzip_spool_is_salvaged(tmp_path: Path) -> None:
    d = tmp_path / "sp"
    (d / "open").mkdir(parents=True)
    name = "batches+n1+2026-11-24+0000000004.jsonl.gz"
    with gzip.open(d / "open" / name, "wb") as fh:
        fh.write(b"".join(line(i) for i in range(50)))
    s = BatchSpool(d, "n1")
    s.append_line("batches", line(50))
    s.close()
    assert closed_ids(d) == list(range(51))
    assert sorted(p.name for p in (d / "closed").iterdir())[0] == name
    assert not list((d / "open").iterdir())


def test_rotation_by_age_and_leftover_temp_files(tmp_path: Path) -> None:
    now = [1_000_000.0]
    d = tmp_path / "sp"
    (d / "open").mkdir(parents=True)
    # A crash interrupted the compression of file 9: its plain source and a partial gzip remain.
    (d / "open" / "records+n1+2026-11-24+0000000009.jsonl").write_bytes(line(-1))
    (d / "open" / "records+n1+2026-11-24+0000000009.jsonl.gz.tmp").write_bytes(b"half a gzip")
    s = BatchSpool(d, "n1", rotate_seconds=10, clock=lambda: now[0])
    assert s.wait_idle(5) and not list((d / "open").iterdir()) and closed_ids(d) == [-1]
    s.append_line("records", line(0))
    s.tick()
    assert s.wait_idle(5) and closed_ids(d) == [-1]
    now[0] += 11
    s.tick()
    assert s.wait_idle(5) and closed_ids(d) == [-1, 0]
    assert sorted(p.name[-19:-9] for p in (d / "closed").iterdir()) == ["0000000009", "0000000010"]
    s.close()


def test_unknown_or_missing_engine_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown gzip engine"):
        BatchSpool(tmp_path, "n1", engine="lz4")
    if gzip_engine() == "zlib":
        with pytest.raises(ValueError, match="not installed"):
            BatchSpool(tmp_path, "n1", engine="isal")


def test_closed_spool_refuses_appends(tmp_path: Path) -> None:
    s = BatchSpool(tmp_path, "n1")
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.append_line("records", line(0))
    assert os.path.isdir(tmp_path / "closed")  # the directory stays for the shipper


# ---- the counting sink on its BatchSpool (no broker: the order of its writes per batch) ----------


def sink(tmp_path: Path, **spill: Any) -> CountingSink:
    ctx = OperatorContext(instance="sink-0", operator="sink", node="n1", kind="sink", sink_dir=tmp_path / "ids",
                          spill={"dir": str(tmp_path / "spool"), **spill})
    return CountingSink(ctx)


def batch_body(first: int, n: int) -> bytes:
    rows = [["source-0", first + k, [first + k, "pad" * 20]] for k in range(n)]
    return json.dumps({"k": ["id", "pad"], "r": rows}, separators=(",", ":")).encode()


def items(first: int, n: int) -> List[Item]:
    return [("source-0", first + k, {"id": first + k, "pad": "pad" * 20}) for k in range(n)]


def test_sink_writes_line_then_ids_then_reports_the_batch_done(tmp_path: Path) -> None:
    s = sink(tmp_path)
    ids_file = tmp_path / "ids" / "sink-0.ids"
    s.record_batch(items(0, 10), batch_body(0, 10))
    # Before settle() (the worker's ack): the line is in the OS file and so are its ids.
    (plain,) = list((tmp_path / "spool" / "sink-0" / "open").iterdir())
    assert plain.read_bytes() == batch_body(0, 10) + b"\n"
    assert ids_file.read_text().splitlines() == [f"source-0 {i}" for i in range(10)]
    assert s.settle() == 1 and s.settle() == 0 and s.writable()
    s.record_batch(items(5, 10), batch_body(5, 10))  # 5 duplicates: only the 5 new ones, re-encoded
    assert s.settle() == 1 and s.duplicates == 5
    assert ids_file.read_text().splitlines() == [f"source-0 {i}" for i in range(15)]
    s.close()
    files = list((tmp_path / "spool" / "sink-0" / "closed").iterdir())
    spooled = [i for p in files for ln in gzip.decompress(p.read_bytes()).splitlines() for i in _line_ids(ln)]
    assert sorted(spooled) == [("source-0", i) for i in range(15)]


def test_sink_at_the_cap_keeps_the_batch_unacked_and_writes_no_ids(tmp_path: Path) -> None:
    s = sink(tmp_path, max_bytes=3000, rotate_bytes=1000)
    ids_file = tmp_path / "ids" / "sink-0.ids"
    done, first = 0, 0
    while s.writable():
        s.record_batch(items(first, 10), batch_body(first, 10))
        first += 10
        done += s.settle()
        s.spool.wait_idle(5)
    held = first - 10  # the last batch: refused by the cap, kept
    assert done == first // 10 - 1 and s.settle() == 0
    assert ids_file.read_text().splitlines() == [f"source-0 {i}" for i in range(held)]
    assert any(e.get("event") == "spool_full" for e in s.take_events())
    for p in (tmp_path / "spool" / "sink-0" / "closed").iterdir():
        p.unlink()  # the daemon's shipper released them
    s.spool._last_refresh = 0.0  # noqa: SLF001 - the 0.2 s recount limit, not what this test is about
    assert s.settle() == 1 and s.writable()
    assert ids_file.read_text().splitlines() == [f"source-0 {i}" for i in range(first)]
    assert any(e.get("event") == "spool_resumed" for e in s.take_events())
    s.close()


def test_the_agent_ships_the_spool_a_sink_left_open_when_it_no_longer_runs_here(tmp_path: Path) -> None:
    """A node that lost power while its sink's file was open, and came back after the sink was
    re-homed: nobody else holds those records (acked upstream once written), so the agent closes
    the file for its shipper. Never the spool of a sink that runs here or whose instance lock a
    live process holds (a worker starting or still draining)."""
    import fcntl
    import types

    from agent.spill.local import AgentSpill

    root, locks = tmp_path / "spool", tmp_path / "state"
    locks.mkdir()
    for inst in ("gone", "here", "busy"):
        s = BatchSpool(root / inst, "n1", rotate_bytes=1 << 20)
        for i in range(20):
            s.append_line("records", line(i))  # abandoned open: the power cut
    spill = types.SimpleNamespace(spool_dir=str(root), max_bytes=1 << 30, rotate_bytes=1 << 20,
                                  rotate_seconds=60.0, ship="none", ship_path="", ack="written")
    agent = AgentSpill(types.SimpleNamespace(spill=spill, agent=types.SimpleNamespace(node="n1", cluster="c")))
    held = os.open(str(locks / "busy.lock"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert agent.salvage_orphans({"here"}, locks) == 1
    finally:
        os.close(held)
    assert closed_ids(root / "gone") == list(range(20)) and not list((root / "gone" / "open").iterdir())
    for inst in ("here", "busy"):  # left to their workers
        assert list((root / inst / "open").iterdir()) and not list((root / inst / "closed").iterdir())
    assert agent.salvage_orphans({"here"}, locks) == 1  # the lock released: "busy" now
    agent.close()


def test_the_agent_salvages_orphaned_spools_on_its_tick_once_per_salvage_period(tmp_path: Path) -> None:
    """AgentSpill.tick, what the daemon's loop calls every turn: the spools of sinks that no
    longer run here are salvaged at the first turn and then once per SALVAGE_PERIOD, not every
    turn (a directory walk with a lock per spool); a sink that runs is left to its worker."""
    import types

    from agent.spill.local import SALVAGE_PERIOD, AgentSpill

    root, locks = tmp_path / "spool", tmp_path / "state"
    locks.mkdir()
    spill = types.SimpleNamespace(spool_dir=str(root), max_bytes=1 << 30, rotate_bytes=1 << 20,
                                  rotate_seconds=60.0, ship="none", ship_path="", ack="written")
    agent = AgentSpill(types.SimpleNamespace(spill=spill, agent=types.SimpleNamespace(node="n1", cluster="c")))

    def orphan(inst: str) -> None:
        s = BatchSpool(root / inst, "n1", rotate_bytes=1 << 20)
        s.append_line("records", line(0))  # abandoned open

    orphan("gone")
    orphan("here")
    agent.tick(100.0, {"here": object()}, locks)
    assert closed_ids(root / "gone") == [0] and not list((root / "here" / "closed").iterdir())
    orphan("later")
    agent.tick(100.0 + SALVAGE_PERIOD - 0.01, {"here": object()}, locks)
    assert not list((root / "later" / "closed").iterdir())  # not yet
    agent.tick(100.0 + SALVAGE_PERIOD, {"here": object()}, locks)
    assert closed_ids(root / "later") == [0] and not list((root / "here" / "closed").iterdir())
    agent.close()


def test_a_sink_acking_once_landed_holds_each_batch_until_its_file_left_the_spool(tmp_path: Path, monkeypatch) -> None:
    """ack "landed": settle() releases no batch while its spool file is open or closed and not
    shipped; the shipper landing (and so releasing) the file releases them, in order; a batch of
    duplicates whose first copies landed is released at once."""
    from agent.operators import builtin
    from agent.spill.shipper import PathShipper
    from agent.spill.spool import SpoolDirs

    monkeypatch.setattr(builtin, "LAND_CHECK", 0.0)
    monkeypatch.setattr(builtin, "LANDED_CLOSE_AFTER", 3600.0)
    s = sink(tmp_path, ack="landed", rotate_bytes=1 << 20)
    shipper = PathShipper(SpoolDirs(tmp_path / "spool", "n1"), tmp_path / "landing")
    for k in range(3):
        s.record_batch(items(10 * k, 10), batch_body(10 * k, 10))
    assert s.settle() == 0 and s.stats()["acks_held"] == 3
    assert shipper.ship_once() == 0 and s.settle() == 0  # still open: nothing to ship
    monkeypatch.setattr(builtin, "LANDED_CLOSE_AFTER", 0.0)
    assert s.settle() == 0  # the file the held batches wait on is closed for shipping
    assert s.spool.wait_idle(5) and len(list((tmp_path / "spool" / "sink-0" / "closed").iterdir())) == 1
    assert s.settle() == 0  # closed, not landed
    assert shipper.ship_once() == 1
    assert s.settle() == 3 and s.stats()["acks_held"] == 0
    s.record_batch(items(0, 10), batch_body(0, 10))  # a replay: its first copies landed
    assert s.settle() == 1 and s.duplicates == 10
    s.close()


def test_a_restarted_sink_acking_once_landed_holds_the_replays_of_what_its_spool_still_has(tmp_path: Path, monkeypatch) -> None:
    from agent.operators import builtin
    from agent.spill.shipper import PathShipper
    from agent.spill.spool import SpoolDirs

    monkeypatch.setattr(builtin, "LAND_CHECK", 0.0)
    s = sink(tmp_path, ack="landed")
    s.record_batch(items(0, 10), batch_body(0, 10))
    s.close()  # its batch never acked: the predecessor replays it to the next incarnation
    s = sink(tmp_path, ack="landed")
    assert s.hold.unlanded() and s.settle() == 0
    s.record_batch(items(0, 10), batch_body(0, 10))  # the replay: duplicates of a file not landed
    assert s.settle() == 0 and s.duplicates == 10
    PathShipper(SpoolDirs(tmp_path / "spool", "n1"), tmp_path / "landing").ship_once()
    assert s.settle() == 1
    s.close()
    s = sink(tmp_path, ack="landed")  # nothing left in the spool: nothing to wait for
    assert s.hold.unlanded() == []
    s.record_batch(items(0, 10), batch_body(0, 10))
    assert s.settle() == 1
    s.close()


def test_the_agents_spill_ack_reaches_its_sink_workers(tmp_path: Path) -> None:
    """`[spill] ack` in agent.toml -> AgentSpill -> a local worker's `extra["spill"]["ack"]`."""
    import dataclasses

    from agent.config import load_agent_config
    from agent.spill.local import AgentSpill

    toml = tmp_path / "agent.toml"
    toml.write_text(f'[agent]\nnode = "n1"\n[spill]\nenabled = true\nspool_dir = "{tmp_path / "spool"}"\n'
                    f'ship = "path"\nship_path = "{tmp_path / "landing"}"\nack = "landed"\n')
    cfg = load_agent_config(toml)
    assert cfg.spill.ack == "landed"
    toml.write_text(toml.read_text().replace('ack = "landed"\n', ""))
    assert load_agent_config(toml).spill.ack == "written"  # the default

    @dataclasses.dataclass(frozen=True)
    class Spec:
        extra: dict

    agent = AgentSpill(cfg)
    try:
        assert agent.with_spill(Spec({"spill": {"ack": "written"}})).extra["spill"]["ack"] == "landed"
    finally:
        agent.close()
