"""`fog-agent dev up|status|down` (lab/foglab/tools/devfleet.py) and `fogctl --agent-config`.

The generated files are checked with the loaders of the commands that read them (the agent's,
fogctl's, `fog-agent deploy`'s), without starting anything; one live test runs the CLI as a user
does: `dev up` exits with two agents still running, `fogctl status` sees both online, the README's
own-operator example (examples/sensor-minutes: clean -> one-minute mean and max per sensor ->
file sink) deploys through the env file and writes its windows, `dev down` leaves no process of
the fleet (pids and their process groups). The README's steps before the fleet are checked too:
the example's offline test (the harness), and check-config of both example pipelines with the
env file's settings, as `fog-agent deploy` checks them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from agent_process import CHECKOUT_PATH, ONLINE_BOUND
from agent.config import default_config_path, load_agent_config
from agent.fogctl.config import from_agent_config, load_config
from foglab.tools import devfleet

ROOT = Path(__file__).resolve().parents[1]
SENSOR_MINUTES = ROOT / "examples" / "sensor-minutes"  # the README's own-operator example


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _exports(text: str) -> Dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            out[key] = shlex.split(value)[0]
    return out


# ---- the generated files, read by their own loaders ------------------------------------------------


def test_agent_toml_loads_with_the_agents_loader(tmp_path: Path) -> None:
    d = tmp_path / "dev"
    conf = _write(d / "n2" / "agent.toml", devfleet.agent_toml("n2", "dev", 41234, d, ["fog_example_ops.ops"]))
    cfg = load_agent_config(conf)
    assert (cfg.agent.node, cfg.agent.cluster) == ("n2", "dev")
    assert (cfg.mqtt.host, cfg.mqtt.port, cfg.mqtt.tls) == ("127.0.0.1", 41234, None)
    assert Path(cfg.agent.state_dir) == d / "n2" / "state"
    assert [Path(p) for p in cfg.agent.sink_dirs] == [d / "sink"]
    assert cfg.operators.modules == ("fog_example_ops.ops",)
    assert cfg.metrics.port == 0  # N agents on one machine cannot share a metrics port


def test_fogctl_toml_env_file_and_agent_toml_name_the_same_broker(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "dev"
    nodes = ("n1", "n2")
    for n in nodes:
        _write(d / n / "agent.toml", devfleet.agent_toml(n, "dev", 41234, d))
    _write(d / "fogctl.toml", devfleet.fogctl_toml(41234, "dev", d))
    env = _exports(devfleet.env_text(d, 41234, nodes))
    assert env == {"FOGCTL_CONFIG": str(d / "fogctl.toml"), "FOG_AGENT_CONFIG": str(d / "n1" / "agent.toml"),
                   "FOG_DEV_DIR": str(d), "FOG_DEV_PORT": "41234", "FOG_AGENT_SIGN_KEY": str(d / "admin-sign.key")}
    # fogctl with no flags, after `. DIR/env`
    by_env = load_config(env=env)
    assert (by_env.broker, by_env.cluster, by_env.cafile) == ("127.0.0.1:41234", "dev", None)
    # fogctl --agent-config n2/agent.toml: the same broker and cluster
    by_agent = load_config(env={}, agent_config=d / "n2" / "agent.toml")
    assert (by_agent.broker, by_agent.cluster) == (by_env.broker, by_env.cluster)
    # fog-agent deploy with no flags reads $FOG_AGENT_CONFIG
    monkeypatch.setenv("FOG_AGENT_CONFIG", env["FOG_AGENT_CONFIG"])
    deploy_cfg = load_agent_config(default_config_path())
    assert (deploy_cfg.mqtt.port, deploy_cfg.agent.cluster) == (41234, "dev")
    # `dev status` / `dev down` find the directory
    assert devfleet.default_dir(env) == d
    # the agents require the fleet's admin key, fogctl and `fog-agent deploy` sign with its private half
    assert deploy_cfg.security.admin_keys == (str(d / "admin-sign.key.pub"),)
    assert by_env.sign_key == env["FOG_AGENT_SIGN_KEY"] == str(d / "admin-sign.key")


def test_broker_conf_keeps_every_file_under_dir_and_stays_the_user(tmp_path: Path) -> None:
    text = devfleet.broker_conf(tmp_path, 41234, "alice")
    lines = dict(line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
                 and line.split(" ", 1)[0] in ("listener", "user", "persistence_location", "log_dest"))
    assert lines["listener"] == "41234 127.0.0.1"  # loopback only
    assert lines["user"] == "alice"  # as root, Mosquitto would otherwise become `mosquitto` and lose its log
    assert lines["persistence_location"] == f"{tmp_path}/broker/"
    assert lines["log_dest"] == f"file {tmp_path}/broker/mosquitto.log"


def test_default_dir_is_per_user_unless_named() -> None:
    assert devfleet.default_dir({"FOG_DEV_DIR": "/srv/x"}) == Path("/srv/x")
    assert devfleet.default_dir({}).name == f"fog-dev-{devfleet._user()}"


def test_fogctl_agent_config_maps_tls_and_names_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    s = from_agent_config(ROOT / "examples" / "agent.toml")
    assert s == {"broker": "127.0.0.1:8883", "cluster": "demo", "cafile": "/etc/fog-agent/tls/ca.crt",
                 "cert": "/etc/fog-agent/tls/client.crt", "key": "/etc/fog-agent/tls/client.key",
                 "insecure": False}
    from agent.cli.fogctl import main

    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("fogctl connected despite bad settings")

    conf = _write(tmp_path / "agent.toml", devfleet.agent_toml("n1", "dev", 41234, tmp_path))
    assert main(["--agent-config", str(conf), "--config", str(conf), "status"], connect=never) == 1
    assert "not both" in capsys.readouterr().err
    assert main(["--agent-config", str(tmp_path / "none.toml"), "status"], connect=never) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--agent-config" in err and "none.toml" in err
    _write(tmp_path / "bad.toml", "[agent]\nnode = 'n1'\n[mqtt]\nport = 'x'\n")
    assert main(["--agent-config", str(tmp_path / "bad.toml"), "status"], connect=never) == 1
    assert "[mqtt].port" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,says", [
    ({"agents": 0}, "--agents takes 1 to"),
    ({"cluster": "a/b"}, "--cluster"),
    ({"allow": ["os"]}, "standard library"),
])
def test_up_refuses_bad_input_before_writing_anything(tmp_path: Path, kwargs: Dict[str, Any], says: str) -> None:
    with pytest.raises(devfleet.DevError, match=says):
        devfleet.up(tmp_path / "dev", **kwargs)
    assert not (tmp_path / "dev").exists()


def test_up_and_purge_refuse_a_directory_that_is_not_a_dev_fleets(tmp_path: Path) -> None:
    _write(tmp_path / "mine" / "notes.txt", "keep me")
    with pytest.raises(devfleet.DevError, match="not empty and holds no dev fleet"):
        devfleet.up(tmp_path / "mine")
    with pytest.raises(devfleet.DevError, match="not removing it"):
        devfleet.down(tmp_path / "mine", purge=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---- the README's own-operator example, before any fleet ---------------------------------------------


def test_the_sensor_example_passes_its_offline_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m pytest examples/sensor-minutes`, the README's first step, run here."""
    import importlib

    monkeypatch.syspath_prepend(str(SENSOR_MINUTES))  # as pytest puts a test file's directory first
    mod = importlib.import_module("test_sensor_minutes")
    tests = [getattr(mod, n) for n in dir(mod) if n.startswith("test_")]
    assert len(tests) == 2
    for k, test in enumerate(tests):
        test(tmp_path / str(k))


