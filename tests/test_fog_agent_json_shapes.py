"""The `--json` shapes of `fog-agent`'s commands (agent/cli/schemas.py, lab/foglab/cli/schemas.py)
against what the commands print.

Every command of `fog-agent` with a `--json` option has a schema (found by walking the parser),
`fog-agent schema` prints them, and docs/measurement.md's section "JSON output" is what the
schemas generate. Each schema is then checked on a document its command built:

- real output, of the command itself or of the function that builds its document, with small
  arguments: `calibrate`, the simulators and checkers, `bench fuzz|spill|gme|gme-check|spawn|
  handover|dataplane`, `bench fleet` on the recorded runs in benchmarks/fleet/, `dev up|status|down`
  on a dev fleet of one agent;
- the command's own code building its document from fakes or recorded results where a real run
  takes minutes (each test says which): `demo` and `bench rescale` (their fleet and monitor faked),
  `bench keyed|move|policies|analytics` (their measurement step), `chaos` and the testbed's commands
  (their run function; the result objects are the tools' own dataclasses where they have them).

As tests/test_json_shapes.py does for fogctl, every required key of every document seen is then
removed once, and a wrong type put in, and the schema must refuse the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Dict, Iterator, List, Set, Tuple

import pytest
from jsonschema import Draft202012Validator

from agent.cli import main as cli
from agent.cli import schemas
from agent_process import CHECKOUT_PATH
from test_json_shapes import _mutations, fits

ROOT = Path(__file__).resolve().parent.parent

SEEN: Dict[str, List[Any]] = {}


def valid(name: str, doc: Any) -> Any:
    """Assert `doc` fits fog-agent's schema `name` (every error listed), remember it, return it."""
    return fits(schemas.schema(name), name, doc, SEEN)


def fog_agent(capsys: pytest.CaptureFixture, *argv: str) -> Tuple[int, Any]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else None)


def json_commands(parser: argparse.ArgumentParser, path: Tuple[str, ...] = ()) -> Set[str]:
    """The commands under `parser` that take `--json`, named as typed ("dev status")."""
    found: Set[str] = set()
    if any("--json" in a.option_strings for a in parser._actions):
        found.add(" ".join(path))
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= json_commands(sub, path + (name,))
    return found


# ---- the schemas, the command that prints them, the docs --------------------------------------


def test_every_schema_is_valid_and_every_json_command_has_one() -> None:
    known = schemas.all_schemas()
    for name, s in known.items():
        Draft202012Validator.check_schema(s)
        assert s["$schema"] == schemas.DIALECT and s["title"], name
    # chaos --testbed prints another document than chaos; error is check-config's and deploy's
    assert set(known) == json_commands(cli.build_parser()) | {"chaos --testbed", "error"}


