"""docs/operators.md holds: check-config catches what would fail later, and the guide's worked example
(examples/operators) runs as the guide says.

- `fog-agent check-config` on a pipeline imports every function the node's allow-list admits (and
  nothing it refuses), checks each operator's params against the `params_schema` its function
  declares (the built-ins' and a user's), opens the files the params name; on an agent file it
  refuses an empty `[mqtt].host` and an unreadable password file. Every problem is one line naming
  file, key and what was expected.
- The worked example: two real agents (`fog-agent run`, real workers) on a real Mosquitto, the
  example package on their Python path and in their `[operators] modules`, the example pipeline
  deployed with `fog-agent deploy`; readings published as a sensor would come out of mqtt_sink
  converted, filtered and counted per sensor exactly as docs/operators.md says.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from agent.cli import config_cmd

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "operators"

PIPELINE = """
[pipeline]
name = "p"
[[operator]]
name = "src"
kind = "source"
function = "{src}"
params = {{ {src_params} }}
[[operator]]
name = "work"
function = "{work}"
params = {{ {work_params} }}
[[operator]]
name = "out"
kind = "sink"
function = "{sink}"
params = {{ {sink_params} }}
"""


def pipeline(tmp_path: Path, src: str = "agent.operators.taxi:source", src_params: str = "",
             work: str = "agent.operators.builtin:in_zone", work_params: str = "",
             sink: str = "agent.operators.builtin:counting_sink", sink_params: str = "") -> Path:
    p = tmp_path / "p.toml"
    p.write_text(PIPELINE.format(src=src, src_params=src_params, work=work, work_params=work_params, sink=sink,
                                 sink_params=sink_params))
    return p


def check(path: Path, capsys: Any, agent_config: Any = None) -> Tuple[int, List[str]]:
    """check-config in this process: (exit status, stderr lines)."""
    args = argparse.Namespace(file=str(path), kind=None, json=True,
                              agent_config=str(agent_config) if agent_config else None)
    rc = config_cmd.run(args)
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line]


@pytest.fixture
def no_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No node agent.toml unless a test gives one (not the machine's /etc/fog-agent/agent.toml)."""
    monkeypatch.setenv("FOG_AGENT_CONFIG", str(tmp_path / "no-such-agent.toml"))


# ---- built-in params ------------------------------------------------------------------------------


@pytest.mark.parametrize("params, key, expected", [
    ('profile = "constnt"', "profile", 'expected one of "constant", "steps", "sinusoid", "csv", got "constnt"'),
    ("rate = -5", "rate", "expected a finite number >= 0, got -5"),
    ('rate = "fast"', "rate", 'expected a finite number >= 0, got "fast"'),
    ("rate = inf", "rate", "expected a finite number >= 0, got inf"),
    ("rat = 500.0", "rat", "unknown key (allowed: amplitude, csv, max_lag_s, max_records, period, profile, rate, seed, steps)"),
    ('seed = 1.5', "seed", "expected an integer, got 1.5"),
    ('profile = "sinusoid", period = 0', "period", "expected a finite number > 0, got 0"),
    ('profile = "steps", steps = [[10, 100], [0, 50]]', "steps", "expected [[t, rate], ...] with increasing t"),
    ('profile = "steps", steps = [[0, -1]]', "steps", "expected [[t, rate], ...] with increasing t and rates >= 0, got an array"),
    ('profile = "csv"', "csv", 'missing required key (profile = "csv" reads the rates from this file)'),
    ("max_records = -1", "max_records", "expected an integer >= 0, got -1"),
])
def test_taxi_source_params(tmp_path: Path, capsys: Any, no_node: None, params: str, key: str, expected: str) -> None:
    p = pipeline(tmp_path, src_params=params)
    rc, lines = check(p, capsys)
    assert rc == 1
    [line] = lines
    assert line.startswith(f"error: {p}: [operator[0]].params.{key}: {expected}"), line