def test_both_example_pipelines_pass_deploys_checks_with_the_env_files_settings(tmp_path: Path) -> None:
    """What `fog-agent deploy` checks first, after `. DIR/env`: the functions the agent.toml allows
    must import with the env file's PYTHONPATH (the agents'), and MQTT topics must be listed in
    `[pipeline] mqtt_topics` since the dev agents run signed pipelines only. Before either, the
    README's quickstart stopped at its deploy with four error lines."""
    d = tmp_path / "dev"
    conf = _write(d / "n1" / "agent.toml",
                  devfleet.agent_toml("n1", "dev", 41234, d, [devfleet.EXAMPLE_MODULE, "mysensors"]))
    agents = devfleet.agent_env({"PYTHONPATH": str(SENSOR_MINUTES)})
    env = _exports(devfleet.env_text(d, 41234, ("n1",), agents["PYTHONPATH"]))
    assert env["FOG_AGENT_CONFIG"] == str(conf)
    assert env["PYTHONPATH"].split(os.pathsep)[:3] == [str(ROOT), str(devfleet.EXAMPLE_OPS), str(SENSOR_MINUTES)]
    assert "admin_keys" in conf.read_text()  # signed pipelines only: mqtt_topics is required
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FOG_AGENT_CONFIG")}
    env["PYTHONPATH"] += os.pathsep + CHECKOUT_PATH  # the checkout's lab, as the venv has it
    for pipeline in (ROOT / "examples" / "operators" / "pipeline.toml", SENSOR_MINUTES / "pipeline.toml"):
        r = subprocess.run([sys.executable, "-m", "agent", "check-config", str(pipeline)], capture_output=True,
                           text=True, env=dict(base, **env), cwd=str(tmp_path), timeout=60)
        assert r.returncode == 0, r.stderr


