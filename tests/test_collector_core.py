"""Shipper core and collector core over a fake lossy link (no broker): exactly once, no corruption.

The link loses, duplicates, reorders and damages messages in both directions; time is virtual.
Whatever it does, every file must land exactly once with its original bytes, and a damaged chunk
must never reach the landing zone.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from agent.collector.core import CollectorCore
from agent.spill.landing import CorruptFile, LandingZone
from agent.spill.shipping import (
    Ack,
    FileMeta,
    ShipperCore,
    decode_chunk,
    encode_chunk,
)
from agent.spill.spool import Spool, file_id, read_records


def make_files(tmp: Path, n_records: int = 3000, seed: int = 1) -> Dict[str, Tuple[FileMeta, bytes]]:
    rng = random.Random(seed)
    s = Spool(tmp / "spool", "n1", rotate_bytes=6000, sync_bytes=2000)
    for i in range(n_records):
        s.append("records", {"record_id": i, "v": rng.getrandbits(48)})
        if i % 50 == 0:
            s.append("metrics", {"t": i})
    s.close()
    out = {}
    for f in s.closed_files():
        data = f.path.read_bytes()
        meta = FileMeta(file_id(data), f.name, f.kind, f.node, f.date, len(data))
        out[meta.file_id] = (meta, data)
    return out


def flip(payload: bytes, rng: random.Random) -> bytes:
    head, _, body = payload.partition(b"\n")
    if not body:
        return payload
    i = rng.randrange(len(body))
    return head + b"\n" + body[:i] + bytes([body[i] ^ 0x5A]) + body[i + 1:]


def run_link(files, landing: LandingZone, seed: int, loss: float, dup: float, corrupt: float,
             reorder: bool) -> Tuple[ShipperCore, CollectorCore]:
    rng = random.Random(seed)
    ship = ShipperCore("c", "n1", chunk_bytes=1500, ack_timeout=2.0, max_backoff=8.0, window=3)
    coll = CollectorCore("c", landing.land, landing.contains)
    for fid, (meta, data) in files.items():
        ship.add(meta, data, token=fid)
    acked: List[str] = []
    now = 0.0
    while ship.pending and now < 5000:
        to_coll = []
        for out in ship.poll(now):
            if rng.random() < loss:
                continue
            p = flip(out.payload, rng) if rng.random() < corrupt else out.payload
            to_coll.extend([p] * (2 if rng.random() < dup else 1))
        if reorder:
            rng.shuffle(to_coll)
        replies = []
        for p in to_coll:
            replies.extend(coll.on_chunk(p, now))
        if reorder:
            rng.shuffle(replies)
        for r in replies:
            if rng.random() < loss:
                continue
            assert r.topic == "fog/c/spill/n1/ack"
            token = ship.on_ack(Ack.decode(r.ack.encode()), now)
            if token is not None:
                acked.append(token)
        now += 0.5
    assert sorted(acked) == sorted(files), "some file was never acknowledged"
    assert len(acked) == len(set(acked))
    return ship, coll


def check_landing(landing: LandingZone, files) -> None:
    landed = list(landing.files())
    names = [p.name for p in landed]
    assert len(names) == len(set(names)) == len(files), "duplicate or missing landed file"
    for p in landed:
        data = p.read_bytes()
        fid = p.name.split(".")[0]
        assert file_id(data) == fid and data == files[fid][1]
        meta = files[fid][0]
        assert p.parent == landing.root / f"kind={meta.kind}" / f"date={meta.date}" / f"node={meta.node}"
    ledger = [json.loads(line)["file_id"] for line in landing.ledger.read_text().splitlines()]
    assert sorted(ledger) == sorted(files)


@pytest.mark.parametrize("seed", range(6))
def test_lossy_duplicating_reordering_corrupting_link_lands_every_file_once(tmp_path: Path, seed: int) -> None:
    files = make_files(tmp_path, seed=seed)
    assert len(files) >= 5 and any(-(-m.size // 1500) > 1 for m, _ in files.values())
    landing = LandingZone(tmp_path / "landing")
    ship, coll = run_link(files, landing, seed, loss=0.15, dup=0.2, corrupt=0.1, reorder=True)
    check_landing(landing, files)
    assert coll.stats["corrupt_chunks"] > 0 and ship.stats["nacks"] > 0
    total = sum(len(read_records(d)) for _, d in files.values())
    assert coll.stats["records_landed"] == total


def test_corrupted_chunk_is_nacked_and_never_landed(tmp_path: Path) -> None:
    files = make_files(tmp_path, n_records=400)
    meta, data = next(iter(files.values()))
    landing = LandingZone(tmp_path / "landing")
    ship = ShipperCore("c", "n1", chunk_bytes=500)
    coll = CollectorCore("c", landing.land, landing.contains)
    ship.add(meta, data, "tok")
    outs = ship.poll(0.0)
    assert len(outs) > 1
    bad = flip(outs[1].payload, random.Random(0))
    replies = []
    for o in outs:
        replies.extend(coll.on_chunk(bad if o is outs[1] else o.payload, 0.0))
    assert [r.ack.status for r in replies] == ["nack"]
    assert replies[0].ack.missing == (1,)
    assert list(landing.files()) == [] and coll.missing(meta.file_id) == (1,)
    assert ship.on_ack(replies[0].ack, 0.1) is None
    resend = ship.poll(0.2)
    assert [o.index for o in resend] == [1]  # only the damaged chunk travels again
    (reply,) = coll.on_chunk(resend[0].payload, 0.3)
    assert reply.ack.status == "landed"
    assert ship.on_ack(reply.ack, 0.4) == "tok"
    (landed,) = landing.files()
    assert landed.read_bytes() == data


def test_chunk_with_forged_checksum_fails_the_whole_file_check(tmp_path: Path) -> None:
    """Damage that also rewrote the chunk checksum: the file id check catches it; nothing lands."""
    files = make_files(tmp_path, n_records=200)
    meta, data = next(iter(files.values()))
    landing = LandingZone(tmp_path / "landing")
    coll = CollectorCore("c", landing.land, landing.contains)
    ship = ShipperCore("c", "n1", chunk_bytes=10_000_000)
    ship.add(meta, data)
    (out,) = ship.poll(0.0)
    header, body = decode_chunk(out.payload)
    body = body[:-1] + bytes([body[-1] ^ 1])
    forged = type(header)(**{**header.__dict__, "sha256": hashlib.sha256(body).hexdigest()})
    (reply,) = coll.on_chunk(encode_chunk(forged, body), 0.0)
    assert reply.ack.status == "nack" and reply.ack.missing == ()
    assert list(landing.files()) == [] and coll.stats["corrupt_files"] == 1


def test_landing_refuses_a_file_that_is_not_gzip_json(tmp_path: Path) -> None:
    landing = LandingZone(tmp_path)
    data = b"definitely not gzip"
    meta = FileMeta(file_id(data), "records+n1+2026-01-01+0000000001.jsonl.gz", "records", "n1",
                    "2026-01-01", len(data))
    with pytest.raises(CorruptFile, match="gzip"):
        landing.land(meta, data)
    assert list(landing.files()) == []
    with pytest.raises(CorruptFile, match="invalid kind"):
        landing.land(FileMeta(meta.file_id, meta.name, "../x", "n1", "2026-01-01", len(data)), data)


def test_unparseable_header_is_counted_not_fatal(tmp_path: Path) -> None:
    landing = LandingZone(tmp_path)
    coll = CollectorCore("c", landing.land, landing.contains)
    assert coll.on_chunk(b"garbage without newline", 0.0) == []
    assert coll.on_chunk(b'{"v": 99}\nbody', 0.0) == []
    assert coll.stats["bad_headers"] == 2


def test_header_naming_another_node_than_the_topic_is_dropped(tmp_path: Path) -> None:
    """The sender is the node of the chunk's topic (the broker's ACL proves it), not the header's."""
    files = make_files(tmp_path, n_records=50)
    meta, data = next(iter(files.values()))
    landing = LandingZone(tmp_path / "landing")
    coll = CollectorCore("c", landing.land, landing.contains)
    ship = ShipperCore("c", meta.node, chunk_bytes=10_000_000)
    ship.add(meta, data)
    (out,) = ship.poll(0.0)
    header, body = decode_chunk(out.payload)
    odd = type(header)(**{**header.__dict__, "node": 5})  # not even a string: dropped, no exception
    assert coll.on_chunk(out.payload, 0.0, sender="someone-else") == []
    assert coll.on_chunk(encode_chunk(odd, body), 0.0, sender=meta.node) == []
    assert coll.stats["forged_senders"] == 2 and list(landing.files()) == []
    (reply,) = coll.on_chunk(out.payload, 0.0, sender=meta.node)
    assert reply.ack.status == "landed" and reply.topic == f"fog/c/spill/{meta.node}/ack"