def test_good_params_pass(tmp_path: Path, capsys: Any, no_node: None) -> None:
    rates = tmp_path / "rates.csv"
    rates.write_text("t,rate\n0,10\n5,20\n")
    for params in ('seed = 1, profile = "constant", rate = 200.0, max_records = 10',
                   'profile = "steps", steps = [[0, 80], [8, 300.5]]',
                   'profile = "sinusoid", rate = 50, amplitude = 0.5, period = 60',
                   f'profile = "csv", csv = "{rates}"'):
        rc, lines = check(pipeline(tmp_path, src_params=params), capsys)
        assert (rc, lines) == (0, []), params
        assert json.loads(capsys.readouterr().out or "{}") == {} or True


def test_files_the_params_name_must_be_readable_and_parse(tmp_path: Path, capsys: Any, no_node: None) -> None:
    missing = tmp_path / "nope.csv"
    p = pipeline(tmp_path, src_params=f'profile = "csv", csv = "{missing}"')
    rc, [line] = check(p, capsys)
    assert rc == 1 and line == (f'error: {p}: [operator[0]].params.csv: expected a readable file '
                                f'(No such file or directory), got "{missing}"')
    bad = tmp_path / "bad.csv"
    bad.write_text("t,rate\n0,10\nfive,20\n")
    rc, [line] = check(pipeline(tmp_path, src_params=f'profile = "csv", csv = "{bad}"'), capsys)
    assert rc == 1 and "[operator[0]].params.csv: expected a file of 't,rate' lines" in line and ":3:" in line


def test_a_path_param_outside_the_nodes_directories_is_refused_as_deploy_would(tmp_path: Path, capsys: Any) -> None:
    rates = tmp_path / "rates.csv"
    rates.write_text("0,10\n")
    state = tmp_path / "state"
    state.mkdir()
    node = tmp_path / "agent.toml"
    node.write_text(f'[agent]\nnode = "n"\nstate_dir = "{state}"\n')
    p = pipeline(tmp_path, src_params=f'profile = "csv", csv = "{rates}"')
    rc, [line] = check(p, capsys, node)
    assert rc == 1 and line.startswith(f"error: {p}: [operator[0]].params.csv: expected a path inside the node's directories")
    assert str(state) in line
    inside = state / "rates.csv"
    inside.write_text("0,10\n")
    assert check(pipeline(tmp_path, src_params=f'profile = "csv", csv = "{inside}"'), capsys, node) == (0, [])


@pytest.mark.parametrize("kwargs, key, expected", [
    ({"work_params": "k = 3"}, "[operator[1]].params.k", "unknown key (this operator takes no params), got 3"),
    ({"sink": "agent.operators.builtin:mqtt_sink"}, "[operator[2]].params.topic", "missing required key (expected a string)"),
    ({"sink": "agent.operators.builtin:mqtt_sink", "sink_params": 'topic = "out/#"'}, "[operator[2]].params.topic",
     'expected a topic name (no + or #), got "out/#"'),
    ({"src": "agent.operators.taxi:mqtt_source", "src_params": 'topic = ""'}, "[operator[0]].params.topic",
     'expected a topic filter, got ""'),
    ({"src": "agent.operators.taxi:mqtt_source", "src_params": 'topic = "s/#", max_buffer = 0'},
     "[operator[0]].params.max_buffer", "expected an integer >= 1, got 0"),
])
def test_other_builtins_params(tmp_path: Path, capsys: Any, no_node: None, kwargs: Dict[str, str], key: str,
                               expected: str) -> None:
    p = pipeline(tmp_path, **kwargs)
    rc, [line] = check(p, capsys)
    assert rc == 1 and line == f"error: {p}: {key}: {expected}", line


# ---- user operators: import and declared params ---------------------------------------------------


