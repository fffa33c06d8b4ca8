"""The user's path (issue #23): what a new user types, and what it must answer.

- every `--json` command writes JSON and nothing else to stdout (parsed with json.loads);
- `check-config` tells agent, pipeline, central and latency-matrix files apart, and the effective
  configuration it prints loads again as the same configuration (every file in examples/);
- bad arguments fail before anything starts, with one line; Ctrl-C on `fog-agent run` is quiet;
- setup leaves a system Mosquitto alone.

Real parts: the CLI runs as a subprocess (what reaches file descriptor 1 counts, not only
`print`), fogctl talks to a real Mosquitto, `fog-agent run` is the real daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
from agent_process import CHECKOUT_PATH, ONLINE_BOUND
from pipelines import taxi_in_zone

from agent.cli import config_cmd
from agent.schema import tomllib

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.toml"))


def fog_agent(*args: str, timeout: float = 60, env: Dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "agent", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=CHECKOUT_PATH, **(env or {})))


# ---- --json: only JSON on stdout ------------------------------------------------------------------

CHEAP_JSON_COMMANDS: List[List[str]] = [
    ["check-config", "--json", "examples/agent.toml"],
    ["check-config", "--json", "examples/pipeline.toml"],
    ["check-config", "--json", "examples/central.toml"],
    ["check-config", "--json", "examples/latency.toml"],
    ["simulate", "scaling", "--json", "--steps", "20", "--instances", "2", "--operators", "2"],
    ["simulate", "gme", "--json", "--nodes", "4", "--entries", "2"],
    ["simulate", "policies", "--json", "--seeds", "1", "--days", "0.05"],
    ["bench", "gme-check", "--json", "--groups", "1,1", "--requests", "1"],
    ["bench", "fuzz", "--json", "--inputs", "200"],
    ["bench", "spill", "--json", "--records", "2000", "--reps", "1"],
    ["calibrate", "--json", "--dry-run", "--pipeline", "examples/pipeline.toml", "--operator", "validate",
     "--window", "0.05", "--max-rate", "300", "--node", "n1", "--state-dir", "{tmp}"],
    # `bench dataplane --json` (a broker and worker processes, 27 s) is checked the same way, with
    # its every phase, by test_dataplane_bench.py::test_json_stdout_parses_and_reports_both_raws
]


@pytest.mark.parametrize("argv", CHEAP_JSON_COMMANDS, ids=lambda a: " ".join(a[:3]) if isinstance(a, list) else None)
def test_json_commands_write_only_json_to_stdout(argv: List[str], tmp_path: Path) -> None:
    r = fog_agent(*[a.format(tmp=tmp_path) for a in argv])
    assert r.returncode == 0, r.stderr[-2000:]
    json.loads(r.stdout)  # the whole of stdout, not a line of it


@pytest.mark.broker
def test_fogctl_json_commands_write_only_json(mosquitto: Any, capfd: pytest.CaptureFixture) -> None:
    from agent.cli.fogctl import main

    base = ["--broker", mosquitto.address, "--cluster", "jsonpath", "--timeout", "2"]
    for argv in (["status"], ["topology"], ["latency"], ["locks"], ["pipelines"]):
        code = main(base + argv + ["--json"])
        out, err = capfd.readouterr()
        assert code == 0, (argv, err)
        json.loads(out)
    # watch --json is JSON Lines (one event per line); its banner goes to stderr
    assert main(base + ["watch", "--duration", "0.3", "--json"]) == 0
    out, err = capfd.readouterr()
    assert "watching" in err and all(json.loads(line) for line in out.splitlines())


def test_demo_json_stdout_is_the_summary_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capfd: pytest.CaptureFixture) -> None:
    """The demo's code path under --json: whatever the run and the analytics hooks write to stdout,
    by `print` (the analytics hook printed "analytics report: <path>") or straight to file
    descriptor 1 (a JVM, a child process), lands on stderr; stdout is the summary."""
    from foglab.tools import demo

    def noisy_run(*a: Any, **k: Any) -> Dict[str, Any]:
        print("a library prints")
        os.write(1, b"a child writes to fd 1\n")
        return {"ok": True, "workdir": str(k["workdir"]), "lost": 0, "duplicated": 0}

    def noisy_analyse(workdir: Path, pipeline_path: Path) -> Dict[str, Any]:
        print(f"analytics report: {workdir}/report.md")
        os.write(1, b"spark writes to fd 1\n")
        return {"report": "r.md"}

    from foglab.tools import demo_analytics

    monkeypatch.setattr(demo, "run_demo", noisy_run)
    monkeypatch.setattr(demo_analytics, "analyse", noisy_analyse)
    args = argparse.Namespace(pipeline=None, duration=None, workdir=str(tmp_path / "w"), plot=None, quiet=True,
                              json=True, no_analytics=False)
    assert demo.main(args) == demo.EXIT_OK
    out, err = capfd.readouterr()
    summary = json.loads(out)
    assert summary["ok"] is True and summary["analytics"] == {"report": "r.md"}
    for noise in ("a library prints", "a child writes to fd 1", "analytics report:", "spark writes to fd 1"):
        assert noise in err and noise not in out
    print("after the demo")  # stdout is restored
    assert capfd.readouterr().out == "after the demo\n"


# ---- check-config: kinds and a printed configuration that loads again ------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_check_config_output_loads_again_as_the_same_configuration(path: Path, tmp_path: Path) -> None:
    data = tomllib.loads(path.read_text())
    kind = config_cmd.detect_kind(data)
    assert kind == {"agent.toml": "agent", "central.toml": "central", "latency.toml": "latency"}.get(path.name, "pipeline")
    node: List[str] = []
    if path.name == "demo-pipeline.toml":  # the lab's DEBS operators: checked as the demo's agents admit them
        from foglab.operators import MODULES

        (tmp_path / "node.toml").write_text(f'[agent]\nnode = "n"\n[operators]\nmodules = {json.dumps(list(MODULES))}\n')
        node = ["--agent-config", str(tmp_path / "node.toml")]
    r = fog_agent("check-config", *node, str(path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"# {path}: valid {kind} configuration")
    again = tmp_path / path.name
    again.write_text(r.stdout)
    assert config_cmd.load(kind, again) == config_cmd.load(kind, path)
    # --json carries the same table, with the file's key names
    j = fog_agent("check-config", "--json", *node, str(path))
    assert json.loads(j.stdout) == config_cmd._json_safe(config_cmd.effective(config_cmd.load(kind, path)))


def test_check_config_round_trips_what_toml_allows(tmp_path: Path) -> None:
    """Non-bare keys, nested params, inf in params, strings with quotes and backslashes.

    The odd params sit on a user operator that declares no `params_schema` (its params are not
    checked): the built-in taxi source now refuses keys it does not know (docs/operators.md)."""
    (tmp_path / "rt_ops.py").write_text("def f(rec):\n    return rec\n")
    node = tmp_path / "agent.toml"
    node.write_text('[agent]\nnode = "n"\n[operators]\nmodules = ["rt_ops"]\n')
    src = tmp_path / "p.toml"
    src.write_text(
        '[pipeline]\nname = "p"\n[[operator]]\nname = "s"\nkind = "source"\nfunction = "agent.operators.taxi:source"\n'
        'params = { seed = 2, rate = 5.0 }\n'
        '[[operator]]\nname = "m"\nfunction = "rt_ops:f"\n'
        'params = { "odd key" = 1, seed = 2, nested = { a = [1, 2], b = "q\\"\\\\" }, big = inf }\n'
        '[[operator]]\nname = "k"\nkind = "sink"\nfunction = "agent.operators.builtin:counting_sink"\n'
        '[operator.scaling]\npolicy = "none"\n')

    def check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "agent", "check-config", "--agent-config", str(node), *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=60,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)])))

    r = check(str(src))
    assert r.returncode == 0, r.stderr
    again = tmp_path / "again.toml"
    again.write_text(r.stdout)
    assert config_cmd.load("pipeline", again) == config_cmd.load("pipeline", src)
    j = check("--json", str(src))
    assert json.loads(j.stdout)["operator"][1]["params"]["big"] == "inf"  # strict JSON: no Infinity


def test_check_config_refuses_what_later_fails_and_unknown_kinds(tmp_path: Path) -> None:
    pipe = (ROOT / "examples/pipeline.toml").read_text()
    threshold = tmp_path / "threshold.toml"
    threshold.write_text(pipe.replace('policy = "decentralized"', 'policy = "threshold"', 1)
                         if 'policy = "decentralized"' in pipe else pipe + '\n[scaling]\npolicy = "threshold"\n')
    r = fog_agent("check-config", str(threshold))
    assert r.returncode == 0, r.stderr  # the agent runs the Gesscale policies (agent.policy.live)
    magic = tmp_path / "magic.toml"
    magic.write_text(threshold.read_text().replace('policy = "threshold"', 'policy = "magic"', 1))
    r = fog_agent("check-config", str(magic))
    assert r.returncode == 1 and "policy" in r.stderr, r.stderr
    inf = tmp_path / "inf.toml"
    inf.write_text(pipe.replace("capacity = 400.0", "capacity = inf"))
    assert "capacity = inf" in inf.read_text()
    r = fog_agent("check-config", str(inf))
    assert r.returncode == 1 and "capacity" in r.stderr and "finite" in r.stderr, r.stderr
    other = tmp_path / "other.toml"
    other.write_text("[something]\nx = 1\n")
    r = fog_agent("check-config", str(other))
    assert r.returncode == 1 and "--kind" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = fog_agent("check-config", "--kind", "central", str(ROOT / "examples/agent.toml"))
    assert r.returncode == 1 and "unknown key" in r.stderr  # checked as what the user said it is


# ---- bad arguments: one line, nothing started --------------------------------------------------------


def test_log_level_is_one_of_four(tmp_path: Path) -> None:
    r = fog_agent("--log-level", "loud", "check-config", "examples/agent.toml")
    assert r.returncode == 2 and "invalid choice: 'loud'" in r.stderr
    assert fog_agent("--log-level", "WARNING", "check-config", "examples/agent.toml").returncode == 0
    r = fog_agent("check-config", "examples/agent.toml", env={"FOG_AGENT_LOG_LEVEL": "loud"})
    assert r.returncode == 0 and "unknown log level 'loud'" in r.stderr


def test_fogctl_config_naming_a_missing_file_is_an_error(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli.fogctl import main

    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("fogctl connected despite a missing settings file")

    missing = tmp_path / "nonexistent.toml"
    assert main(["--config", str(missing), "status"], connect=never) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err and "--config" in err
    monkeypatch.setenv("FOGCTL_CONFIG", str(missing))
    assert main(["status"], connect=never) == 1
    assert "FOGCTL_CONFIG" in capsys.readouterr().err


def test_deploy_of_a_missing_file_is_one_clear_line() -> None:
    r = fog_agent("deploy", "nofile.toml", "--host", "127.0.0.1", "--port", "9")
    assert r.returncode == 1
    assert r.stderr == "error: cannot read pipeline file nofile.toml: No such file or directory\n"
    assert "Errno" not in r.stderr


@pytest.mark.parametrize("argv,says", [
    (["--duration", "-3"], "--duration must be a positive number"),
    (["--pipeline", "nofile.toml"], "cannot read pipeline file nofile.toml"),
    (["--pipeline", "examples/agent.toml"], "not usable by the demo"),
    (["--pipeline", "examples/pipeline.toml"], 'profile = "steps"'),
    (["--workdir", "README.md"], "is not a directory"),
])
def test_demo_refuses_bad_arguments_before_starting_anything(argv: List[str], says: str, tmp_path: Path) -> None:
    start = time.monotonic()
    r = fog_agent("demo", *argv, env={"TMPDIR": str(tmp_path)}, timeout=30)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no work directory, no broker config
    assert time.monotonic() - start < 15  # nothing was started (a fleet takes longer to come up)


def test_setup_and_make_leave_a_system_mosquitto_alone() -> None:
    """The private brokers use free ports: nothing may stop, disable or mask a system service."""
    for f in ("scripts/setup.sh", "Makefile"):
        code = "\n".join(line.split("#", 1)[0] for line in (ROOT / f).read_text().splitlines())
        for verb in ("systemctl", "service mosquitto", "update-rc.d", "pkill", "killall"):
            assert verb not in code, (f, verb)


# ---- Ctrl-C on `fog-agent run` -------------------------------------------------------------------


@pytest.mark.broker
def test_ctrl_c_on_run_is_quiet(mosquitto: Any, tmp_path: Path) -> None:
    """Ctrl-C reaches the agent's whole process group, the pre-started worker included: that
    worker, still reading its spec, used to die of KeyboardInterrupt with a traceback."""
    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "n1"\ncluster = "ctrlc"\nslots = 2\nstate_dir = "{tmp_path}/state"\n'
                    f'[mqtt]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\n[metrics]\nport = 0\n')
    proc = subprocess.Popen([PY, "-m", "agent", "run", "--config", str(conf)], stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        warm: List[str] = []
        while time.monotonic() < deadline and not warm:
            warm = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "agent.instance.worker"],
                                  capture_output=True, text=True).stdout.split()
            time.sleep(0.2)
        assert warm, "no pre-started worker"
        time.sleep(2.0)  # the warm worker is past its imports, blocked reading its spec
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        rc = proc.wait(timeout=20)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "shutting down (signal SIGINT)" in err


# ---- every documented metric, scraped from a live agent ---------------------------------------------

# in_zone at 3x its capacity, at most 2 instances
METRICS_PIPELINE = taxi_in_zone("hot", seed=2, rate=60.0, policy="decentralized", capacity=20.0, max_instances=2)


def _documented_metrics() -> List[str]:
    import re

    doc = (ROOT / "docs" / "fogctl.md").read_text()
    return sorted(set(re.findall(r"^\| `(fog_[a-z_]+)` \|", doc, re.M)))


def test_the_grafana_dashboard_queries_documented_metrics() -> None:
    import re

    dash = json.loads((ROOT / "examples" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if "expr" in t]
    used = {m for e in exprs for m in re.findall(r"\b(fog_[a-z_]+)", e)}
    assert exprs and used and used <= set(_documented_metrics()), used - set(_documented_metrics())


@pytest.mark.broker
def test_every_documented_metric_is_set_by_a_live_agent(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One agent with metrics and the spill on, a pipeline whose in_zone scales out (60 records/s
    for a capacity of 20), then a broker restart: every metric of docs/fogctl.md's table has a
    sample on /metrics (2-FGME lock messages: under `coordination = "fgme"` only, and exported
    by the same bridge, so that one is checked for its help line)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from agent.cli.fogctl import main as fogctl
    from foglab.tools.broker import free_port, start_private_broker

    broker = start_private_broker(tmp_path / "broker")
    port = free_port()
    conf = tmp_path / "a.toml"
    conf.write_text(
        f'[agent]\nnode = "m1"\ncluster = "metrics"\nslots = 6\nstate_dir = "{tmp_path}/state"\nstate_period = 0.5\n'
        f'heartbeat_period = 0.2\nshutdown_timeout = 3.0\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\nkeepalive = 2\n'
        f'[metrics]\nport = {port}\n'
        f'[spill]\nenabled = true\nspool_dir = "{tmp_path}/spool"\nrotate_seconds = 1.0\nship = "path"\n'
        f'ship_path = "{tmp_path}/landing"\n')
    log = open(tmp_path / "agent.log", "w")
    proc = subprocess.Popen([PY, "-m", "agent", "run", "--config", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    base = ["--broker", broker.address, "--cluster", "metrics", "--timeout", "5"]

    in_zone_counts: List[float] = []  # in_zone instances, every phase, at each scrape

    def scrape() -> Dict[tuple, float]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
        in_zone_counts.append(sum(v for (n, lab), v in out.items()
                                  if n == "fog_instances" and dict(lab).get("operator") == "in_zone"))
        return out

    def has(samples: Dict[tuple, float], name: str, pred: Any = lambda labels, v: True) -> bool:
        return any(n == name and pred(dict(lab), v) for (n, lab), v in samples.items())

    def wait(pred: Any, timeout: float) -> Dict[tuple, float]:
        deadline = time.monotonic() + timeout
        while True:
            s = scrape()
            if pred(s) or time.monotonic() > deadline:
                return s
            time.sleep(0.3)

    try:
        assert wait(lambda s: bool(s), 20), "no /metrics endpoint"
        pipe = tmp_path / "hot.toml"
        pipe.write_text(METRICS_PIPELINE)
        deadline = time.monotonic() + ONLINE_BOUND
        while fogctl(base + ["status", "--json"]) != 0 or "online" not in capsys.readouterr().out:
            assert time.monotonic() < deadline, "agent not online"
            time.sleep(0.3)
        assert fogctl(base + ["deploy", str(pipe)]) == 0, capsys.readouterr().err
        s = wait(lambda s: has(s, "fog_instances", lambda lab, v: lab.get("operator") == "in_zone"
                                and lab.get("phase") == "active" and v >= 2)
                 and has(s, "fog_protocol_messages_total", lambda lab, v: lab.get("direction") == "out" and v > 0)
                 and has(s, "fog_spool_files"), 40)
        assert has(s, "fog_instances", lambda lab, v: lab == {"pipeline": "hot", "operator": "in_zone",
                                                             "phase": "active"} and v >= 2), \
            {k: v for k, v in s.items() if k[0] == "fog_instances"}
        assert has(s, "fog_instances", lambda lab, v: lab["operator"] == "source" and lab["phase"] == "active" and v == 1)
        # max_instances = 2 bounds every instance, starting and terminating ones included (one
        # agent: a hard bound, docs/scaling.md "max_instances and min_instances"); it once had 3.
        assert max(in_zone_counts) <= 2, in_zone_counts
        assert has(s, "fog_protocol_messages_total", lambda lab, v: lab == {"type": "all", "direction": "out"} and v > 0)
        assert has(s, "fog_protocol_messages_total", lambda lab, v: lab == {"type": "all", "direction": "in"} and v > 0)
        assert not has(s, "fog_mqtt_reconnects_total", lambda lab, v: lab.get("client") == "agent" and v > 0)
        # the broker restarts on the same port: the agent reconnects once
        broker.stop()
        time.sleep(0.5)
        broker = start_private_broker(tmp_path / "broker", port=broker.port)
        s = wait(lambda s: has(s, "fog_mqtt_reconnects_total", lambda lab, v: lab.get("client") == "agent" and v >= 1), 30)
        assert has(s, "fog_mqtt_reconnects_total", lambda lab, v: lab == {"client": "agent"} and v == 1), \
            {k: v for k, v in s.items() if "reconnect" in k[0]}
        # every documented metric has a sample (counters as <name>_total)
        names = {k[0] for k in s}
        for name in _documented_metrics():
            if name == "fog_lock_messages_total":
                continue  # 2-FGME pipelines only (tests/test_metrics_prom.py exports it through the bridge)
            assert name in names, (name, sorted(names))
        assert max(in_zone_counts) <= 2, in_zone_counts  # across the broker restart too
        # the first round asked for 3-4 copies (docs/scaling.md): the agent refused the extra
        # ones, and a refusal at the bound is no warning (the keeper asks again every period)
        # (the first decision can come from a partial first period and ask for one copy only:
        # then the refusal comes with a later period's decision, so wait for it)
        deadline = time.monotonic() + 30
        while True:
            lines = (tmp_path / "agent.log").read_text().splitlines()
            if any("level=info" in ln and "max_instances reached" in ln for ln in lines) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert any("level=info" in ln and "max_instances reached" in ln for ln in lines)
        assert not any("level=warning" in ln and "max_instances" in ln for ln in lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        broker.stop()


# ---- docs match the wire ----------------------------------------------------------------------------


def test_documented_node_state_has_the_builders_keys() -> None:
    """docs/fogctl.md's node state example uses the keys `build_node_state` writes, no others."""
    import re

    from agent.node.nodestate import InstanceInfo, MachineSample, build_node_state, encode_state, parse_node_state

    doc = (ROOT / "docs" / "fogctl.md").read_text()
    block = re.search(r"Node state, as the agent publishes it.*?```json\n(.*?)```", doc, re.S)
    assert block, "node state example not found"
    documented = json.loads(block.group(1))
    lock = {"state": "in_cs", "intent": None, "boundaries": []}
    real = build_node_state("n1", 4, [InstanceInfo("taxi.in_zone.0", "in_zone", True, "active", 380.0, 400.0, 4242,
                                                    {"records_in": 1, "state": "active", "lock": lock})],
                            MachineSample(12.5, 40.1, 51.0, {"capacity": 500.0}), 1700000000.5)
    real = parse_node_state(encode_state(real))
    assert set(documented) == set(real)
    assert set(documented["instances"][0]) == set(real["instances"][0])
    assert documented["version"] == real["version"]