def test_without_the_lab_only_the_nodes_schemas_are_listed(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    for name in [n for n in sys.modules if n == "foglab" or n.startswith("foglab.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "foglab", None)
    assert set(schemas.all_schemas()) == set(schemas.SCHEMAS) == json_commands(cli.build_parser()) | {"error"}
    assert fog_agent(capsys, "schema", "dev", "up")[0] == 1


def test_fog_agent_schema_prints_them(capsys: pytest.CaptureFixture) -> None:
    assert fog_agent(capsys, "schema", "calibrate") == (0, schemas.SCHEMAS["calibrate"])
    assert fog_agent(capsys, "schema", "dev", "status") == (0, schemas.all_schemas()["dev status"])
    assert fog_agent(capsys, "schema", "check-config")[1] == schemas.FOGCTL_SCHEMAS["check-config"]
    assert fog_agent(capsys, "schema") == (0, schemas.all_schemas())
    capsys.readouterr()
    assert cli.main(["schema", "nope"]) == 1
    assert "no JSON schema for 'nope'" in capsys.readouterr().err


def test_the_docs_section_is_generated_from_the_schemas() -> None:
    text = (ROOT / "docs" / "measurement.md").read_text()
    begin, end = "<!-- fog-agent-json-shapes: begin", "<!-- fog-agent-json-shapes: end -->"
    assert begin in text and end in text
    section = text.split(begin, 1)[1].split("-->", 1)[1].split(end, 1)[0]
    assert section.strip() == schemas.markdown(schemas.documented()).strip(), \
        "docs/measurement.md is out of date: paste the output of `python -m agent.cli.schemas` between the markers"


# ---- real output -----------------------------------------------------------------------------------


def test_calibrate(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    base = ["calibrate", "--pipeline", str(ROOT / "examples" / "pipeline.toml"), "--operator", "in_zone",
            "--node", "t", "--window", "0.05", "--json"]
    code, doc = fog_agent(capsys, *base, "--max-rate", "200", "--dry-run")
    assert code == 0 and valid("calibrate", doc)["saturated"] is False  # max rate reached without lag
    code, doc = fog_agent(capsys, *base, "--service-time-ms", "20", "--state-dir", str(tmp_path))
    assert code == 0 and valid("calibrate", doc)["saturated"] is True
    assert (tmp_path / "capacity.json").exists()


def test_simulators_and_checkers(capsys: pytest.CaptureFixture) -> None:
    code, doc = fog_agent(capsys, "simulate", "scaling", "--steps", "20", "--operators", "2", "--instances", "2",
                          "--json")
    assert code == 0 and valid("simulate scaling", doc)["steps"] == 20
    code, doc = fog_agent(capsys, "simulate", "gme", "--nodes", "4", "--entries", "2", "--json")
    assert code == 0 and valid("simulate gme", doc)["cs_entries"] == 8
    code, doc = fog_agent(capsys, "simulate", "gme", "--algorithm", "ra1", "--nodes", "4", "--entries", "1", "--json")
    assert code == 0 and valid("simulate gme", doc)["damping"] is None
    code, doc = fog_agent(capsys, "simulate", "instance", "--schedules", "3", "--json")
    assert code == 0 and valid("simulate instance", doc)["violation"] is None
    code, doc = fog_agent(capsys, "simulate", "instance", "--depth", "2", "--json")
    assert code == 0 and valid("simulate instance", doc)["seed"] is None
    code, doc = fog_agent(capsys, "simulate", "policies", "--seeds", "1", "--days", "0.05", "--json")
    assert code == 0 and valid("simulate policies", doc)["bound"]
    code, doc = fog_agent(capsys, "bench", "gme-check", "--groups", "1,1", "--requests", "1", "--json")
    assert code == 0 and valid("bench gme-check", doc)["verdict"] == "ok"
    code, doc = fog_agent(capsys, "bench", "gme-check", "--groups", "1,1", "--requests", "1",
                          "--fault", "skip_acks_to_ign", "--json")
    assert valid("bench gme-check", doc)["verdict"] == ("ok" if code == 0 else "violation")


def test_bench_fuzz_and_spill(capsys: pytest.CaptureFixture) -> None:
    code, doc = fog_agent(capsys, "bench", "fuzz", "--each", "3", "--json")
    assert code == 0 and valid("bench fuzz", doc)["targets"]
    code, doc = fog_agent(capsys, "bench", "spill", "--records", "200", "--reps", "1", "--json")
    assert code == 0 and valid("bench spill", doc)["records"] == 200


@pytest.mark.broker
def test_bench_gme_through_a_private_broker(capsys: pytest.CaptureFixture) -> None:
    code, doc = fog_agent(capsys, "bench", "gme", "--nodes", "4", "--entries", "2", "--think-ms", "1", "--cs-ms", "1",
                          "--json")
    assert code == 0 and valid("bench gme", doc)["timed_out"] is False


@pytest.mark.broker
def test_bench_spawn_and_handover(tmp_path: Path) -> None:
    """The functions that build the two documents, with one start and one small group (~9 s)."""
    from foglab.tools.demo import bench_spawn
    from foglab.tools.handover_bench import run_handover_bench

    assert valid("bench spawn", bench_spawn(burst=1, rounds=1, workdir=tmp_path / "spawn"))["burst"] == 1
    assert len(valid("bench handover", run_handover_bench(sizes=(1_000,), rounds=1,
                                                          workdir=str(tmp_path / "ho")))["sizes"]) == 1


@pytest.mark.broker
def test_bench_dataplane_a_short_run_and_a_failed_one(tmp_path: Path) -> None:
    """A run without the rescale and alternating parts (~13 s), and one whose broker drops (the
    partial figures and the error, ~5 s)."""
    def bench(*argv: str) -> Tuple[int, Any]:
        p = subprocess.run([sys.executable, "-m", "agent", "bench", "dataplane", "--seconds", "0.3",
                            "--rescale-cycles", "0", "--rounds", "0", "--json", *argv], capture_output=True, text=True,
                           timeout=120, cwd=str(tmp_path), env={**__import__("os").environ, "PYTHONPATH": CHECKOUT_PATH})
        return p.returncode, json.loads(p.stdout)

    code, doc = bench()
    assert code == 0 and valid("bench dataplane", doc)["pipeline"]["records_per_s"] >= 0  # 0.3 s: may be 0 here
    code, doc = bench("--raw-window", "64", "--broker-max-queued", "4", "--broker-max-inflight", "1")
    assert code == 1 and "dropped" in valid("bench dataplane", doc)["error"]


def test_bench_fleet_reports_recorded_runs(capsys: pytest.CaptureFixture) -> None:
    """`--load`: the report of earlier runs' --json output (benchmarks/fleet/), without running a fleet."""
    runs = ROOT / "benchmarks" / "fleet"
    code, doc = fog_agent(capsys, "bench", "fleet", "--load", str(runs / "n10.json"), "--load", str(runs / "n20.json"),
                          "--json")
    assert code == 0 and "extrapolated" in valid("bench fleet", doc)
    code, doc = fog_agent(capsys, "bench", "fleet", "--load", str(runs / "n10.json"), "--json")
    assert code == 0 and "model" not in valid("bench fleet", doc)


@pytest.mark.broker
def test_dev_up_status_down(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    d = str(tmp_path / "dev")
    try:
        code, doc = fog_agent(capsys, "dev", "up", "--agents", "1", "--dir", d, "--json")
        assert code == 0 and valid("dev up", doc)["state"] == "up"
        code, doc = fog_agent(capsys, "dev", "up", "--dir", d, "--json")
        assert code == 0 and valid("dev up", doc)["state"] == "already-up"
        code, doc = fog_agent(capsys, "dev", "status", "--dir", d, "--json")
        assert code == 0 and valid("dev status", doc)["nodes"][0]["status"] == "online"
    finally:
        code, doc = fog_agent(capsys, "dev", "down", "--dir", d, "--json")
    assert code == 0 and valid("dev down", doc)["stopped"] == ["n1", "broker"]
    code, doc = fog_agent(capsys, "dev", "status", "--dir", d, "--json")
    assert code == 1 and valid("dev status", doc)["state"] == "stopped"
    code, doc = fog_agent(capsys, "dev", "down", "--dir", str(tmp_path / "none"), "--json")
    assert code == 0 and valid("dev down", doc)["note"]


# ---- the command's own code on fakes or recorded results -----------------------------------------


class FakeClock:
    """time.monotonic / time.sleep / time.time for a run that would sleep for minutes."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def time(self) -> float:
        return 1.7e9 + self.now

    def perf_counter(self) -> float:
        return self.now


class FakeFleet:
    """foglab.tools.demo.Fleet without processes: nothing runs, the sink stays empty."""

    def __init__(self, workdir: Path, *a: Any, **k: Any) -> None:
        self.workdir = Path(workdir)
        self.sink_dir = self.workdir / "sink"
        self.sink_dir.mkdir(parents=True, exist_ok=True)
        self.host, self.port, self.cluster, self.procs = "127.0.0.1", 1, k.get("cluster", "demo"), {}

    def start(self) -> "FakeFleet":
        return self

    def wait_online(self, mon: Any) -> None:
        pass

    def deploy(self, text: str) -> List[Any]:
        return [types.SimpleNamespace(operator="source", node="n1")]

    def stop(self) -> Dict[str, Any]:
        return {"n1": 0, "n2": 0}


class FakeMonitor:
    """foglab.tools.demo.Monitor with what a run's end would show: two rescales, nothing moving."""

    def __init__(self, *a: Any) -> None:
        self.status, self.dropped, self.pids = {"b1": "online"}, 0, set()

    def totals(self) -> Dict[str, float]:
        from collections import defaultdict

        return defaultdict(float)

    def instances_per_operator(self) -> Dict[str, int]:
        return {"source": 1, "work": 1}

    def agent_events(self, etype: str, cause: Any = None) -> List[Any]:
        return []

    def rescale_delays(self) -> List[float]:
        return [0.41, 0.62]

    def rescale_parts(self) -> Dict[str, Any]:
        return {"round": 0.2, "first_record": 0.3}

    def rescale_by_operator(self) -> Dict[str, Any]:
        return {}

    def wait(self, pred: Any, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def faked_fleet(monkeypatch: pytest.MonkeyPatch) -> Any:
    from foglab.tools import demo

    monkeypatch.setattr(demo, "Fleet", FakeFleet)
    monkeypatch.setattr(demo, "Monitor", FakeMonitor)
    monkeypatch.setattr(demo, "time", FakeClock())
    return demo


def test_demo_summary_of_a_faked_fleet(faked_fleet: Any, tmp_path: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """run_demo's own code builds the summary; its fleet and monitor are fakes (a real demo is
    tests/test_runtime_demo.py's, minutes long): no source ran, so the sink's verdict has nothing."""
    demo = faked_fleet
    monkeypatch.setattr(demo, "plot_demo", lambda samples, operators, path: path)
    args = argparse.Namespace(pipeline=None, duration=2.0, workdir=str(tmp_path / "run"), plot=None, quiet=True,
                              json=True, no_analytics=True)
    capsys.readouterr()
    assert demo.main(args) == demo.EXIT_OK
    doc = valid("demo", json.loads(capsys.readouterr().out))
    assert doc["records_in"] == 0 and doc["decision_to_first_record_s"]["n"] == 2 and doc["samples"]


def test_bench_rescale_of_a_faked_fleet(faked_fleet: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_rescale's own code builds the result; fleet, monitor and the start -> ready runs are
    faked (a real run waits 30 s per mode)."""
    demo = faked_fleet
    monkeypatch.setattr(demo, "start_to_ready", lambda *a, **k: [0.02, 0.03])
    doc = valid("bench rescale", demo.bench_rescale(rate=100.0, workdir=tmp_path))
    assert doc["warm"]["start_to_ready_s"]["n"] == 2


def test_bench_keyed_with_its_measurements_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_keyed_bench's own code builds the result from each pipeline's figures, recorded here
    (a real run starts nine workers, ~25 s: tests/test_keyed_broker.py)."""
    from foglab.tools import keyed_bench

    figures = {"stateless_map": (52000.0, 0), "keyed_count": (31000.0, 20), "keyed_window": (29000.0, 20)}
    monkeypatch.setattr(keyed_bench, "_measure", lambda runner, broker, tmp, name, *a: {
        "records_per_s": figures[name][0], "outputs_per_s": figures[name][0] / (1 + figures[name][1]),
        "state_saves_per_s": 2.0 * bool(figures[name][1]), "state_file_bytes": 40 * figures[name][1],
        "keys_held": figures[name][1] or None})
    doc = valid("bench keyed", keyed_bench.run_keyed_bench(seconds=0.1, keys=20, workdir=str(tmp_path)))
    assert doc["keyed_count"]["ratio_vs_stateless"] == round(31000 / 52000, 3)


def test_bench_move_with_its_moves_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_move's own code builds runs and summary; each move (a fleet of three agents) is a
    recorded result of move_once."""
    from foglab.tools import move_bench

    def move_once(workdir: Path, per_node: bool, kind: str, rate: float) -> Dict[str, Any]:
        return {"per_node": per_node, "kind": kind, "first_downstream_s": {"src": 0.8, "mid": None, "snk": 1.1},
                "moved_to": {"src": "m2", "mid": "m3", "snk": "m2"}, "new_topics": {}, "kept": {}, "tail_s": 2.0,
                "generated": 1200, "lost": 0, "duplicated": 0, "unexpected": 0}

    monkeypatch.setattr(move_bench, "move_once", move_once)
    doc = valid("bench move", move_bench.bench_move(1, ("drain", "rehome"), 200.0, tmp_path))
    assert doc["summary"]["drain/per_node"]["all_moved_s_median"] == 1.1


def test_bench_policies_with_the_live_runs_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    """The command and compare() as they are, the simulated rows real; each live run (a fleet of
    three agents for minutes) a recorded row of run_live's keys."""
    from foglab.tools import policies_bench

    def run_live(policy: str, trace: Any, workdir: Path, *a: Any, consolidate: Any = None) -> Dict[str, Any]:
        return {"policy": policy, "mode": "live", "consolidation": consolidate is not None, "accuracy_u": 0.1,
                "instance_ops": 6, "decisions": 40, "records_generated": 9000, "records_lost": 0,
                "records_duplicated": 0, "drain_s": 1.5, "node_minutes": 4.2, "node_minutes_packed": 3.1,
                "nodes_released": 0, "nodes_acquired": 0, "site_actions": [], "records_deferred": 0,
                "deferred_share": 0.0, "latency_s": 0.2, "series": {"t": [0.0], "supply": [1], "demand": [1],
                                                                     "powered": [3]}}

    monkeypatch.setattr(policies_bench, "run_live", run_live)
    code, doc = fog_agent(capsys, "bench", "policies", "--policies", "threshold", "--minutes", "0.2",
                          "--consolidation", "both", "--workdir", str(tmp_path), "--json")
    assert code == 0 and [r["mode"] for r in valid("bench policies", doc)["rows"]] == ["simulated", "live", "live"]


def test_bench_analytics_with_its_spark_job_faked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    """The command's own code builds the result; the Spark session, the synthetic landing zone and
    the job are fakes (a real run starts a JVM and writes millions of records)."""
    from agent.analytics import job, synth

    spark = types.SimpleNamespace(sparkContext=types.SimpleNamespace(defaultParallelism=2), stop=lambda: None)
    monkeypatch.setattr(job, "build_session", lambda master, driver_memory: spark)
    monkeypatch.setattr(job, "run_job", lambda spark, landing, out: out / "report.json")

    def landing(spark: Any, path: Path, records: int, seed: int) -> None:
        path.mkdir(parents=True)
        (path / "part-0.jsonl.gz").write_bytes(b"\x1f\x8b")

    monkeypatch.setattr(synth, "write_synthetic_landing", landing)
    code, doc = fog_agent(capsys, "bench", "analytics", "--records", "1000", "--workdir", str(tmp_path), "--json")
    assert code == 0 and valid("bench analytics", doc)["landing_bytes"] == 2


CHAOS_SUMMARY: Dict[str, Any] = {  # what run_chaos prints for a demo-pipeline run, one fault
    "seed": 3, "duration": 30.0, "min_faults": 0, "min_records": 0, "load_cap_s": 90.0,
    "faults_enabled": ["kill-worker", "kill-agent"], "coordination": "ack", "fgme_damping": True, "spill_ack": "written",
    "workdir": "/tmp/fog-chaos-x", "t0_wall": 1.7e9, "load_s": 30.5, "settled": True, "settle_s": 4.1,
    "holding_at_end": [], "final_instances": {"source": 1, "in_zone": 1, "sink": 1}, "back_to_size": True,
    "duplicates_dropped_at_sink": 3, "protocol_messages": 420, "restarts": 1, "scale_outs": 4, "scale_ins": 4,
    "locks_held_at_end": [], "in_round_at_end": [], "agent_exit_codes": {"n1": 0, "n2": 0, "n3": 0},
    "faults": [{"t": 12.0, "kind": "kill-worker", "target": "n2/in_zone-3", "recovery_s": 1.9}],
    "faults_injected": 1, "all_recovered": True, "recovery_s": {"median": 1.9, "max": 1.9},
    "records_in": 6000, "records_expected": 6000, "records_out": 6000, "lost": 0, "duplicated": 0,
    "lost_sample": [], "wall_s": 48.2, "ok": True,
}


def test_chaos_prints_one_run_or_a_list(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """chaos.main as it is; each run (a fleet under faults for minutes) a recorded summary."""
    from foglab.tools import chaos

    monkeypatch.setattr(chaos, "run_chaos", lambda cfg, out, live: dict(CHAOS_SUMMARY, seed=cfg.seed))
    code, doc = fog_agent(capsys, "chaos", "--duration", "30", "--seed", "3", "--json")
    assert code == 0 and valid("chaos", doc)["seed"] == 3
    code, doc = fog_agent(capsys, "chaos", "--duration", "30", "--seed", "3", "--runs", "2", "--json")
    assert code == 0 and [r["seed"] for r in valid("chaos", doc)] == [3, 4]


PIPELINE_VERDICT: Dict[str, Any] = {  # what testbed_pipeline.run_pipeline returns
    "nodes": ["fog1", "fog2"], "sink_dir": "/var/lib/fog-agent/sink", "during": None, "duration_s": 60.0,
    "peak_rate": 500.0, "nodes_per_operator": {"source": ["fog1"], "in_zone": ["fog1", "fog2"]},
    "max_instances": {"in_zone": 3}, "files_per_node": {"fog1": 2, "fog2": 1}, "files_on_several_nodes": {},
    "generated": 20000, "expected": 20000, "received": 20000, "lost": 0, "duplicated": 0, "unexpected": 0,
    "lost_sample": [], "ok": True, "seconds": 95.3,
}


def test_testbed_commands_on_recorded_results(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                              tmp_path: Path) -> None:
    """Each testbed command as it is, its work (containers, qemu, Ansible: minutes to hours)
    replaced by a recorded result: the tools' own dataclasses where they have them (UpResult,
    Check, Report), else a dict of the keys the run function returns."""
    from foglab.tools import chaos_testbed, testbed, testbed_arm64, testbed_pipeline, testbed_scenarios, \
        testbed_systemd, testbed_upgrade, testbed_uplink

    monkeypatch.setattr(testbed, "up", lambda n, arch, deb=None: testbed.UpResult(
        nodes=[{"name": "fog1", "address": "10.77.0.2"}], arch=arch, inventory="/run/inv.ini", key="/run/key",
        known_hosts="/run/known_hosts", admin_password="pw", root_built=False, root_seconds=0.0, seconds=12.5))
    assert valid("testbed up", fog_agent(capsys, "testbed", "up", "--nodes", "1", "--json")[1])["arch"] == "amd64"
    monkeypatch.setattr(testbed, "build_root", lambda arch, suite: (tmp_path / "root", True, 600.0))
    assert valid("testbed root", fog_agent(capsys, "testbed", "root", "--json")[1])["built"] is True
    monkeypatch.setattr(testbed, "down", lambda **k: ["container fog1", "bridge fogbr0"])
    assert valid("testbed down", fog_agent(capsys, "testbed", "down", "--json")[1])["removed"]
    monkeypatch.setattr(testbed_systemd, "run_checks", lambda sh, names: [
        testbed_systemd.Check("ready", True, {"seconds": 2.1}), testbed_systemd.Check("reload", False, {"pid": 1})])
    code, doc = fog_agent(capsys, "testbed", "systemd", "fog1", "--checks", "ready,reload", "--json")
    assert code == 1 and [c["name"] for c in valid("testbed systemd", doc)] == ["ready", "reload"]
    monkeypatch.setattr(testbed_pipeline, "run_pipeline", lambda *a, **k: dict(PIPELINE_VERDICT))
    code, doc = fog_agent(capsys, "testbed", "pipeline", "--duration", "1", "--json")
    assert code == 0 and valid("testbed pipeline", doc)["ok"] is True
    monkeypatch.setattr(testbed_upgrade, "run_upgrade", lambda *a, **k: dict(
        PIPELINE_VERDICT, new_version="0.2.0+up1", upgrades=[{"node": "fog1", "seconds": 40.0}], nodes_upgraded=1,
        upgrade_ok=True))
    deb = tmp_path / "fog-agent.deb"
    deb.write_bytes(b"")
    code, doc = fog_agent(capsys, "testbed", "upgrade", "--deb", str(deb), "--json")
    assert code == 0 and valid("testbed upgrade", doc)["upgrade_ok"] is True
    report = testbed_scenarios.Report(steps=[testbed_scenarios.Step("bookworm", "converge", True, 300.0),
                                             testbed_scenarios.Step("trixie", "converge", None)],
                                      gates={"bookworm": [3.0, 4.5]})
    monkeypatch.setattr(testbed_scenarios, "run_scenarios", lambda *a, **k: report)
    code, doc = fog_agent(capsys, "testbed", "scenarios", "--deb", str(deb), "--json")
    assert code == 1 and valid("testbed scenarios", doc)["steps"][1]["ok"] is None
    monkeypatch.setattr(testbed_arm64, "arm64_check", lambda *a, **k: {
        "node": "fogarm", "root_built": False, "root_s": 0.0, "uname_m": "aarch64", "dpkg_arch": "arm64",
        "pipeline": dict(PIPELINE_VERDICT), "timings": {"boot_s": 30.0}, "ok": True})
    code, doc = fog_agent(capsys, "testbed", "arm64", "--deb", str(deb), "--json")
    assert code == 0 and valid("testbed arm64", doc)["ok"] is True
    monkeypatch.setattr(chaos_testbed, "run_testbed_chaos", lambda faults, **k: dict(
        PIPELINE_VERDICT, testbed_faults=[{"kind": "kill-node", "node": "fog2", "down_s": 20.0}], dead_after="15",
        seed=k["seed"], faults_injected=1))
    code, doc = fog_agent(capsys, "chaos", "--testbed", "--json")
    assert code == 0 and valid("chaos --testbed", doc)["faults_injected"] == 1
    landing = {"s1": testbed_uplink.SiteLanding(4000, 4000, 0, 0, 0),
               "s2": testbed_uplink.SiteLanding(4000, 3990, 10, 0, 0, (("source-0", 17),))}
    checks = testbed_uplink.verdict(landing, "s2", 900, 3, 0, False, True, 2_000_000, 50_000_000, 0)
    monkeypatch.setattr(testbed_uplink, "run_uplink_cut", lambda **k: {
        "cut_site": "s2", "cut_broker": "s2n1", "cut_kind": "link down", "cut_seconds": 60.0, "cut_at_s": 30.0,
        "duration_s": 150.0, "rate": 200.0, "backlog_landed_after_heal_s": 12.0, "all_landed_after_heal_s": None,
        "started_utc": "2026-12-05T10:00:00Z", "cut_utc": "2026-12-05T10:00:30Z", "healed_utc": "2026-12-05T10:01:30Z",
        "recorded_at_cut": {"s1": 6000, "s2": 6100}, "recorded_at_heal": {"s1": 18000, "s2": 7000},
        "files_landed": 40, "spool_cap_bytes": 50_000_000, "spool_files_left": 0,
        "landing": {k: dataclasses.asdict(v) for k, v in landing.items()}, "sites": {"s1": {}, "s2": {}},
        "samples": [{"t": 0.0}], "checks": [dataclasses.asdict(c) for c in checks], "ok": all(c.ok for c in checks),
        "seconds": 400.0, "kept": "None"})
    code, doc = fog_agent(capsys, "testbed", "uplink-cut", "--json")
    assert code == 1 and valid("testbed uplink-cut", doc)["ok"] is False  # s2 lost ten


# ---- the schemas refuse what is not the shape ---------------------------------------------------


def _all_mutations(doc: Any, schema: Dict[str, Any]) -> Iterator[Tuple[str, Any]]:
    """tests/test_json_shapes.py's mutations, and for a document that is an array (testbed
    systemd, chaos --runs) those of its first element."""
    if isinstance(doc, list) and doc:
        alts = schema.get("oneOf", [schema])
        for alt in alts:
            if alt.get("type") == "array" and Draft202012Validator(alt).is_valid(doc):
                for what, broken in _mutations(doc[0], alt["items"]):
                    yield f"[0] {what}", [broken] + doc[1:]
                return
    yield from _mutations(doc, schema)


def test_a_missing_key_or_a_wrong_type_is_refused_in_every_document() -> None:
    if not SEEN:
        pytest.skip("runs after the tests that collect the documents (same file, same process)")
    checked = 0
    for name, docs in SEEN.items():
        s = schemas.schema(name)
        v = Draft202012Validator(s)
        for doc in docs:
            for what, broken in _all_mutations(doc, s):
                assert not v.is_valid(broken), f"{name} accepted a document {what}"
                checked += 1
    assert checked > 300
    assert set(SEEN) == set(schemas.documented()), "every schema of docs/measurement.md checked on a document"