def test_user_functions_are_imported_after_the_allow_list_and_their_schema_checked(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = "guide_ops_" + uuid.uuid4().hex[:8]
    evil = "guide_evil_" + uuid.uuid4().hex[:8]
    pkgs = tmp_path / "pkgs"
    pkgs.mkdir()
    marker = tmp_path / "evil_imported"
    (pkgs / f"{mod}.py").write_text(
        "from agent.operators.builtin import Param, record_map\n"
        "@record_map\n"
        "def scale(rec, params):\n    return rec\n"
        "scale.params_schema = {'factor': Param('number', required=True, above=0), 'unit': Param('string', choices=('c', 'f'))}\n"
        "def free(rec):\n    return rec\n")
    (pkgs / f"{mod}_broken.py").write_text("raise RuntimeError('needs a GPIO board')\n")
    (pkgs / f"{evil}.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef run(rec):\n    return rec\n")
    monkeypatch.syspath_prepend(str(pkgs))
    node = tmp_path / "agent.toml"
    node.write_text(f'[agent]\nnode = "n"\n[operators]\nmodules = ["{mod}", "{mod}_broken", "guide_absent_module"]\n')

    # a refused module is never imported, even when another operator's function is fine
    p = pipeline(tmp_path, work=f"{evil}:run")
    rc, [line] = check(p, capsys, node)
    assert rc == 1 and f'[operator[1]].function: "{evil}:run" is not allowed on this node' in line
    assert not marker.exists() and evil not in sys.modules

    # allowed but not importable: said now, not by a worker after deploy (old check-config passed it)
    for ref, why in ((f"{mod}:nope", f"(module '{mod}' has no operator 'nope')"),
                     (f"{mod}:scael", f"(module '{mod}' has no operator 'scael'; did you mean 'scale'?)"),
                     ("guide_absent_module:f", "No module named"),
                     (f"{mod}_broken:f", "importing it raised RuntimeError: needs a GPIO board")):
        p = pipeline(tmp_path, work=ref)
        rc, [line] = check(p, capsys, node)
        assert rc == 1 and line.startswith(f'error: {p}: [operator[1]].function: expected an importable operator '
                                           f'function, got "{ref}"') and why in line, line

    # the schema a user declares
    cases = [("", "[operator[1]].params.factor: missing required key (expected a finite number > 0)"),
             ("factor = 0", "[operator[1]].params.factor: expected a finite number > 0, got 0"),
             ('factor = 2, unit = "k"', '[operator[1]].params.unit: expected one of "c", "f", got "k"'),
             ("factor = 2, fatcor = 3", "[operator[1]].params.fatcor: unknown key (allowed: factor, unit), got 3")]
    for params, expected in cases:
        p = pipeline(tmp_path, work=f"{mod}:scale", work_params=params)
        rc, lines = check(p, capsys, node)
        assert (rc, lines) == (1, [f"error: {p}: {expected}"]), lines
    assert check(pipeline(tmp_path, work=f"{mod}:scale", work_params='factor = 2, unit = "f"'), capsys, node) == (0, [])
    # no schema declared: params are the operator's business
    assert check(pipeline(tmp_path, work=f"{mod}:free", work_params='anything = [1, "x"]'), capsys, node) == (0, [])


# ---- agent files ----------------------------------------------------------------------------------


def test_agent_file_host_and_password_file(tmp_path: Path, capsys: Any) -> None:
    conf = tmp_path / "agent.toml"
    conf.write_text('[agent]\nnode = "n"\n[mqtt]\nhost = ""\n')
    rc, [line] = check(conf, capsys)
    assert rc == 1 and line == 'error: agent.toml: [mqtt].host: expected a host name or address, got ""'
    secret = tmp_path / "mqtt-password"
    conf.write_text(f'[agent]\nnode = "n"\n[mqtt]\nusername = "n"\npassword_file = "{secret}"\n')
    rc, [line] = check(conf, capsys)
    assert rc == 1 and line == (f"error: agent.toml: [mqtt].password_file: expected a readable file "
                                f'(No such file or directory), got "{secret}"')
    secret.write_text("s3cret\n")
    rc, lines = check(conf, capsys)
    assert (rc, lines) == (0, [])
    # a missing TLS file is a warning (packages write agent.toml before the certificates arrive)
    conf.write_text(f'[agent]\nnode = "n"\n[mqtt.tls]\nca_file = "{tmp_path / "ca.crt"}"\n')
    rc, [line] = check(conf, capsys)
    assert rc == 0 and line.startswith("warning: agent.toml: [mqtt.tls].ca_file: expected a readable PEM file")
    (tmp_path / "ca.crt").write_text("not a certificate\n")
    rc, [line] = check(conf, capsys)
    assert rc == 1 and line.startswith("error: agent.toml: [mqtt.tls].ca_file: expected a PEM CA certificate")


def test_cli_one_line_per_problem(tmp_path: Path) -> None:
    p = pipeline(tmp_path, src_params='profile = "constnt"')
    r = subprocess.run([sys.executable, "-m", "agent", "check-config", str(p)], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT),
                                                            FOG_AGENT_CONFIG=str(tmp_path / "none.toml")))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f'error: {p}: [operator[0]].params.profile: expected one of "constant", '
                                     f'"steps", "sinusoid", "csv", got "constnt"']


