"""The Ansible playbook, for real: lint (production profile), syntax check, then site.yml twice
against this machine (connection local) into a prefix with service management off (systemd is not
PID 1 here). The first run installs the agent venv from a wheelhouse built from this checkout and
renders configs (`fog-agent check-config` validates agent.toml inside the run); the second run must
report changed=0. The mosquitto role's rendered config then runs a real Mosquitto, and its ACL is
checked with real MQTT 5 clients.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
from pipelines import with_work

ROOT = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = ROOT / "ansible"
BIN = Path(sys.executable).parent
PLAYBOOK = BIN / "ansible-playbook"
LINT = BIN / "ansible-lint"
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
SYSTEM_PYTHON = "/usr/bin/python3"
CLUSTER = "t1"
PASSWORDS = {"n1": "pw-n1-secret", "n2": "pw-n2-secret", "central": "pw-central-secret"}

pytestmark = pytest.mark.skipif(not PLAYBOOK.exists(), reason="ansible-core is not installed in the venv")


def free_port() -> int:
    """A free port BELOW the kernel's ephemeral range. The broker binds it only after the
    playbook has run (a minute or more); a port the kernel handed out (bind to 0) could by then
    be the ephemeral port of another test's client or broker ("Address already in use", seen
    with three test processes), while one outside that range is taken only by a process that
    names it."""
    import random

    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {lo}")


def ansible_env(tmp: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(
        ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(ANSIBLE_DIR / "roles"),
        ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"),
        ANSIBLE_HOME=str(tmp / "ansible-home"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_STDOUT_CALLBACK="default",
        ANSIBLE_DEPRECATION_WARNINGS="0",
        ANSIBLE_PIPELINING="1",
        ANSIBLE_GATHERING="explicit",  # the roles use no facts: save three fact runs per play
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    env.pop("PYTHONPATH", None)  # the installed venv must work without this checkout on the path
    return env


def run(cmd: List[str], env: Dict[str, str], cwd: Path = ANSIBLE_DIR, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)


def changed_tasks(output: str) -> List[str]:
    """The TASK headers under which a host reported changed (for a readable failure)."""
    out, task = [], None
    for line in output.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            task = line.split("]")[0] + "]"
        elif line.startswith("changed:") and task:
            out.append(task)
    return out


def recap(output: str) -> Dict[str, int]:
    m = re.search(r"PLAY RECAP \*+\n(.*?)(?:\n\n|\Z)", output, re.S)
    assert m, output[-3000:]
    totals: Dict[str, int] = {}
    for line in m.group(1).strip().splitlines():
        for key, value in re.findall(r"(\w+)=(\d+)", line):
            totals[key] = totals.get(key, 0) + int(value)
    return totals


OPERATOR_MODULE = "fogtest_ops"
OPERATOR_SRC = """def double(rec):
    return rec * 2 if isinstance(rec, int) else rec


def upper(rec):
    return rec.upper() if isinstance(rec, str) else rec
