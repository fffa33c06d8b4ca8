"""The keyed state of a drain hand-over in chunks (agent.node.statexfer): a state of several MB
crosses as requests the agents' own codec accepts (each under wire.MAX_CONTROL_BYTES), is put
back together byte for byte, and whatever a hostile or broken sender does is refused with a
reason before it is decoded or kept; a state over the bound is refused naming its size."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from agent import wire
from agent.instance.keyed_state import KeyedState
from agent.node import rpc, statexfer
from agent.node.statexfer import CHUNK_BYTES, MAX_STATE_BYTES, Manifest, Staging, chunk_bodies, check_keyed
from agent.operators.builtin import OperatorContext
from agent.operators.keyed import keyed_count


def big_state(tmp_path: Path, keys: int) -> bytes:
    """A saved keyed count of `keys` keys, read back as the draining agent ships it."""
    ks = KeyedState(keyed_count.build(OperatorContext("c-0", "c", "n", "map", params={})), "c", "k", 128)
    ks.apply("src", [("src", i, {"k": f"key-{i:07d}-{'x' * 40}"}) for i in range(keys)], 1)
    ks.prune_outputs(None)
    ks.save(tmp_path / "c-0.keyed.json")
    ks.apply("src", [("src", keys, {"k": "late"})], 2)  # a change only in the log
    ks.save(tmp_path / "c-0.keyed.json")
    data = statexfer.snapshot_bytes(tmp_path / "c-0.keyed.json")
    assert data is not None
    return data


def test_a_state_of_megabytes_crosses_in_chunks_the_codec_accepts_and_is_restored_whole(tmp_path: Path) -> None:
    data = big_state(tmp_path, 12_000)
    assert len(data) > 10 * CHUNK_BYTES  # ~1.5 MB: a dozen chunks
    manifest, bodies = chunk_bodies("c-0", "t1", data)
    assert len(bodies) == manifest.chunks == -(-len(data) // CHUNK_BYTES) > 3
    staging = Staging()
    for body in reversed(bodies):  # any order
        raw = rpc.encode(body)
        assert len(raw) < wire.MAX_CONTROL_BYTES  # what the receiving agent's rpc.decode_request admits
        staging.add("h2", rpc.decode_request(raw), now=0.0)
    got = staging.take("h2", "c-0", manifest.to_json())
    assert got == data
    doc = check_keyed(got, "c", 128)
    restored = KeyedState(keyed_count.build(OperatorContext("c-0", "c", "n", "map", params={})), "c", "k", 128)
    restored.restore(doc)
    assert sum(len(v) for v in restored.states.values()) == 12_001  # the log's key too
    assert restored.applied["src"].add(12_000) is False  # applied there: a replay is skipped here
    with pytest.raises(ValueError, match="no keyed state staged"):
        staging.take("h2", "c-0", manifest.to_json())  # taken once


def test_an_incomplete_a_corrupted_or_a_foreign_transfer_is_refused(tmp_path: Path) -> None:
    data = big_state(tmp_path, 8000)
    manifest, bodies = chunk_bodies("c-0", "t1", data)
    assert len(bodies) >= 2
    staging = Staging()
    for b in bodies[1:]:
        staging.add("h2", b, 0.0)
    with pytest.raises(ValueError, match=f"incomplete: {len(bodies) - 1} of {len(bodies)}"):
        staging.take("h2", "c-0", manifest.to_json())
    # a chunk from another node does not complete h2's transfer (nor h2's chunks h3's)
    staging.add("h3", bodies[0], 0.0)
    with pytest.raises(ValueError, match=f"incomplete: 1 of {len(bodies)} chunks from h3"):
        staging.take("h3", "c-0", manifest.to_json())
    with pytest.raises(ValueError, match="no keyed state staged from h2"):
        staging.take("h2", "c-0", manifest.to_json())  # refused above: dropped, not kept
    for b in bodies:
        staging.add("h2", b, 0.0)
    assert staging.take("h2", "c-0", manifest.to_json()) == data
    # a chunk whose bytes were changed (same length): the SHA-256 catches it
    flipped = dict(bodies[0], data=base64.b64encode(b"\0" * CHUNK_BYTES).decode())
    for b in [flipped] + bodies[1:]:
        staging.add("h2", b, 0.0)
    with pytest.raises(ValueError, match="SHA-256"):
        staging.take("h2", "c-0", manifest.to_json())
    # a new transfer for the same instance (the hand-over tried again) replaces the older one
    staging.add("h2", bodies[0], 0.0)
    again, bodies2 = chunk_bodies("c-0", "t2", data[:-1])
    for b in bodies2:
        staging.add("h2", b, 1.0)
    assert staging.take("h2", "c-0", again.to_json()) == data[:-1]
    # left incomplete: gone after STAGE_TTL
    staging.add("h2", bodies[0], 0.0)
    staging.expire(statexfer.STAGE_TTL + 1.0)
    assert staging.staged_bytes() == 0


def test_hostile_chunks_are_refused_before_they_are_decoded_or_kept() -> None:
    data = (b"0123456789abcdef" * (CHUNK_BYTES // 16 + 1))[:CHUNK_BYTES + 10]
    manifest, bodies = chunk_bodies("c-0", "t1", data)
    good = bodies[1]
    staging = Staging(max_bytes=3 * CHUNK_BYTES)
    bad = [
        (dict(good, index=2), "'index' must be an integer in 0..1"),
        (dict(good, index=True), "'index'"),
        (dict(good, data=good["data"] + "AAAA"), "must be 10 bytes in base64"),
        (dict(good, data="!" * len(good["data"])), "not base64"),
        (dict(good, instance="../b"), "invalid topic segment"),  # never a path
        (dict(good, manifest=dict(manifest.to_json(), bytes=MAX_STATE_BYTES + 1)), f"1..{MAX_STATE_BYTES}"),
        (dict(good, manifest=dict(manifest.to_json(), chunks=1)), "'chunks' must be 2"),
        (dict(good, manifest=dict(manifest.to_json(), sha256="A" * 64)), "64 lowercase hex"),
        (dict(good, manifest=dict(manifest.to_json(), transfer="../../etc")), "transfer"),
    ]
    for body, why in bad:
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(".", r"\.")):
            staging.add("h2", body, 0.0)
    # the staging bound: a second transfer that would exceed it is refused
    staging = Staging(max_bytes=3 * CHUNK_BYTES)
    staging.add("h2", bodies[0], 0.0)
    other, more = chunk_bodies("d-0", "t2", data + data)
    with pytest.raises(ValueError, match="would exceed"):
        staging.add("h2", more[0], 0.0)


def test_the_shipped_state_is_checked_against_the_spec(tmp_path: Path) -> None:
    data = big_state(tmp_path, 10)
    assert check_keyed(data, "c", 128)["format"] == 2
    with pytest.raises(ValueError, match="operator 'c', the spec's is 'd'"):
        check_keyed(data, "d", 128)
    with pytest.raises(ValueError, match="with 128 key groups, the pipeline says 64"):
        check_keyed(data, "c", 64)
    with pytest.raises(ValueError, match="nested deeper"):
        check_keyed(b"[" * 100 + b"]" * 100, "c", 128)
    with pytest.raises(ValueError, match="expected a JSON object"):
        check_keyed(b"[1]", "c", 128)
    with pytest.raises(ValueError, match="format"):
        check_keyed(json.dumps({"operator": "c", "format": 9, "key_groups": 128}).encode(), "c", 128)


def test_a_state_over_the_bound_is_refused_naming_its_size_and_the_limit() -> None:
    assert statexfer.too_large(MAX_STATE_BYTES) is None
    why = statexfer.too_large(MAX_STATE_BYTES + 1)
    assert why and str(MAX_STATE_BYTES + 1) in why and str(MAX_STATE_BYTES) in why
    with pytest.raises(ValueError):
        Manifest.from_json({"transfer": "t", "bytes": MAX_STATE_BYTES + 1, "sha256": "0" * 64, "chunks": 1})


KEYED_PIPELINE = """
[pipeline]
name = "p"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
key = "medallion"
[[operator]]
name = "c"
function = "agent.operators.keyed:keyed_count"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def test_the_worker_installs_the_shipped_keyed_state_unless_a_later_incarnation_left_one(tmp_path: Path) -> None:
    """`Worker._take_handover`: the keyed state its agent staged replaces the keyed snapshot here
    and its log (a leftover of an earlier stay), together with the shipped instance state; a
    state file of a later incarnation here (a crash restart after the hand-over) wins, and the
    staged file is dropped. No broker: the worker is only constructed."""
    import os

    from agent.instance.spec import InstanceSpec
    from agent.instance.shell import Worker
    from agent.mqtt.settings import BrokerSpec
    from memory_wire import MemoryWire

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    shipped = big_state(tmp_path, 30)
    manifest, _ = chunk_bodies("p.c.0", "t1", shipped)
    spec = InstanceSpec("p.c.0", "c", "me", "cl", "p", KEYED_PIPELINE, BrokerSpec("h", 1), keeper=True, restart=True,
                        state_dir=str(state_dir), succs=("p.sink.0",), preds=("p.source.0",),
                        extra={"handover_state": {"epoch": 4, "inbound": {}}, "handover_keyed": manifest.to_json()})
    keyed, staged = state_dir / "p.c.0.keyed.json", state_dir / "p.c.0.keyed.handover"
    log_path = state_dir / "p.c.0.keyed.json.log"

    def construct() -> None:
        w = Worker(spec, out=open(os.devnull, "w"), transport=MemoryWire())  # type: ignore[arg-type]
        os.close(w._identity_lock)

    keyed.write_text('{"format": 2, "gen": 7, "operator": "c", "key_groups": 128}')  # an earlier stay here
    log_path.write_text('{"gen": 7}\n')
    staged.write_bytes(shipped)
    construct()
    assert keyed.read_bytes() == shipped and not log_path.exists() and not staged.exists()
    assert json.loads((state_dir / "p.c.0.state.json").read_text())["epoch"] == 4
    (state_dir / "p.c.0.state.json").write_text(json.dumps({"epoch": 9, "inbound": {}}))  # a later incarnation
    keyed.write_text("later")
    staged.write_bytes(shipped)
    construct()
    assert keyed.read_text() == "later" and not staged.exists()