def test_design_citations_point_at_the_design_document() -> None:
    """The code cites docs/design.md (in the repository) by section or invariant, and each cited
    section and invariant exists; DESIGN.md (never shipped) is not cited any more."""
    import re

    design = (ROOT / "docs" / "design.md").read_text()
    sections = {int(m) for m in re.findall(r"^## (\d+)\. ", design, re.M)}
    invariants = {int(m) for m in re.findall(r"^(\d+)\. \*\*", design.split("## 4.")[1].split("\n## ")[0], re.M)}
    assert sections == set(range(1, 9)) and invariants == set(range(1, 9))
    files = [p for d in ("agent", "lab", "tests", "ansible", "scripts") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".j2", ".yml", ".sh", ".md") and p.name != "test_user_path.py"]
    files += list((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    cited = 0
    for p in files:
        text = p.read_text(errors="replace")
        assert "DESIGN.md" not in text and "DESIGN invariant" not in text, p
        for kind, n in re.findall(r"docs/design\.md,? (section|invariant|inv\.) (\d+)", text):
            cited += 1
            assert int(n) in (sections if kind == "section" else invariants), (p, kind, n)
    assert cited >= 20


@pytest.mark.parametrize("failure", ["setup", "loss", "interrupt"])
def test_a_failed_demo_says_where_its_work_directory_is(failure: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capfd: pytest.CaptureFixture) -> None:
    from foglab.tools import demo

    work = tmp_path / "work"

    def run(*a: Any, **k: Any) -> Dict[str, Any]:
        assert k["workdir"] == work
        work.mkdir()
        (work / "n1.log").write_text("agent log\n")
        if failure == "setup":
            raise RuntimeError("agents did not come online")
        if failure == "interrupt":
            raise KeyboardInterrupt
        return {"ok": False, "workdir": str(work), "lost": 3, "duplicated": 0}

    monkeypatch.setattr(demo, "run_demo", run)
    args = argparse.Namespace(pipeline=None, duration=None, workdir=str(work), plot=None, quiet=True, json=False,
                              no_analytics=True)
    if failure == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            demo.main(args)
    else:
        assert demo.main(args) == {"setup": demo.EXIT_SETUP, "loss": demo.EXIT_LOSS}[failure]
    err = capfd.readouterr().err
    assert f"kept in {work}" in err, err
    assert (work / "n1.log").exists()


def test_placement_choices_are_the_runtimes_policies() -> None:
    from agent.cli.runtime_cmd import PLACEMENTS
    from agent.node.placement import POLICIES

    assert set(PLACEMENTS) == set(POLICIES)
    r = fog_agent("run", "--placement", "nope")
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr


def test_documented_topics_are_the_codes_topics() -> None:
    """Every topic of docs/design.md section 5 and of docs/fogctl.md's topic table is one that
    `agent.topics.parse` knows (placeholders filled in), and every kind it knows is in the design."""
    import re

    from agent import topics

    def concrete(t: str) -> str:
        t = re.sub(r"<[^>]+>", "x", t.strip().strip("`"))
        return t if t.startswith("fog/") else "fog/c/" + t

    design = (ROOT / "docs" / "design.md").read_text().split("## 5.")[1].split("\n## ")[0]
    kinds = set()
    for line in design.split("```")[1].strip().splitlines():
        got = topics.parse("c", concrete(line.split()[0].replace("fog/<c>/", "fog/c/")))
        assert got is not None, line
        kinds.add(got.kind)
    listed = re.search(r"kind: (.*?)\n\s+node:", topics.Parsed.__doc__ or "", re.S)
    assert listed, "agent.topics.Parsed no longer lists its kinds"
    all_kinds = {k.strip() for k in listed.group(1).split("|")}
    assert len(all_kinds) >= 17
    assert kinds == all_kinds, all_kinds - kinds
    table = (ROOT / "docs" / "fogctl.md").read_text().split("## Topics")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `([^`]+)` \|", table, re.M)
    assert len(rows) >= 9
    for row in rows:
        assert topics.parse("c", concrete(row)) is not None, row


def test_the_readmes_minimal_pipeline_is_the_example_file_and_its_two_operators_run(tmp_path: Path) -> None:
    """README's "A minimal pipeline" is examples/minimal-pipeline.toml, word for word (check-config
    passes on it: the examples' round trip above), and its operators, built as a worker builds
    them, pass the source's records into the sink, each id recorded once."""
    from agent.config import load_pipeline_text
    from agent.operators.builtin import OperatorContext, load_operator

    text = (ROOT / "examples" / "minimal-pipeline.toml").read_text()
    section = (ROOT / "README.md").read_text().split("## A minimal pipeline", 1)[1].split("\n## ", 1)[0]
    assert f"```toml\n{text}```" in section
    cfg = load_pipeline_text(text)
    built = [load_operator(o.function, OperatorContext(
        instance=f"{cfg.pipeline.name}.{o.name}.0", operator=o.name, node="n", kind=o.kind, params=dict(o.params),
        state_dir=tmp_path, sink_dir=tmp_path)) for o in cfg.operators]
    assert [o.kind for o in cfg.operators] == ["source", "sink"]
    source, sink = built
    source.start(0.0)
    items = source.poll(1.0, budget=1000)  # rate = 50 records/s, one second in
    assert [seq for _, seq, _ in items] == list(range(50))
    sink.record(items)
    sink.record(items[:10])  # sent again: dropped by id
    assert sink.stats() == {"recorded": 50, "duplicates_dropped": 10}
