"""`fog-agent dev up|status|down` (lab/foglab/tools/devfleet.py) and `fogctl --agent-config`.

The generated files are checked with the loaders of the commands that read them (the agent's,
fogctl's, `fog-agent deploy`'s), without starting anything; one live test runs the CLI as a user
does: `dev up` exits with two agents still running, `fogctl status` sees both online, `dev down`
leaves no process of the fleet (pids and their process groups).
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

from agent_process import CHECKOUT_PATH
from agent.config import default_config_path, load_agent_config
from agent.fogctl.config import from_agent_config, load_config
from foglab.tools import devfleet

ROOT = Path(__file__).resolve().parents[1]


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


# ---- the README's quickstart, before any fleet ------------------------------------------------------


def test_the_example_pipeline_passes_deploys_checks_with_the_env_files_settings(tmp_path: Path) -> None:
    """What `fog-agent deploy` checks first, after `. DIR/env`: the functions the agent.toml allows
    must import with the env file's PYTHONPATH (the agents'), and MQTT topics must be listed in
    `[pipeline] mqtt_topics` since the dev agents run signed pipelines only. Before either, the
    README's quickstart stopped at its deploy with four error lines."""
    d = tmp_path / "dev"
    conf = _write(d / "n1" / "agent.toml",
                  devfleet.agent_toml("n1", "dev", 41234, d, [devfleet.EXAMPLE_MODULE]))
    agents = devfleet.agent_env({"PYTHONPATH": ""})
    env = _exports(devfleet.env_text(d, 41234, ("n1",), agents["PYTHONPATH"]))
    assert env["FOG_AGENT_CONFIG"] == str(conf)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(ROOT), str(devfleet.EXAMPLE_OPS)]
    assert "admin_keys" in conf.read_text()  # signed pipelines only: mqtt_topics is required
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FOG_AGENT_CONFIG")}
    env["PYTHONPATH"] += os.pathsep + CHECKOUT_PATH  # the checkout's lab, as the venv has it
    for pipeline in (ROOT / "examples" / "operators" / "pipeline.toml",):
        r = subprocess.run([sys.executable, "-m", "agent", "check-config", str(pipeline)], capture_output=True,
                           text=True, env=dict(base, **env), cwd=str(tmp_path), timeout=60)
        assert r.returncode == 0, r.stderr


# ---- live: up, fogctl status, down ----------------------------------------------------------------


def _dev(*argv: str) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    r = subprocess.run([sys.executable, "-m", "agent", "dev", *argv, "--json"], capture_output=True, text=True,
                       env=env, cwd=str(ROOT), timeout=devfleet.ONLINE_BOUND + 60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_dev_fleet_of_two_is_seen_by_fogctl_and_down_leaves_no_process(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "dev"
    try:
        up = _dev("up", "--agents", "2", "--dir", str(d))
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
        down = _dev("down", "--dir", str(d))
    finally:
        if d.exists():
            devfleet.down(d)
    assert down["left"] == [] and sorted(down["pids"]) == sorted(pids)
    assert [p for p in pids if devfleet._proc_stat(p) and devfleet._proc_stat(p)[0] not in "ZX"] == []
    assert devfleet._group_members(pids) == []  # no worker, fork server or broker left in their groups
    assert (d / "n1" / "agent.log").stat().st_size > 0 and (d / "broker" / "mosquitto.log").exists()  # logs stay