# ---- live: up, fogctl status, the README's own pipeline, down ------------------------------------


def _dev(*argv: str) -> Dict[str, Any]:
    # the README's `export PYTHONPATH=$PWD/examples/sensor-minutes` (the venv has the checkout)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([CHECKOUT_PATH, str(SENSOR_MINUTES)]))
    r = subprocess.run([sys.executable, "-m", "agent", "dev", *argv, "--json"], capture_output=True, text=True,
                       env=env, cwd=str(ROOT), timeout=devfleet.ONLINE_BOUND + 60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_dev_fleet_of_two_is_seen_by_fogctl_and_down_leaves_no_process(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "dev"
    try:
        up = _dev("up", "--agents", "2", "--dir", str(d), "--allow", "mysensors")
        assert up["state"] == "up" and [n["node"] for n in up["nodes"]] == ["n1", "n2"]
        pids: List[int] = [up["broker_pid"]] + [n["pid"] for n in up["nodes"]]
        assert all(pids)
        fleet = devfleet.DevFleet.load(d)
        assert fleet is not None and all(fleet.running().values())  # they outlived `dev up`
        from agent.cli.fogctl import main

        capsys.readouterr()
        assert main(["--config", up["fogctl_config"], "--json", "status"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert {n["node"]: n["status"] for n in doc["nodes"]} == {"n1": "online", "n2": "online"}
        _the_readmes_sensor_pipeline(d, capsys)
        down = _dev("down", "--dir", str(d))
    finally:
        if d.exists():
            devfleet.down(d)
    assert down["left"] == [] and sorted(down["pids"]) == sorted(pids)
    assert [p for p in pids if devfleet._proc_stat(p) and devfleet._proc_stat(p)[0] not in "ZX"] == []
    assert devfleet._group_members(pids) == []  # no worker, fork server or broker left in their groups
    assert (d / "n1" / "agent.log").stat().st_size > 0 and (d / "broker" / "mosquitto.log").exists()  # logs stay


def _the_readmes_sensor_pipeline(d: Path, capsys: pytest.CaptureFixture) -> None:
    """README, "Your own operator": after `. DIR/env`, deploy (signed with the fleet's key, the
    checks with the agents' PYTHONPATH), the six readings, the first minute's two windows in
    the file sink under DIR/sink, undeploy."""
    import time

    import paho.mqtt.client as mqtt

    from agent.cli.fogctl import main as fogctl
    from agent.operators.filesink import read_lines

    env = _exports((d / "env").read_text())
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FOG_AGENT_CONFIG", "FOG_AGENT_SIGN_KEY")}
    r = subprocess.run([sys.executable, "-m", "agent", "deploy", str(SENSOR_MINUTES / "pipeline.toml"),
                        "--set", f"sink_dir={env['FOG_DEV_DIR']}/sink", "--json"], capture_output=True, text=True,
                       env=dict(base, **env), cwd=str(d), timeout=120)
    assert r.returncode == 0, r.stderr
    assert [k["operator"] for k in json.loads(r.stdout)["keepers"]] == ["readings", "clean", "minute", "out"]
    t0 = 1764000000
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="readme-sensors")
    pub.connect("127.0.0.1", int(env["FOG_DEV_PORT"]))
    pub.loop_start()
    for sensor, dt, temp in (("s1", 1, 20.0), ("s2", 2, 18.0), ("s1", 30, None), ("s1", 31, 23.0), ("s1", 61, 21.0),
                             ("s2", 66, 17.0)):
        body = json.dumps({"sensor": sensor, "t": t0 + dt, "temp": temp})
        pub.publish(f"lab/sensors/{sensor}/temperature", body, qos=1).wait_for_publish(5)
    pub.loop_stop()
    pub.disconnect()
    out = d / "sink" / "sensor_minutes.out.0"
    deadline = time.monotonic() + ONLINE_BOUND  # against a hang only: the windows come in about a second
    got: List[Any] = []
    while time.monotonic() < deadline and len(got) < 2:
        got = [rec for _, rec in read_lines(out)] if out.is_dir() else []
        time.sleep(0.1)
    minute = {"start": t0 * 1000, "end": (t0 + 60) * 1000}
    assert sorted(got, key=lambda r: r["key"]) == [dict(key="s1", **minute, mean_temp=21.5, max_temp=23.0),
                                                     dict(key="s2", **minute, mean_temp=18.0, max_temp=18.0)]
    capsys.readouterr()
    assert fogctl(["--config", env["FOGCTL_CONFIG"], "undeploy", "sensor_minutes"]) == 0, capsys.readouterr().err