# ---- the worked example ---------------------------------------------------------------------------

READINGS: List[Tuple[str, bytes]] = [
    ("lab/sensors/s1/temperature", b'{"sensor": "s1", "celsius": 20.0}'),
    ("lab/sensors/s2/temperature", b'{"sensor": "s2", "celsius": -40}'),
    ("lab/sensors/s1/temperature", b'{"sensor": "s1", "celsius": "warm"}'),   # dropped: not a number
    ("lab/sensors/s1/temperature", b'{"sensor": "s1", "celsius": 25.5}'),
    ("lab/sensors/s3/temperature", b"not json"),                               # dropped: no sensor
    ("lab/sensors/s2/temperature", b'{"sensor": "s2", "celsius": 100}'),
    ("lab/sensors/s3/temperature", b'{"celsius": 3}'),                         # dropped: no sensor
    ("lab/sensors/s1/temperature", b'{"sensor": "s1", "celsius": 18.0}'),
]
# What docs/operators.md says comes out, per sensor in order.
EXPECTED = {
    "s1": [{"sensor": "s1", "celsius": 20.0, "fahrenheit": 68.0, "count": 1, "max_f": 68.0},
           {"sensor": "s1", "celsius": 25.5, "fahrenheit": 77.9, "count": 2, "max_f": 77.9},
           {"sensor": "s1", "celsius": 18.0, "fahrenheit": 64.4, "count": 3, "max_f": 77.9}],
    "s2": [{"sensor": "s2", "celsius": -40, "fahrenheit": -40.0, "count": 1, "max_f": -40.0},
           {"sensor": "s2", "celsius": 100, "fahrenheit": 212.0, "count": 2, "max_f": 212.0}],
}


def test_the_example_package_declares_its_entry_points() -> None:
    from agent.schema import tomllib

    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    eps = project["project"]["entry-points"]["fog_agent.operators"]
    assert eps == {"to_fahrenheit": "fog_example_ops.ops:to_fahrenheit",
                   "sensor_stats": "fog_example_ops.ops:sensor_stats"}
    pipe = (EXAMPLE / "pipeline.toml").read_text()
    for ref in eps.values():
        assert f'function = "{ref}"' in pipe


def test_installed_with_its_entry_points_the_example_needs_no_operators_modules(tmp_path: Path) -> None:
    """The wheel way of docs/operators.md, without building a wheel: the package's metadata (a
    dist-info directory with the entry points of its pyproject.toml, as pip installs it) on the
    path makes exactly its two operators allowed on a node whose agent.toml lists no module."""
    from agent.schema import tomllib

    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    site = tmp_path / "site"
    info = site / "fog_example_ops-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    eps = project["entry-points"]["fog_agent.operators"]
    (info / "entry_points.txt").write_text("[fog_agent.operators]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    node = tmp_path / "agent.toml"
    node.write_text('[agent]\nnode = "n"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(EXAMPLE), str(site)]))

    def check_cli(pipeline_file: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agent", "check-config", str(pipeline_file), "--agent-config",
                               str(node)], capture_output=True, text=True, cwd=str(tmp_path), timeout=60, env=env)

    r = check_cli(EXAMPLE / "pipeline.toml")
    assert r.returncode == 0, r.stderr
    # an entry point allows its target only, not the rest of the module
    other = tmp_path / "p.toml"
    other.write_text((EXAMPLE / "pipeline.toml").read_text().replace("ops:sensor_stats", "ops:SensorStats"))
    r = check_cli(other)
    assert r.returncode == 1 and '"fog_example_ops.ops:SensorStats" is not allowed on this node' in r.stderr
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(EXAMPLE)])  # the module without its metadata
    r = check_cli(EXAMPLE / "pipeline.toml")
    assert r.returncode == 1 and '"fog_example_ops.ops:to_fahrenheit" is not allowed on this node' in r.stderr


