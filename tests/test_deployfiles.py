"""An instance's files belong to one deploy of its pipeline (agent.instance.deployfiles): a
namesake of an earlier deploy never reads them. No broker: files in tmp_path, workers only
constructed (and begun on an in-memory wire)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict

from agent.instance import deployfiles
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from pipelines import with_work

PIPELINE = with_work("agent.operators.builtin:identity")

TERMINATED = {"epoch": 3, "inbound": {}, "scaling": {
    "instance_id": "work-0a1b2c3d4e5f", "operator": "work", "stage": 1, "keeper": False, "creator": "p.work.0",
    "deletion_mode": "two_phase", "state": "terminated", "succs": ["p.sink.0"], "preds": ["p.source.0"],
    "succs_to_add": [], "succs_to_delete": [], "preds_to_add": [], "preds_to_delete": [], "round": 2, "pending": [],
    "new_siblings": [], "unsure": {}, "gone": [], "leavers": {}, "acked": []},
    "outputs": [], "rounds_applied": {}, "round_created": []}


def leave(dirs: Dict[str, Path], instance: str, generation: str) -> None:
    """What an instance of deploy `generation` leaves on its node."""
    for name in deployfiles.STATE_FILES:
        (dirs["state"] / f"{instance}.{name}").write_text("{}")
    for name in deployfiles.SINK_FILES:
        (dirs["sink"] / f"{instance}.{name}").write_text("p.source.0 1\n")
    closed = dirs["spill"] / instance / "closed"
    closed.mkdir(parents=True)
    (closed / "records+n1+2026-12-05+0000000001.jsonl.gz").write_bytes(b"x")
    (dirs["state"] / f"{instance}.generation").write_text(generation + "\n")


def make_dirs(tmp_path: Path) -> Dict[str, Path]:
    dirs = {k: tmp_path / k for k in ("state", "sink", "spill")}
    for d in dirs.values():
        d.mkdir()
    return dirs


def claim(dirs: Dict[str, Path], instance: str, generation: str) -> Any:
    return deployfiles.claim(instance, generation, dirs["state"], dirs["sink"], dirs["spill"])


def test_a_namesakes_files_from_another_deploy_are_put_away_and_its_spool_still_ships(tmp_path: Path) -> None:
    dirs = make_dirs(tmp_path)
    leave(dirs, "p.sink.0", "18f0a-aaaaaa")
    assert claim(dirs, "p.sink.0", "18f0b-bbbbbb") == "18f0a-aaaaaa"
    left = sorted(p.name for d in (dirs["state"], dirs["sink"]) for p in d.iterdir())
    assert left == ["p.sink.0.generation"], left
    assert (dirs["state"] / "p.sink.0.generation").read_text() == "18f0b-bbbbbb\n"
    assert not (dirs["spill"] / "p.sink.0").exists()
    # the old spool keeps its records and stays where the shipper looks (SpoolDirs: every */closed)
    from agent.spill.spool import SpoolDirs

    assert [f.path.parent.parent.name for f in SpoolDirs(dirs["spill"], "n1").closed_files()] == \
        ["p.sink.0~18f0a-aaaaaa"]


def test_the_agent_may_claim_before_the_worker_made_the_state_directory(tmp_path: Path) -> None:
    assert deployfiles.claim("p.sink.0", "18f0a-aaaaaa", tmp_path / "new" / "state", tmp_path / "sink") is None
    assert (tmp_path / "new" / "state" / "p.sink.0.generation").read_text() == "18f0a-aaaaaa\n"


def test_the_same_deploy_and_unstamped_files_are_kept(tmp_path: Path) -> None:
    dirs = make_dirs(tmp_path)
    leave(dirs, "p.sink.0", "18f0a-aaaaaa")
    before = sorted(p.name for d in dirs.values() for p in d.rglob("*"))
    assert claim(dirs, "p.sink.0", "18f0a-aaaaaa") is None  # a crash restart of the same deploy
    (dirs["state"] / "p.sink.0.generation").unlink()  # files from before the stamps (an upgraded agent)
    assert claim(dirs, "p.sink.0", "18f0b-bbbbbb") is None
    assert sorted(p.name for d in dirs.values() for p in d.rglob("*")) == before
    assert (dirs["state"] / "p.sink.0.generation").read_text() == "18f0b-bbbbbb\n"


def test_a_generation_that_is_no_plain_name_touches_nothing(tmp_path: Path) -> None:
    """The generation comes with a spec from the bus and ends up in a directory name."""
    dirs = make_dirs(tmp_path)
    leave(dirs, "p.sink.0", "18f0a-aaaaaa")
    before = {p: p.read_bytes() for d in dirs.values() for p in d.rglob("*") if p.is_file()}
    for hostile in ("../../etc", "a/b", "", "x" * 65, "a b"):
        assert claim(dirs, "p.sink.0", hostile) is None
    (dirs["state"] / "p.sink.0.generation").write_text("../../../tmp/x\n")  # a stamp no deploy wrote
    assert claim(dirs, "p.sink.0", "18f0b-bbbbbb") is None
    assert (dirs["spill"] / "p.sink.0" / "closed").is_dir()
    assert {p: p.read_bytes() for p in before if p.name != "p.sink.0.generation"} == \
        {p: b for p, b in before.items() if p.name != "p.sink.0.generation"}


def spec(dirs: Dict[str, Path], instance: str, operator: str, generation: str, **kw: Any) -> InstanceSpec:
    extra = {"generation": generation, "sink_dir": str(dirs["sink"]), "spill": {"dir": str(dirs["spill"])}}
    return InstanceSpec(instance, operator, "n1", "cl", "p", PIPELINE, BrokerSpec("h", 1), state_dir=str(dirs["state"]),
                        extra={**extra, **kw.pop("extra", {})}, **kw)


def worker(s: InstanceSpec) -> Any:
    from agent.instance.shell import Worker
    from memory_wire import MemoryWire

    return Worker(s, out=open(os.devnull, "w"), transport=MemoryWire())  # type: ignore[arg-type]


def test_a_redeployed_sink_does_not_take_the_old_deploys_ids_as_seen(tmp_path: Path) -> None:
    """Record ids repeat across deploys of a replayable source: the old ids file made the new
    sink drop every record it had ids for."""
    dirs = make_dirs(tmp_path)
    (dirs["sink"] / "p.sink.0.ids").write_text("".join(f"p.source.0 {i}\n" for i in range(100)))
    (dirs["state"] / "p.sink.0.generation").write_text("18f0a-aaaaaa\n")
    w = worker(spec(dirs, "p.sink.0", "sink", "18f0b-bbbbbb", keeper=True, preds=("p.work.0",)))
    assert w.operator.seen == {}
    w2 = worker(spec(dirs, "p.sink.1", "sink", "", keeper=True, preds=("p.work.0",)))  # no generation: as before
    assert w2.operator.seen == {}


def test_a_copy_rehomed_where_its_namesake_terminated_starts_instead_of_leaving(tmp_path: Path) -> None:
    """Copy ids repeat across deploys (creator, incarnation, round): a copy re-homed onto a node
    where its namesake of the last deploy had terminated took that state and exited at start
    ("restarted after its termination"), and its predecessors' records to it were never acked."""
    dirs = make_dirs(tmp_path)
    (dirs["state"] / "work-0a1b2c3d4e5f.state.json").write_text(json.dumps(TERMINATED))
    (dirs["state"] / "work-0a1b2c3d4e5f.generation").write_text("18f0a-aaaaaa\n")
    s = spec(dirs, "work-0a1b2c3d4e5f", "work", "18f0b-bbbbbb", restart=True, active=False,
             preds=("p.work.0",), extra={"creator": "p.work.0", "min_epoch": 1_800_000_000})
    w = worker(s)
    w.begin()
    assert w.core.life.exit is None and not w.core.scaling.terminated
    os.close(w._identity_lock)  # as its process would at exit
    # the same files stamped with its own deploy: a crash restart after its termination leaves
    (dirs["state"] / "work-0a1b2c3d4e5f.state.json").write_text(json.dumps(TERMINATED))
    (dirs["state"] / "work-0a1b2c3d4e5f.generation").write_text("18f0b-bbbbbb\n")
    w = worker(s)
    w.begin()
    assert w.core.life.exit is not None and "gone for good" in w.core.life.exit[1]