def test_collector_loop_skips_what_is_no_chunk_of_its_cluster(tmp_path: Path) -> None:
    """Bus input never ends the collector's loop: another topic, a retained chunk, a header that
    breaks the core -- each counted and skipped (no client needed: nothing is answered)."""
    from agent.collector.service import Collector

    coll = Collector("c", str(tmp_path / "landing"))
    coll._handle("fog/c/inbox/x", b"{}", False, 0.0)
    coll._handle("fog/other/spill/n1/chunk", b"{}", False, 0.0)
    coll._handle("fog/c/spill/n1/chunk", b'{"v": 1}\nbody', True, 0.0)  # retained
    assert coll.bad_messages == 3 and coll.core.stats["chunks"] == 0
    coll._handle("fog/c/spill/n1/chunk", b'{"v": 1, "node": "n1"}\nbody', False, 0.0)
    assert coll.core.stats["bad_headers"] == 1
    body = b"body"
    odd = {"v": 1, "file_id": [0] * 64, "name": "x", "kind": "records", "node": "n1", "date": "2026-01-01",
           "size": 4, "index": 0, "count": 1, "sha256": hashlib.sha256(body).hexdigest()}
    coll._handle("fog/c/spill/n1/chunk", json.dumps(odd).encode() + b"\n" + body, False, 0.0)
    assert coll.bad_messages == 4  # the core raised (a list is no file id); the loop goes on