@pytest.mark.broker
def test_the_worked_example_runs_on_real_agents(tmp_path: Path, mosquitto: Any) -> None:
    import paho.mqtt.client as mqtt

    from agent.node.deploy import RpcClient
    from agent_process import wait_until_answers

    cluster = "ops" + uuid.uuid4().hex[:6]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(EXAMPLE)]))
    env.pop("FOG_AGENT_CONFIG", None)
    procs, logs = [], []
    for node in ("n1", "n2"):
        state = tmp_path / node
        state.mkdir()
        conf = tmp_path / f"{node}.toml"
        conf.write_text(f'[agent]\nnode = "{node}"\ncluster = "{cluster}"\nslots = 3\nstate_dir = "{state}"\n'
                        f'state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 3.0\n'
                        f'[operators]\nmodules = ["fog_example_ops.ops"]\n'
                        f'[mqtt]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\n[metrics]\nport = 0\n')
        # the guide's first step: check-config with the node's agent.toml imports the example's functions
        r = subprocess.run([sys.executable, "-m", "agent", "check-config", str(EXAMPLE / "pipeline.toml"),
                            "--agent-config", str(conf)], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                           timeout=60)
        assert r.returncode == 0, r.stderr
        log = tmp_path / f"{node}.log"
        logs.append(log)
        with open(log, "w") as fh:
            procs.append(subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(conf)],
                                          stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path)))
    got: List[Dict[str, Any]] = []
    ids: List[Tuple[str, int]] = []
    lock = threading.Lock()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        body = json.loads(msg.payload)
        with lock:
            got.extend(body["records"])
            ids.extend((s, q) for s, q in body["ids"])

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"guide-{cluster}")
    sub.on_message = on_message
    sub.connect(mosquitto.host, mosquitto.port)
    sub.subscribe("lab/temperature/stats", qos=1)
    sub.loop_start()
    try:
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            for node in ("n1", "n2"):
                wait_until_answers(client, node, lambda: all(p.poll() is None for p in procs))
        started = time.time()
        d = subprocess.run([sys.executable, "-m", "agent", "deploy", str(EXAMPLE / "pipeline.toml"),
                            "--host", mosquitto.host, "--port", str(mosquitto.port), "--cluster", cluster],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
        assert d.returncode == 0, d.stdout + d.stderr
        placed = [line.split() for line in d.stdout.splitlines()]
        assert [row[0] for row in placed] == ["readings", "to_fahrenheit", "sensor_stats", "out"], d.stdout
        assert {row[-1] for row in placed} == {"n1", "n2"}  # the code ran on both nodes
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sensor-{cluster}")
        pub.connect(mosquitto.host, mosquitto.port)
        pub.loop_start()
        for topic, payload in READINGS:
            pub.publish(topic, payload, qos=1).wait_for_publish(5)
        pub.loop_stop()
        pub.disconnect()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with lock:
                if len(got) >= 5:
                    break
            time.sleep(0.05)
        time.sleep(0.5)  # nothing more may come
    finally:
        sub.loop_stop()
        sub.disconnect()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    by_sensor: Dict[str, List[Dict[str, Any]]] = {}
    for rec in got:
        by_sensor.setdefault(rec["sensor"], []).append(rec)
    assert by_sensor == EXPECTED, (got, [log.read_text()[-3000:] for log in logs])
    # ids: the source instance's numbers of the readings it passed on (the dropped ones are filtered,
    # not lost: the worker counts them), each once
    assert len(set(ids)) == len(ids) == 5 and {s for s, _ in ids} == {"sensors.readings.0"}
    # numbered from the wall clock in microseconds at the source's start (taxi.MqttIngestSource)
    base = min(q for _, q in ids)
    assert base >= int(started * 1e6)
    assert sorted(q - base for _, q in ids) == [0, 1, 3, 5, 7]
    assert all(p.returncode == 0 for p in procs)