"""


def operator_wheel(where: Path) -> Path:
    """A user's operator package as a wheel, built by hand (no index, no build backend): the
    module fogtest_ops and an entry point in the group fog_agent.operators."""
    import base64
    import hashlib
    import zipfile

    dist = "fogtest_ops-1.0.dist-info"
    files = {
        f"{OPERATOR_MODULE}.py": OPERATOR_SRC,
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: fogtest-ops\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_ops_ansible\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": f"[fog_agent.operators]\nfogtest_upper = {OPERATOR_MODULE}:upper\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    where.mkdir(parents=True, exist_ok=True)
    wheel = where / "fogtest_ops-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


@dataclass
class Deployment:
    prefix: Path
    port: int
    first: subprocess.CompletedProcess
    second: subprocess.CompletedProcess
    env: Dict[str, str]
    seconds: Tuple[float, float]
    inventory: Dict[str, object]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, ops_wheelhouse: Path) -> Deployment:
    check = subprocess.run([SYSTEM_PYTHON, "-c", "import venv, ensurepip, psutil"], capture_output=True)
    assert check.returncode == 0, "the role needs python3-venv and python3-psutil: apt-get install them"
    tmp = tmp_path_factory.mktemp("ansible")
    wheelhouse = ops_wheelhouse
    prefix = tmp / "prefix"
    port = free_port()
    wheel = operator_wheel(tmp / "operator-wheels")
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "fog_become": False,
                # mosquitto
                "mosquitto_prefix": str(prefix),
                "mosquitto_install_packages": False,
                "mosquitto_manage_service": False,
                "mosquitto_user": "root",
                "mosquitto_group": "root",
                # password users on the plain listener: the role's defaults are TLS on, plain off
                "mosquitto_listener_enabled": True,
                "mosquitto_tls_enabled": False,
                "mosquitto_listener_address": "127.0.0.1",
                "mosquitto_listener_port": port,
                "mosquitto_cluster": CLUSTER,
                "mosquitto_users": [{"name": k, "password": v} for k, v in PASSWORDS.items()],
                # the host is "fogtest", the node identities are the agents' user names
                "mosquitto_node_identities": ["n1", "n2"],
                "mosquitto_admin_users": ["central"],  # the deprecated alias of mosquitto_admin_identities
                "mosquitto_collector_identities": ["central"],
                "mosquitto_autosave_interval": 5,
                # fog_agent
                "fog_agent_prefix": str(prefix),
                "fog_agent_install_packages": False,
                "fog_agent_manage_user": False,
                "fog_agent_user": "root",
                "fog_agent_group": "root",
                "fog_agent_manage_service": False,
                "fog_agent_python": SYSTEM_PYTHON,
                "fog_agent_wheelhouse_src": str(wheelhouse),
                "fog_agent_node": "n1",
                "fog_agent_cluster": CLUSTER,
                "fog_agent_mqtt_port": port,
                "fog_agent_mqtt_password": PASSWORDS["n1"],
                "fog_agent_metrics_port": 0,
                "fog_agent_pipelines": [{"name": "taxi", "src": str(ROOT / "examples/pipeline.toml")}],
                "fog_agent_operator_wheels": [str(wheel)],
                "fog_agent_operator_modules": [OPERATOR_MODULE],
                "fog_agent_sink_dirs": [str(prefix / "srv/fog-sinks")],
                # fog_netem
                "fog_netem_enabled": True,
                "fog_netem_prefix": str(prefix),
                "fog_netem_manage_service": False,
                "fog_netem_load_module": True,
                "fog_netem_group": "root",
                "fog_netem_node": "n1",
                "fog_netem_device": "lo",
                "fog_netem_addresses": {"n1": "127.0.0.1", "n2": "127.0.0.2", "n3": "127.0.0.3"},
                "fog_netem_matrix": {"n1": {"n2": 20, "n3": {"delay": 40, "jitter": 2}}, "n2": {"n3": 10}},
                # fog_central
                "fog_central_prefix": str(prefix),
                "fog_central_install_packages": False,
                "fog_central_install_pyspark": False,
                "fog_central_install_agent": False,  # the fog_nodes play installs it on this same host
                "fog_central_manage_user": False,
                "fog_central_user": "root",
                "fog_central_group": "root",
                "fog_central_manage_service": False,
                "fog_central_cluster": CLUSTER,
                "fog_central_mqtt_port": port,
                "fog_central_mqtt_password": PASSWORDS["central"],
            },
            "children": {
                "brokers": {"hosts": {"fogtest": {}}},
                "central": {"hosts": {"fogtest": {}}},
                "fog_nodes": {"hosts": {"fogtest": {}}},
            },
        }
    }
    inv = tmp / "inventory.yml"
    inv.write_text(json.dumps(inventory))  # JSON is YAML
    env = ansible_env(tmp)
    cmd = [str(PLAYBOOK), "-i", str(inv), "site.yml"]
    t0 = time.monotonic()
    first = run(cmd, env)
    t1 = time.monotonic()
    assert first.returncode == 0, first.stdout[-6000:] + first.stderr[-3000:]
    (tmp / "first-run.log").write_text(first.stdout + first.stderr)
    second = run(cmd, env)
    t2 = time.monotonic()
    (tmp / "second-run.log").write_text(second.stdout + second.stderr)
    assert second.returncode == 0, second.stdout[-6000:] + second.stderr[-3000:]
    print(f"ansible site.yml: first run {t1 - t0:.1f}s, second run {t2 - t1:.1f}s")
    return Deployment(prefix, port, first, second, env, (t1 - t0, t2 - t1), inventory)


# ---- static checks ------------------------------------------------------------------------------


def test_ansible_lint_production_profile(tmp_path: Path) -> None:
    res = run([str(LINT), "--profile", "production", "--nocolor", "site.yml", "roles"], ansible_env(tmp_path))
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    assert "Profile 'production' was required, and it passed" in res.stdout + res.stderr


def test_syntax_check_with_the_example_inventory(tmp_path: Path) -> None:
    res = run([str(PLAYBOOK), "--syntax-check", "-i", "inventory/example/hosts.yml", "site.yml"],
              ansible_env(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr


def test_example_inventory_has_the_three_groups(tmp_path: Path) -> None:
    res = run([str(BIN / "ansible-inventory"), "-i", "inventory/example/hosts.yml", "--list"], ansible_env(tmp_path))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    for group in ("fog_nodes", "brokers", "central"):
        assert data[group]["hosts"], group


def test_the_client_id_secret_is_generated_once_on_the_control_node_and_the_same_for_every_node(tmp_path: Path) -> None:
    """docs/security.md, "Client ids": with fog_agent_mqtt_client_id_secret empty (the default),
    the role's own task generates the site secret into a 0600 file next to the inventory, gives
    every node the same one, reads it again on the next run, and agent.toml names the file."""
    import yaml

    tasks = yaml.safe_load((ANSIBLE_DIR / "roles/fog_agent/tasks/configure.yml").read_text())
    choose = next(t for t in tasks if t["name"] == "Choose the client id secret")
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles/fog_agent/defaults/main.yml").read_text())
    inv = tmp_path / "site"
    inv.mkdir()
    (inv / "hosts.yml").write_text(json.dumps({"all": {"hosts": {h: {"ansible_connection": "local"}
                                                                  for h in ("pi1", "pi2", "pi3")}}}))
    keys = ("fog_agent_mqtt_client_id_secret", "fog_agent_mqtt_client_id_secret_file",
            "fog_agent_mqtt_client_id_secret_generate", "fog_agent_config_dir")
    template = ANSIBLE_DIR / "roles/fog_agent/templates/agent.toml.j2"
    line = next(ln for ln in template.read_text().splitlines() if "client_id_secret" in ln and ln.startswith("{% if"))
    render = line + ' yes {% else %} no {% endif %}'
    play = [{"hosts": "all", "gather_facts": False, "vars": {k: defaults[k] for k in keys},
             "tasks": [choose, {"name": "Show", "ansible.builtin.debug": {
                 "msg": "{{ fog_agent_client_id_secret_value }} " + render}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    seen = []
    for _ in range(2):
        res = run([str(PLAYBOOK), "-i", str(inv / "hosts.yml"), str(tmp_path / "play.yml")], ansible_env(tmp_path),
                  cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        seen += re.findall(r'"msg": "([A-Za-z0-9]+) +(yes|no) *"', res.stdout)
    secret = (inv / "client-id.secret").read_text().strip()
    assert len(secret) == 32 and oct((inv / "client-id.secret").stat().st_mode & 0o777) == "0o600"
    assert seen == [(secret, "yes")] * 6, seen  # three nodes, two runs: one secret


def test_the_admin_signing_key_is_generated_once_on_the_control_node_and_only_its_public_half_copied(
        tmp_path: Path) -> None:
    """docs/security.md, "Signed pipeline specs": the role's own tasks generate one Ed25519 pair
    next to the inventory (private 0600) once for the site, copy only the public half to each node,
    and agent.toml names the copy in [security] admin_keys."""
    import yaml

    from agent import signing

    tasks = yaml.safe_load((ANSIBLE_DIR / "roles/fog_agent/tasks/configure.yml").read_text())
    names = ("Generate the admin signing key on the control node", "Derive the admin public key on the control node",
             "Copy the admin public key")
    picked = [{k: v for k, v in t.items() if k != "notify"} for t in tasks if t["name"] in names]
    assert [t["name"] for t in picked] == list(names)
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles/fog_agent/defaults/main.yml").read_text())
    keys = ("fog_agent_signed_specs", "fog_agent_admin_private_key_file", "fog_agent_admin_public_key_src",
            "fog_agent_admin_key_generate")
    inv = tmp_path / "site"
    inv.mkdir()
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    (inv / "hosts.yml").write_text(json.dumps({"all": {"hosts": {h: local for h in ("pi1", "pi2")}}}))
    template = (ANSIBLE_DIR / "roles/fog_agent/templates/agent.toml.j2").read_text()
    security = template[template.index("{% if fog_agent_signed_specs"):]
    security = security[:security.index("{% endif %}") + len("{% endif %}")]
    play = [{"hosts": "all", "gather_facts": False,
             "vars": dict({k: defaults[k] for k in keys}, fog_agent_group="root",
                          fog_agent_config_dir=str(tmp_path) + "/etc-{{ inventory_hostname }}"),
             "tasks": [{"name": "Create the configuration directory",
                        "ansible.builtin.file": {"path": "{{ fog_agent_config_dir }}", "state": "directory"}},
                       *picked,
                       {"name": "Render", "ansible.builtin.copy": {"content": security,
                                                                    "dest": "{{ fog_agent_config_dir }}/security.toml"}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    private = inv / "admin-sign.key"
    res = run([str(PLAYBOOK), "-i", str(inv / "hosts.yml"), str(tmp_path / "play.yml")], ansible_env(tmp_path),
              cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    # once for the site (run_once), and kept by every later run (creates: the files)
    assert all(t.get("run_once") is True for t in picked[:2])
    assert [t["ansible.builtin.shell"]["creates"] for t in picked[:1]] == ["{{ fog_agent_admin_private_key_file }}"]
    assert picked[1]["ansible.builtin.command"]["creates"] == "{{ fog_agent_admin_public_key_src }}"
    signer = signing.load_signer(private)
    for host in ("pi1", "pi2"):
        node = tmp_path / f"etc-{host}"
        assert not any(b"PRIVATE" in f.read_bytes() for f in node.iterdir()), list(node.iterdir())
        assert set(signing.load_verifier([node / "admin-sign.pub"]).keys) == {signer.key}
        from agent.schema import tomllib

        assert tomllib.loads((node / "security.toml").read_text())["security"]["admin_keys"] == [
            str(node / "admin-sign.pub")]


def test_every_agent_gets_the_slots_the_inventory_gives_each_node(tmp_path: Path) -> None:
    """docs/security.md: [security] node_slots lists every host of the fog_nodes group with its own
    fog_agent_slots (a node's state may offer no more), with or without signed specs; the rendered
    file is one valid agent.toml (a second [security] header would not load)."""
    import yaml

    from agent.config import load_agent_config

    defaults = yaml.safe_load((ANSIBLE_DIR / "roles/fog_agent/defaults/main.yml").read_text())
    inv = tmp_path / "site"
    inv.mkdir()
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    hosts = {"pi1": local, "pi2": dict(local, fog_agent_slots=2), "pi3": dict(local, fog_agent_node="pi-three")}
    (inv / "hosts.yml").write_text(json.dumps({"all": {"children": {"fog_nodes": {"hosts": hosts}}}}))
    template = ANSIBLE_DIR / "roles/fog_agent/templates/agent.toml.j2"
    play = [{"hosts": "pi1", "gather_facts": False,
             "vars": dict(defaults, fog_agent_config_dir=str(tmp_path), fog_agent_signed_specs="{{ signed }}"),
             "tasks": [{"name": "Render", "ansible.builtin.copy": {
                 "content": "{{ lookup('ansible.builtin.template', '" + str(template) + "') }}",
                 "dest": str(tmp_path) + "/agent-{{ signed }}.toml"}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    for signed in ("true", "false"):
        res = run([str(PLAYBOOK), "-i", str(inv / "hosts.yml"), str(tmp_path / "play.yml"), "-e", f"signed={signed}"],
                  ansible_env(tmp_path), cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        cfg = load_agent_config(tmp_path / f"agent-{signed}.toml")
        assert cfg.security.node_slots == {"pi1": 4, "pi2": 2, "pi-three": 4}, signed
        assert bool(cfg.security.admin_keys) is (signed == "true")


def test_roles_follow_the_node_exporter_layout() -> None:
    for role in ("mosquitto", "fog_agent", "fog_netem", "fog_central"):
        base = ANSIBLE_DIR / "roles" / role
        for part in ("defaults/main.yml", "meta/main.yml", "meta/argument_specs.yml", "handlers/main.yml",
                     "tasks/main.yml", "tasks/preflight.yml", "tasks/install.yml", "tasks/configure.yml"):
            assert (base / part).is_file(), f"{role}/{part}"
        defaults = (base / "defaults/main.yml").read_text()
        names = re.findall(r"^([a-z_][a-z0-9_]*):", defaults, re.M)
        assert names and all(n.startswith(role + "_") for n in names), (role, names)
        assert f"{role}_manage_service" in names
        # every default is declared in the argument spec
        spec = (base / "meta/argument_specs.yml").read_text()
        missing = [n for n in names if f"      {n}:" not in spec]
        assert not missing, (role, missing)
        # handlers are guarded by the role's *_manage_service
        handlers = (base / "handlers/main.yml").read_text()
        assert handlers.count("- name:") == handlers.count(f"{role}_manage_service | bool"), role


# ---- the real run -------------------------------------------------------------------------------


@pytest.mark.timeout(900)  # the two playbook runs happen in this test's set-up (slow on a loaded machine)
def test_first_run_changes_second_run_changes_nothing(deployed: Deployment) -> None:
    first, second = recap(deployed.first.stdout), recap(deployed.second.stdout)
    assert first["failed"] == 0 and first["unreachable"] == 0
    assert first["changed"] >= 10  # it really did the work the first time
    assert second["failed"] == 0
    assert second["changed"] == 0, changed_tasks(deployed.second.stdout)


def test_agent_installed_in_venv_and_config_accepted(deployed: Deployment) -> None:
    p = deployed.prefix
    venv = p / "opt/fog-agent/venv"
    env = dict(deployed.env)
    out = subprocess.run([str(venv / "bin/fog-agent"), "--version"], capture_output=True, text=True, env=env, cwd=str(p))
    assert out.returncode == 0, out.stderr
    from agent import __version__

    assert out.stdout.strip() == f"fog-agent {__version__}"
    where = subprocess.run([str(venv / "bin/python"), "-c", "import agent, paho.mqtt; print(agent.__file__)"],
                           capture_output=True, text=True, env=env, cwd=str(p))
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    conf = p / "etc/fog-agent/agent.toml"
    res = subprocess.run([str(venv / "bin/fog-agent"), "check-config", "--json", str(conf)],
                         capture_output=True, text=True, env=env, cwd=str(p))
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)
    assert cfg["agent"]["node"] == "n1" and cfg["agent"]["cluster"] == CLUSTER
    assert cfg["mqtt"]["port"] == deployed.port and cfg["mqtt"]["username"] == "n1"
    # the secret is in its own file, not in agent.toml
    assert PASSWORDS["n1"] not in conf.read_text()
    assert (p / "etc/fog-agent/mqtt-password").read_text().strip() == PASSWORDS["n1"]
    assert oct((p / "etc/fog-agent/mqtt-password").stat().st_mode & 0o777) == "0o640"
    pipe = p / "etc/fog-agent/pipelines/taxi.toml"
    assert subprocess.run([str(venv / "bin/fog-agent"), "check-config", str(pipe)], capture_output=True,
                          env=env, cwd=str(p)).returncode == 0




def test_operator_package_modules_and_sink_dirs(deployed: Deployment, tmp_path: Path) -> None:
    """The role installs a user's operator wheel into the agent's venv and renders `[operators]
    modules` and `[agent] sink_dirs` (docs/security.md, "No code from the bus"): the rendered
    agent.toml loads with agent.config, the installed agent allows the listed module's functions
    and the wheel's entry point and nothing else, and calibrates the module's function with it."""
    from agent.config import load_agent_config

    p = deployed.prefix
    venv = p / "opt/fog-agent/venv"
    conf = p / "etc/fog-agent/agent.toml"
    sinks = p / "srv/fog-sinks"
    cfg = load_agent_config(conf)
    assert cfg.operators.modules == (OPERATOR_MODULE,)
    assert cfg.agent.sink_dirs == (str(sinks),)
    assert sinks.is_dir() and oct(sinks.stat().st_mode & 0o777) == "0o750"
    dropin = (p / "etc/systemd/system/fog-agent.service.d/sink-dirs.conf").read_text()
    assert f"ReadWritePaths=-{sinks}\n" in dropin and "[Service]" in dropin
    env = dict(deployed.env)
    where = subprocess.run([str(venv / "bin/python"), "-c", f"import {OPERATOR_MODULE}; print({OPERATOR_MODULE}.__file__)"],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stdout + where.stderr
    pipe = tmp_path / "p.toml"
    for func, ok in ((f"{OPERATOR_MODULE}:double", True), (f"{OPERATOR_MODULE}:upper", True),
                     ("fogtest_other:run", False), ("builtins:exec", False)):
        pipe.write_text(with_work(func))
        res = subprocess.run([str(venv / "bin/fog-agent"), "check-config", str(pipe), "--agent-config", str(conf)],
                             capture_output=True, text=True, env=env, cwd=str(tmp_path))
        assert (res.returncode == 0) is ok, (func, res.stderr)
    assert f"entry points (fog_agent.operators): {OPERATOR_MODULE}:upper" in res.stderr, res.stderr
    pipe.write_text(with_work(f"{OPERATOR_MODULE}:double"))
    cal = subprocess.run([str(venv / "bin/fog-agent"), "calibrate", "--pipeline", str(pipe), "--operator", "work",
                          "--config", str(conf), "--dry-run", "--json", "--window", "0.05", "--start-rate", "100",
                          "--max-rate", "300"], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert cal.returncode == 0, cal.stderr
    assert json.loads(cal.stdout)["capacity"] > 0


def test_units_installed_verbatim(deployed: Deployment) -> None:
    units = deployed.prefix / "etc/systemd/system"
    for name in ("fog-agent.service", "fog-netem.service", "fog-collector.service",
                 "fog-analytics.service", "fog-analytics.timer"):
        assert (units / name).read_bytes() == (ROOT / "systemd" / name).read_bytes(), name
    assert (deployed.prefix / "etc/modules-load.d/fog-netem.conf").read_text() == "sch_netem\n"


def test_latency_matrix_rendered_from_inventory(deployed: Deployment) -> None:
    from agent.measure import netem
    matrix = netem.load_matrix(deployed.prefix / "etc/fog-agent/latency.toml")
    assert matrix.addresses == {"n1": "127.0.0.1", "n2": "127.0.0.2", "n3": "127.0.0.3"}
    assert matrix.devices.get("n1") == "lo"
    assert matrix.link("n1", "n2").delay_ms == 20
    assert matrix.link("n1", "n3").delay_ms == 40 and matrix.link("n1", "n3").jitter_ms == 2
    assert matrix.link("n2", "n3").delay_ms == 10
    # The unit's ExecStart, with the rendered netem.env, yields tc commands (dry run: no root needed).
    env_file = (deployed.prefix / "etc/fog-agent/netem.env").read_text()
    values = dict(line.split("=", 1) for line in env_file.splitlines() if line and not line.startswith("#"))
    assert values == {"FOG_NETEM_NODE": "n1", "FOG_NETEM_DEVICE": "lo"}
    unit = (ROOT / "systemd/fog-netem.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    argv = [a.replace("${FOG_NETEM_NODE}", values["FOG_NETEM_NODE"]).replace("${FOG_NETEM_DEVICE}", values["FOG_NETEM_DEVICE"])
            .replace("/etc/fog-agent", str(deployed.prefix / "etc/fog-agent"))
            .replace("/opt/fog-agent", str(deployed.prefix / "opt/fog-agent")) for a in exec_start.split()]
    res = subprocess.run(argv + ["--dry-run"], capture_output=True, text=True, env=deployed.env, cwd=str(deployed.prefix))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "127.0.0.2" in res.stdout and "127.0.0.3" in res.stdout and "dev lo" in res.stdout, res.stdout


def test_central_config_rendered(deployed: Deployment) -> None:
    from agent.schema import tomllib

    data = tomllib.loads((deployed.prefix / "etc/fog-agent/central.toml").read_text())
    assert data["collector"]["cluster"] == CLUSTER
    assert data["collector"]["landing_dir"] == str(deployed.prefix / "var/lib/fog-collector/landing")
    assert data["mqtt"]["username"] == "central" and data["mqtt"]["port"] == deployed.port
    assert data["analytics"]["enabled"] is False  # timer mode by default
    assert (deployed.prefix / "var/lib/fog-collector/landing").is_dir()


def test_fresh_node_check_mode_with_users_and_services_managed(deployed: Deployment, tmp_path: Path) -> None:
    """`--check --diff` against a fresh node with the real-target paths on (users, groups, units,
    handlers; only apt stays off): it must succeed. Before, systemd_service asked for the units
    that check mode had not installed, and fog_central's `include_role: fog_agent` brought a
    handler that restarts an agent unit the central host does not have. No systemd is PID 1
    here, so any service task or handler that is not skipped fails this run."""
    fresh = tmp_path / "prefix"
    text = json.dumps(deployed.inventory).replace(str(deployed.prefix), str(fresh))
    inv = json.loads(text)
    v = inv["all"]["vars"]
    for key in ("fog_agent_manage_user", "fog_agent_manage_service", "fog_netem_manage_service",
                "fog_central_manage_user", "fog_central_manage_service", "fog_central_install_agent"):
        v[key] = True
    for key in ("fog_agent_user", "fog_agent_group", "fog_netem_group", "fog_central_user", "fog_central_group"):
        v.pop(key)  # the real names: fog-agent, fog-collector (absent on this machine)
    inv["all"]["children"]["brokers"] = {"hosts": {}}
    path = tmp_path / "inventory.yml"
    path.write_text(json.dumps(inv))
    res = run([str(PLAYBOOK), "-i", str(path), "--check", "--diff", "site.yml"], deployed.env)
    out = res.stdout
    assert res.returncode == 0, out[-6000:] + res.stderr[-3000:]
    totals = recap(out)
    assert totals["failed"] == 0 and totals["changed"] >= 10
    assert not fresh.exists() or not any(fresh.rglob("*.service")), "check mode wrote files"
    # Every service task and handler was skipped (no unit installed), none ran.
    for header in ("Ensure the agent service is enabled and running", "Ensure the latency emulation is enabled",
                   "Ensure the collector is enabled and running"):
        block = out.split(header, 1)[1].split("\n", 1)[1].split("TASK [", 1)[0]
        assert block.strip().startswith("skipping:") and "ok:" not in block, (header, block)
    assert "RUNNING HANDLER [fog_agent : Restart fog-agent]" not in out or \
        "changed:" not in out.split("RUNNING HANDLER [fog_agent : Restart fog-agent]", 1)[1].split("TASK [", 1)[0]
    # fog_netem creates the agent's group before its first chgrp to it (it runs before fog_agent).
    play = out.index("PLAY [Configure the fog nodes]")
    order = [out.index("TASK [fog_netem : Create the group of the configuration files]", play),
             out.index("TASK [fog_netem : Create the configuration directory]", play),
             out.index("TASK [fog_agent : Create the service group]", play)]
    assert order == sorted(order), order


def test_fog_node_play_rolls_in_batches() -> None:
    """docs/operations.md, "Rolling changes": serial and max_fail_percentage on the fog node play,
    overridable with extra vars; the brokers and the centre are not rolled."""
    import yaml

    plays = {p["name"]: p for p in yaml.safe_load((ANSIBLE_DIR / "site.yml").read_text())}
    nodes = plays["Configure the fog nodes"]
    assert nodes["serial"] == "{{ fog_nodes_serial | default('25%') }}"
    assert nodes["max_fail_percentage"] == "{{ fog_nodes_max_fail_percentage | default(0) }}"
    assert [r["role"] for r in nodes["roles"]] == ["fog_netem", "fog_agent"]
    assert "serial" not in plays["Configure the MQTT brokers"]


def test_agent_role_restarts_once_per_change_and_reloads_a_log_level() -> None:
    """docs/operations.md, "One restart per change" (static, milliseconds; the behaviour was run
    against a stand-in systemctl, see there): the notified handlers run before the service is
    ensured started (a fresh node starts once), a restart suppresses a reload of the same run, the
    package install leaves the upgrade's restart to the handler (postinst would try-restart too),
    and agent.toml notifies the reload only when its `level` line is all that changed."""
    import yaml

    role = ANSIBLE_DIR / "roles/fog_agent"
    main = yaml.safe_load((role / "tasks/main.yml").read_text())
    names = [t["name"] for t in main]
    flush = next(i for i, t in enumerate(main) if t.get("ansible.builtin.meta") == "flush_handlers")
    assert flush == names.index("Ensure the agent service is enabled and running") - 1, names
    # a restart of an earlier play (before this config was rendered) does not stand in for a reload
    assert main[0]["ansible.builtin.set_fact"] == {"fog_agent_restarted": False}

    handlers = yaml.safe_load((role / "handlers/main.yml").read_text())
    assert [h["name"] for h in handlers] == ["Restart fog-agent", "Note that fog-agent restarted", "Reload fog-agent"]
    assert handlers[1]["listen"] == "Restart fog-agent" and handlers[1]["ansible.builtin.set_fact"]
    assert handlers[2]["ansible.builtin.systemd_service"]["state"] == "reloaded"
    assert "not (fog_agent_restarted | default(false) | bool)" in handlers[2]["when"]

    installs = [t for t in yaml.safe_load((role / "tasks/install.yml").read_text())
                if "deb" in t.get("ansible.builtin.apt", {}) or "dpkg" in t.get("ansible.builtin.command", {}).get("argv", [])]
    assert len(installs) == 2 and all(t["environment"] == {"FOG_AGENT_POSTINST_RESTART": "no"} for t in installs)
    postinst = (ROOT / "packaging/deb/postinst").read_text()
    assert '"${FOG_AGENT_POSTINST_RESTART:-yes}" = no' in postinst

    configure = {t["name"]: t for t in yaml.safe_load((role / "tasks/configure.yml").read_text())}
    render = configure["Render the agent configuration"]
    assert render["notify"] == "{{ (fog_agent_config_reload_only | bool) | ternary('Reload fog-agent', 'Restart fog-agent') }}"
    assert render["vars"]["fog_agent_config_level_line"] == "(?m)^level = .*$"
    # `level` is the one key of that name in the template, and it is [log]'s (what SIGHUP applies).
    template = (role / "templates/agent.toml.j2").read_text()
    assert re.findall(r"^\[[^\]]+\]$|^level = ", template, re.M).count("level = ") == 1
    assert re.search(r"^\[log\]\nlevel = ", template, re.M)
    # every other configuration task that notifies restarts
    others = [t for n, t in configure.items() if "notify" in t and n != "Render the agent configuration"]
    assert others and all(t["notify"] == "Restart fog-agent" for t in others)


def test_agent_role_gates_the_next_batch_on_the_restarted_node() -> None:
    """docs/operations.md, "Health gate between batches" (static, milliseconds): the snapshot of
    what the node hosts is taken before the handlers can restart the agent, the wait comes after
    the service is ensured running, runs only after a restart this run made, passes the role's
    timeout and the snapshot, and may fail (no failed_when) so that max_fail_percentage stops the
    rollout; neither task runs in check mode. The verdict itself: tests/test_rollout_gate.py."""
    import yaml

    role = ANSIBLE_DIR / "roles/fog_agent"
    main = yaml.safe_load((role / "tasks/main.yml").read_text())
    names = [t["name"] for t in main]
    snap_i = names.index("Note what the agent hosts before a restart")
    wait_i = names.index("Wait until the restarted agent is online with its instances back")
    flush = next(i for i, t in enumerate(main) if t.get("ansible.builtin.meta") == "flush_handlers")
    assert snap_i < flush < names.index("Ensure the agent service is enabled and running") < wait_i, names
    snap, wait = main[snap_i], main[wait_i]
    assert snap["ansible.builtin.command"]["argv"][1:3] == ["rollout-gate", "snapshot"]
    assert snap["failed_when"] is False and snap["changed_when"] is False
    assert snap["register"] == "fog_agent_gate_snapshot"
    argv = wait["ansible.builtin.command"]["argv"]
    assert argv[1:3] == ["rollout-gate", "wait"]
    assert argv[argv.index("--timeout") + 1] == "{{ fog_agent_health_gate_timeout }}"
    assert "fog_agent_gate_snapshot.stdout" in argv[argv.index("--snapshot") + 1]
    assert argv[argv.index("--node") + 1] == "{{ fog_agent_node }}"
    assert "failed_when" not in wait and wait["changed_when"] is False
    assert "fog_agent_restarted | default(false) | bool" in wait["when"]
    for task in (snap, wait):
        assert "not ansible_check_mode" in task["when"] and "fog_agent_health_gate | bool" in task["when"]
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text())
    assert defaults["fog_agent_health_gate"] is True and defaults["fog_agent_health_gate_timeout"] == 300
    specs = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert specs["fog_agent_health_gate_timeout"]["type"] == "int"
    # the gate is only a gate if a failed node stops the rollout
    plays = {p["name"]: p for p in yaml.safe_load((ANSIBLE_DIR / "site.yml").read_text())}
    assert "default(0)" in plays["Configure the fog nodes"]["max_fail_percentage"]


def test_agent_role_installs_the_version_it_is_given() -> None:
    """docs/operations.md, "Version-driven install" (static; the behaviour with dpkg and apt is
    scripts/check-role-versions.sh): fog_agent_deb_dir + fog_agent_version name the package, a
    lower version is allowed (rollback), and a host that already has the version is left alone
    (the package tasks are gated by the installed version, not by the copy on the host)."""
    import yaml

    role = ANSIBLE_DIR / "roles/fog_agent"
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text())
    assert defaults["fog_agent_deb_dir"] == ""
    assert "fog_agent_deb_dir ~ '/fog-agent_' ~ fog_agent_version ~ '_all.deb'" in defaults["fog_agent_deb_src"]
    tasks = {t["name"]: t for t in yaml.safe_load((role / "tasks/install.yml").read_text())}
    assert tasks["Read the version of the installed package"]["check_mode"] is False
    assert tasks["Install the package"]["ansible.builtin.apt"]["allow_downgrade"] is True
    for name in ("Copy the package to the host", "Install the package", "Reinstall the package when it changed"):
        assert "fog_agent_deb_wanted | bool" in tasks[name]["when"], name
    preflight = (role / "tasks/preflight.yml").read_text()
    assert "fog_agent_version | regex_escape" in preflight  # 0.2.0+up1: '+' is not a regex operator


# ---- the rendered broker, for real --------------------------------------------------------------


@pytest.fixture(scope="module")
def broker(deployed: Deployment) -> Iterator[Deployment]:
    conf = deployed.prefix / "etc/mosquitto/mosquitto.conf"
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", deployed.port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log = deployed.prefix / "var/log/mosquitto/mosquitto.log"
                pytest.fail("mosquitto did not start with the rendered config:\n"
                            + (proc.stderr.read().decode() if proc.stderr else "")
                            + (log.read_text() if log.exists() else ""))
            time.sleep(0.05)
    try:
        yield deployed
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Client:
    """A paho MQTT 5 client that records what it receives and the PUBACK reason codes."""

    def __init__(self, port: int, user: str, password: str) -> None:
        import paho.mqtt.client as mqtt

        self.received: List[Tuple[str, bytes]] = []
        self.pubacks: Dict[int, int] = {}
        self.connected = threading.Event()
        self.connect_rc = None
        self.subscribed = threading.Event()
        self.lock = threading.Lock()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-{user}-{os.getpid()}",
                             protocol=mqtt.MQTTv5)
        self.c.username_pw_set(user, password)
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.c.on_publish = self._on_publish
        self.c.on_subscribe = lambda *a: self.subscribed.set()
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connect_rc = reason_code
        self.connected.set()

    def _on_message(self, client, userdata, msg) -> None:
        with self.lock:
            self.received.append((msg.topic, msg.payload))

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        with self.lock:
            self.pubacks[mid] = reason_code.value

    def wait_connected(self) -> bool:
        assert self.connected.wait(5), "no CONNACK"
        return not self.connect_rc.is_failure

    def publish(self, topic: str, payload: bytes) -> int:
        info = self.c.publish(topic, payload, qos=1)
        assert info.rc == 0, info.rc
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self.lock:
                if info.mid in self.pubacks:
                    return self.pubacks[info.mid]
            time.sleep(0.01)
        raise AssertionError(f"no PUBACK for {topic}")

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_rendered_broker_acl_denies_writes_to_another_nodes_topics(broker: Deployment) -> None:
    from agent import topics

    port = broker.port
    admin = Client(port, "central", PASSWORDS["central"])
    n1 = Client(port, "n1", PASSWORDS["n1"])
    try:
        assert admin.wait_connected() and n1.wait_connected()
        admin.c.subscribe("fog/#", qos=1)
        assert admin.subscribed.wait(5)

        # docs/security.md: a node writes its own records and the shared topics; control requests
        # (rpc) come only from admins, pipelines only from admins
        foreign = [topics.agent_state(CLUSTER, "n2"), topics.agent_status(CLUSTER, "n2"),
                   topics.latency(CLUSTER, "n2"), topics.spill(CLUSTER, "n2") + "/chunk",
                   f"fog/{CLUSTER}/agents/n2/rpc/n1", f"fog/{CLUSTER}/agents/n2/peer/n2", f"fog/{CLUSTER}/pipelines/x",
                   topics.inbox_at(CLUSTER, "n2", "in_zone-3", "n2"),
                   topics.inbox(CLUSTER, "in_zone-3", "n1")]  # the shared format of before: per-node is on
        own_or_shared = [topics.agent_state(CLUSTER, "n1"), topics.latency(CLUSTER, "n1"),
                         topics.inbox_at(CLUSTER, "n2", "in_zone-3", "n1"), topics.events(CLUSTER)]
        denied_codes = [n1.publish(t, b"forged") for t in foreign]
        allowed_codes = [n1.publish(t, b"ok") for t in own_or_shared]
        # A positive control last: once it arrived, everything published before it has been routed.
        assert n1.publish(topics.events(CLUSTER), b"marker") in (0, 16)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (topics.events(CLUSTER), b"marker") not in admin.received:
            time.sleep(0.02)
        got = {t for t, _ in admin.received}
        assert not got & set(foreign), f"forged messages were delivered: {got & set(foreign)}"
        assert set(own_or_shared) <= got, f"allowed topics missing: {set(own_or_shared) - got}"
        # MQTT 5: the broker says so in the PUBACK (135 = not authorized).
        assert all(code == 135 for code in denied_codes), denied_codes
        assert all(code in (0, 16) for code in allowed_codes), allowed_codes
    finally:
        admin.close()
        n1.close()


def test_rendered_broker_rejects_bad_and_anonymous_credentials(broker: Deployment) -> None:
    bad = Client(broker.port, "n1", "wrong")
    try:
        assert bad.wait_connected() is False
    finally:
        bad.close()


def test_rendered_broker_has_explicit_queue_limits_and_persistence(deployed: Deployment) -> None:
    conf = (deployed.prefix / "etc/mosquitto/mosquitto.conf").read_text()
    assert re.search(r"^max_queued_messages 100000$", conf, re.M)
    assert re.search(r"^max_queued_bytes 67108864$", conf, re.M)  # bounded (docs/security.md, broker limits)
    assert re.search(r"^max_packet_size 1048576$", conf, re.M)
    assert re.search(r"^listener \d+ 127\.0\.0\.1$", conf, re.M)
    assert re.search(r"^persistence true$", conf, re.M)
    assert re.search(r"^allow_anonymous false$", conf, re.M)
    passwd = (deployed.prefix / "etc/mosquitto/fog.passwd").read_text()
    assert all(pw not in passwd for pw in PASSWORDS.values())  # hashed, never in clear
    assert passwd.count("$7$101$") == len(PASSWORDS)


def test_installed_agent_runs_against_the_rendered_broker(broker: Deployment, tmp_path: Path) -> None:
    """The deployed pieces fit together: the agent from the venv, with the rendered agent.toml and
    its password file, passes the rendered ACL (retained online status and state as node n1) and
    tells systemd it is ready."""
    from agent import topics

    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    p = broker.prefix
    env = dict(broker.env, NOTIFY_SOCKET=str(sock_path))
    agent = subprocess.Popen([str(p / "opt/fog-agent/venv/bin/fog-agent"), "run", "--config", str(p / "etc/fog-agent/agent.toml")],
                             stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))
    admin = Client(broker.port, "central", PASSWORDS["central"])
    try:
        got: List[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("READY=1" in g for g in got):
            try:
                got.append(sock.recv(4096).decode())
            except socket.timeout:
                assert agent.poll() is None, (tmp_path / "agent.log").read_text()
        assert any("READY=1" in g for g in got), (tmp_path / "agent.log").read_text()[-3000:]
        assert admin.wait_connected()
        admin.c.subscribe([(topics.agent_status(CLUSTER, "n1"), 1), (topics.agent_state(CLUSTER, "n1"), 1)])
        deadline = time.monotonic() + 10
        want = {topics.agent_status(CLUSTER, "n1"), topics.agent_state(CLUSTER, "n1")}
        while time.monotonic() < deadline and not want <= {t for t, _ in admin.received}:
            time.sleep(0.05)
        received = dict(admin.received)
        assert received.get(topics.agent_status(CLUSTER, "n1")) == b"online", received
        assert json.loads(received[topics.agent_state(CLUSTER, "n1")])["node"] == "n1"
        agent.send_signal(15)
        assert agent.wait(timeout=20) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        admin.close()
        sock.close()
