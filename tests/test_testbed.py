"""The testbed (agent/tools/testbed.py): its plan without root, then a real two-container fleet.

The smoke test boots two Debian bookworm containers (systemd-nspawn, systemd as PID 1) on a bridge
of its own, runs `ansible/site.yml` against them over SSH with the .deb built from this checkout,
runs it again, and checks what a broken testbed, role or package would not give: the agent active
under systemd in both containers (READY=1 reached, its STATUS= line says connected), a control
request from one container answered by the agent of the other through the broker, and a second
run with changed=0. The debootstrapped root is cached (~/.cache/fog-agent/testbed/roots, built
once); everything else is removed by `down` at the end, which the last test checks.

Skipped only where containers cannot exist: not root, or no systemd-nspawn/debootstrap
(scripts/setup.sh installs them). Its times are in docs/operations.md ("Testbed").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator

import pytest
import yaml

from agent.tools import testbed
from agent.tools.testbed_systemd import parse_show

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_DIR = ROOT / "ansible"
BIN = Path(sys.executable).parent
PREFIX, BRIDGE, SUBNET = "tbt", "fogtbt0", "10.214.0"


# ---------------------------------------------------------------------------------------------
# The plan, without root.


def test_plan_names_addresses_and_bridge() -> None:
    plan = testbed.make_plan(4, "amd64", PREFIX, BRIDGE, SUBNET)
    assert [n.name for n in plan.nodes] == ["tbt1", "tbt2", "tbt3", "tbt4"]
    assert [n.address for n in plan.nodes] == [f"{SUBNET}.{i}" for i in (11, 12, 13, 14)]
    assert plan.host_address == f"{SUBNET}.1" and plan.bridge == BRIDGE and plan.broker.name == "tbt1"
    # 200 nodes still fit the /24 and never take the host's address.
    big = testbed.make_plan(testbed.MAX_NODES)
    addresses = [n.address for n in big.nodes]
    assert len(set(addresses)) == testbed.MAX_NODES and big.host_address not in addresses
    assert all(0 < int(a.rsplit(".", 1)[1]) < 255 for a in addresses)


@pytest.mark.parametrize("kwargs, word", [
    ({"n": 0}, "--nodes"), ({"n": testbed.MAX_NODES + 1}, "--nodes"), ({"n": 2, "arch": "mips"}, "--arch"),
    ({"n": 2, "prefix": "Fog-1"}, "prefix"), ({"n": 2, "bridge": "a-very-long-bridge-name"}, "bridge"),
    ({"n": 2, "subnet": "10.300.0"}, "subnet"),
])
def test_plan_refuses_bad_requests_with_one_line(kwargs: Dict[str, object], word: str) -> None:
    with pytest.raises(testbed.TestbedError) as err:
        testbed.make_plan(**kwargs)  # type: ignore[arg-type]
    assert word in str(err.value) and "\n" not in str(err.value)


def test_mirror_is_read_from_one_line_and_deb822_sources() -> None:
    deb822 = ("Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n\n"
              "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n")
    assert testbed.mirror_from_sources([deb822]) == "http://mirror.example/debian"
    one_line = "# comment\ndeb http://security.debian.org/ bookworm-security main\n" \
               "deb [arch=amd64 signed-by=/k.gpg] http://ftp.example/debian bookworm main\n"
    assert testbed.mirror_from_sources([one_line]) == "http://ftp.example/debian"
    assert testbed.mirror_from_sources(["", "# nothing\n"]) is None


def test_nspawn_boots_systemd_without_registering_on_the_bridge(tmp_path: Path) -> None:
    plan = testbed.make_plan(2, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET)
    argv = testbed.nspawn_argv(plan.nodes[1], tmp_path, plan.bridge)
    # The host has no system bus and no systemd as PID 1: without these two nspawn fails.
    assert {"--register=no", "--keep-unit", "--boot"} <= set(argv)
    assert f"--network-bridge={BRIDGE}" in argv and "--machine=tbt2" in argv
    assert f"--directory={tmp_path}" in argv
    unit = testbed.network_unit(plan.nodes[1], plan)
    assert "Name=host0" in unit and f"Address={SUBNET}.12/24" in unit


def test_inventory_lists_the_fleet_and_the_deb(tmp_path: Path) -> None:
    plan = testbed.make_plan(3, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET)
    pw = {"tbt1": "p1", "tbt2": "p2", "tbt3": "p3", "fogctl-admin": "pa"}
    text = testbed.inventory_yaml(plan, tmp_path / "key", tmp_path / "known", pw, tmp_path / "fog-agent_0.2.0_all.deb")
    inv = yaml.safe_load(text)["all"]
    assert list(inv["children"]["brokers"]["hosts"]) == ["tbt1"]
    assert inv["children"]["central"]["hosts"] == {}
    nodes = inv["children"]["fog_nodes"]["hosts"]
    assert {k: v["ansible_host"] for k, v in nodes.items()} == {n.name: n.address for n in plan.nodes}
    assert {k: v["fog_agent_mqtt_password"] for k, v in nodes.items()} == {"tbt1": "p1", "tbt2": "p2", "tbt3": "p3"}
    v = inv["vars"]
    assert v["fog_agent_install_method"] == "deb" and v["fog_agent_deb_src"].endswith("fog-agent_0.2.0_all.deb")
    assert v["fog_agent_mqtt_host"] == v["mosquitto_listener_address"] == f"{SUBNET}.11"
    assert {u["name"]: u["password"] for u in v["mosquitto_users"]} == pw
    assert "StrictHostKeyChecking=yes" in v["ansible_ssh_common_args"]
    assert str(tmp_path / "known") in v["ansible_ssh_common_args"]


def test_pipeline_step_needs_scaling_and_placement_is_read_per_node() -> None:
    from agent.config import load_pipeline_text
    from agent.tools.testbed_pipeline import pipeline_text, placement

    cfg = load_pipeline_text(pipeline_text(60.0, 500.0), "tb.toml")
    src, in_zone = cfg.operators[0], cfg.operators[2]
    steps = src.params["steps"]
    assert steps[-1] == [60.0, 0] and max(rate for _, rate in steps) == 500.0
    assert in_zone.name == "in_zone" and in_zone.scaling.capacity < 500.0  # one instance cannot keep up
    topo = {"pipelines": [{"pipeline": "other", "operators": [{"operator": "x", "instances": [{"node": "a"}]}]},
                          {"pipeline": "tb", "operators": [
                              {"operator": "in_zone", "instances": [{"node": "tbt1"}, {"node": "tbt2"}, {"node": "tbt2"}]},
                              {"operator": "sink", "instances": []}]}]}
    assert placement(topo, "tb") == {"in_zone": {"tbt1": 1, "tbt2": 2}, "sink": {}}


def test_chaos_sees_an_instance_on_the_dead_node_and_where_it_was_rehomed() -> None:
    from agent.tools.chaos_testbed import instance_nodes

    topo = {"pipelines": [{"pipeline": "tb", "operators": [
        {"operator": "in_zone", "instances": [{"id": "a", "node": "tbt2"}, {"id": "b", "node": "tbt3"},
                                              {"id": "a", "node": "tbt3"}]}]},  # a: dead tbt2's retained state + re-homed
        {"pipeline": "other", "operators": [{"operator": "x", "instances": [{"id": "c", "node": "tbt2"}]}]}]}
    assert instance_nodes(topo, "tb") == {"a": {"tbt2", "tbt3"}, "b": {"tbt3"}}


def test_parse_show() -> None:
    text = "Type=notify\nStatusText=connected; 0/4 slots used; a=b\nNRestarts=3\n"
    assert parse_show(text) == {"Type": "notify", "StatusText": "connected; 0/4 slots used; a=b", "NRestarts": "3"}


def test_up_refuses_without_root_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(testbed.TestbedError) as err:
        testbed.preflight("amd64")
    assert "root" in str(err.value) and "\n" not in str(err.value)
    out = subprocess.run([sys.executable, "-m", "agent", "testbed", "up", "--nodes", "0"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "--nodes 0" in out.stderr


def _fake_debootstrap(argv, what, log, progress, timeout, every=20.0) -> None:  # type: ignore[no-untyped-def]
    root = Path(argv[-2])
    for d in ("etc/ssh", "etc/apt/apt.conf.d"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/ssh_host_rsa_key").write_text("shared")
    _fake_debootstrap.calls.append(argv)  # type: ignore[attr-defined]


def test_root_is_built_once_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `make setup` (`fog-agent testbed root`) leaves is what `up` and the suite reuse: a root
    whose marker names its package list; another list, or no marker (an interrupted build), builds again."""
    _fake_debootstrap.calls = []  # type: ignore[attr-defined]
    monkeypatch.setattr(testbed, "_run_logged", _fake_debootstrap)
    root, built, _ = testbed.ensure_root(tmp_path, "amd64", progress=lambda line: None)
    assert built and len(_fake_debootstrap.calls) == 1  # type: ignore[attr-defined]
    assert root == testbed.root_dir(tmp_path, "amd64") and not (tmp_path / "roots" / "bookworm-amd64.tmp").exists()
    assert (root / testbed.ROOT_MARKER).read_text() == testbed.root_signature("amd64")
    assert not list((root / "etc/ssh").glob("ssh_host_*"))  # no host key shared by every node
    again, built_again, seconds = testbed.ensure_root(tmp_path, "amd64", progress=lambda line: None)
    assert (again, built_again, seconds) == (root, False, 0.0) and len(_fake_debootstrap.calls) == 1  # type: ignore[attr-defined]
    (root / testbed.ROOT_MARKER).write_text("bookworm amd64 an older list\n")
    assert testbed.ensure_root(tmp_path, "amd64", progress=lambda line: None)[1] is True


def test_debootstrap_progress_is_printed_and_a_failure_is_one_line(tmp_path: Path) -> None:
    lines: list = []
    script = "echo 'I: Retrieving Release'; sleep 0.7; echo 'I: Extracting base-files'; sleep 0.7"
    testbed._run_logged(["sh", "-c", script], "debootstrap", tmp_path / "log", lines.append, timeout=30, every=0.3)
    assert any("Retrieving Release" in ln or "Extracting base-files" in ln for ln in lines), lines
    assert all(ln.startswith("debootstrap: ") for ln in lines)
    with pytest.raises(testbed.TestbedError) as err:
        testbed._run_logged(["sh", "-c", "echo 'E: no route to the mirror'; exit 1"], "debootstrap",
                            tmp_path / "log2", lines.append, timeout=30)
    assert "no route to the mirror" in str(err.value) and str(tmp_path / "log2") in str(err.value)
    assert "\n" not in str(err.value)


def test_arm64_refusal_names_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testbed, "native_arch", lambda: "amd64")
    monkeypatch.setattr(testbed, "BINFMT_DIR", tmp_path / "binfmt_misc")
    monkeypatch.setattr(testbed, "BINFMT_CONF_DIR", tmp_path / "binfmt.d")
    assert not testbed.needs_emulation("amd64") and testbed.needs_emulation("arm64")
    why = testbed.emulation_missing("arm64")
    assert why and "apt-get install qemu-user-static" in why and "\n" not in why
    (tmp_path / "binfmt.d").mkdir()
    (tmp_path / "binfmt.d" / "qemu-aarch64.conf").write_text(":qemu-aarch64:M::x:y:/usr/bin/qemu-aarch64-static:F\n")
    if "binfmt_misc" in Path("/proc/filesystems").read_text():
        assert testbed.emulation_missing("arm64") is None  # can be registered
    else:
        assert "no binfmt_misc" in str(testbed.emulation_missing("arm64"))
    (tmp_path / "binfmt_misc").mkdir()
    for entry in ("register", "qemu-aarch64"):  # mounted, and the entry registered by someone else
        (tmp_path / "binfmt_misc" / entry).write_text("enabled\n")
    assert testbed.emulation_missing("arm64") is None  # registered already: nothing to do
    assert testbed.binfmt_setup("arm64", progress=lambda line: None) == testbed.Binfmt()  # and nothing to undo


def test_chaos_on_the_testbed_refuses_other_faults_and_a_missing_testbed(tmp_path: Path) -> None:
    env = dict(os.environ, FOG_TESTBED_CACHE=str(tmp_path))
    for faults, word in (("kill-worker", "subset of kill-node, partition"), ("kill-node", "no testbed")):
        out = subprocess.run([sys.executable, "-m", "agent", "chaos", "--testbed", "--faults", faults],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 1 and word in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_upgrade_refuses_without_a_testbed_and_relabels_only_debian_versions(tmp_path: Path) -> None:
    from agent.tools.testbed_upgrade import relabel_deb

    with pytest.raises(testbed.TestbedError, match="Debian version"):
        relabel_deb(tmp_path / "x.deb", "../evil", tmp_path)
    env = dict(os.environ, FOG_TESTBED_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "agent", "testbed", "upgrade", "--deb", str(tmp_path / "x.deb")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1 and "no testbed" in out.stderr and out.stderr.count("\n") == 1, out.stderr


# ---------------------------------------------------------------------------------------------
# A real fleet.

CAN_BOOT = os.geteuid() == 0 and shutil.which("systemd-nspawn") and shutil.which("debootstrap")
fleet_only = pytest.mark.skipif(
    not CAN_BOOT, reason="needs root with systemd-nspawn and debootstrap (apt-get install systemd-container "
                         "debootstrap; scripts/setup.sh does)")


def recap(output: str) -> Dict[str, Dict[str, int]]:
    m = re.search(r"PLAY RECAP \*+\n(.*?)(?:\n\n|\Z)", output, re.S)
    assert m, output[-3000:]
    return {line.split()[0]: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
            for line in m.group(1).strip().splitlines()}


class Fleet:
    def __init__(self, run: Path, result: testbed.UpResult, first: str, second: str) -> None:
        self.run, self.result, self.first, self.second = run, result, first, second

    def sh(self, node: str, line: str) -> str:
        return testbed.ssh(node, line, run=self.run).stdout


def build_deb(dist: Path) -> Path:
    """The .deb of this checkout. The wheelhouse is kept beside the cached root: build-wheelhouse.sh
    rebuilds it only when the sources changed, which saves pip's isolated wheel build on a warm run."""
    build = subprocess.run([str(ROOT / "packaging" / "build-deb.sh"), "--out", str(dist),
                            "--wheelhouse", str(testbed.cache_dir() / "wheelhouse"),
                            "--maintainer", "fog-agent tests <tests@example.org>"],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    return next(dist.glob("fog-agent_*_all.deb"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not CAN_BOOT:
        pytest.skip("needs root with systemd-nspawn and debootstrap")
    tmp = tmp_path_factory.mktemp("testbed")
    t0 = time.monotonic()
    deb = build_deb(tmp / "dist")
    times = {"build_deb_s": time.monotonic() - t0}
    run = tmp / "run"
    t0 = time.monotonic()
    result = testbed.up(2, "amd64", deb=deb, run=run, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET,
                        progress=lambda line: print(f"testbed: {line}", file=sys.stderr))
    times["testbed_up_s"] = time.monotonic() - t0
    try:
        env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"), ANSIBLE_HOME=str(tmp / "ansible-home"),
                   ANSIBLE_GATHERING="explicit", ANSIBLE_STDOUT_CALLBACK="default",
                   PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        env.pop("PYTHONPATH", None)
        # Both nodes in one batch: the rolling default (25%) would do them one after the other.
        cmd = [str(BIN / "ansible-playbook"), "-i", result.inventory, "site.yml", "-e", "fog_nodes_serial=2"]
        runs = []
        for k in (1, 2):
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=str(ANSIBLE_DIR), env=env, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
            runs.append(proc.stdout)
            times[f"ansible_run{k}_s"] = time.monotonic() - t0
        print("testbed fixture: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()), file=sys.stderr)
        yield Fleet(run, result, runs[0], runs[1])
    finally:
        testbed.down(run=run, progress=lambda line: None)


@fleet_only
@pytest.mark.timeout(1200)
def test_ansible_installs_the_deb_and_a_second_run_changes_nothing(fleet: Fleet) -> None:
    first, second = recap(fleet.first), recap(fleet.second)
    assert set(first) == set(second) == {"tbt1", "tbt2"}
    assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in (*first.values(), *second.values()))
    assert all(r["changed"] > 0 for r in first.values())
    assert all(r["changed"] == 0 for r in second.values()), fleet.second[-3000:]
    for node in ("tbt1", "tbt2"):
        # dpkg owns the agent: the package is installed and its versioned venv is the live one.
        status = fleet.sh(node, "dpkg-query -W -f='${Status} ${Version}' fog-agent; echo; readlink /opt/fog-agent/venv")
        assert status.startswith("install ok installed ") and "venvs/" in status


@fleet_only
@pytest.mark.timeout(300)
def test_agents_run_under_systemd_in_both_containers(fleet: Fleet) -> None:
    for node in ("tbt1", "tbt2"):
        assert fleet.sh(node, "cat /proc/1/comm").strip() == "systemd"
        s = parse_show(fleet.sh(node, "systemctl show -p Type,ActiveState,SubState,MainPID,StatusText,User "
                                      "fog-agent.service"))
        assert (s["Type"], s["ActiveState"], s["SubState"], s["User"]) == ("notify", "active", "running", "fog-agent")
        # STATUS= comes from the daemon's sd_notify: the unit is ready only after READY=1.
        assert s["StatusText"].startswith("connected"), s
        assert fleet.sh(node, f"cat /proc/{s['MainPID']}/comm").strip().startswith(("fog-agent", "python"))
    # The broker runs on the first node only.
    assert fleet.sh("tbt1", "systemctl is-active mosquitto").strip() == "active"
    assert testbed.ssh("tbt2", "systemctl is-active mosquitto", run=fleet.run, check=False).stdout.strip() != "active"


PING = """
import json, sys
from agent.fogctl.client import Connection
from agent.fogctl.config import FogctlConfig
cfg = FogctlConfig(broker=sys.argv[1], cluster="testbed", username="fogctl-admin", password=sys.argv[2], timeout=15)
with Connection(cfg) as conn:
    print(json.dumps(conn.rpc(sys.argv[3], {"op": "ping"})))
"""


@fleet_only
@pytest.mark.timeout(300)
def test_a_request_from_one_container_is_answered_by_the_agent_of_the_other(fleet: Fleet) -> None:
    """A round trip between containers through the broker on tbt1, with the package's own client."""
    state = testbed.load_state(run=fleet.run)
    assert state is not None and state.admin_password
    broker = f"{SUBNET}.11:1883"
    for src, dst in (("tbt1", "tbt2"), ("tbt2", "tbt1")):
        out = fleet.sh(src, f"/opt/fog-agent/venv/bin/python -c '{PING}' {broker} {state.admin_password} {dst}")
        reply = json.loads(out.strip().splitlines()[-1])
        assert reply["ok"] is True and reply["node"] == dst, (src, dst, out)
    # A wrong password is refused by the rendered broker: the round trip above was authenticated.
    bad = testbed.ssh("tbt2", f"/opt/fog-agent/venv/bin/python -c '{PING}' {broker} wrong tbt1", run=fleet.run,
                      check=False)
    assert bad.returncode != 0


@fleet_only
@pytest.mark.timeout(120)
def test_down_removes_everything_up_added(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-node testbed of its own (the fleet's is removed in the module teardown, after the tests)."""
    run = tmp_path / "run"
    testbed.up(1, "amd64", run=run, prefix="tbd", bridge="fogtbd0", subnet="10.215.0", progress=lambda line: None)
    state = testbed.load_state(run=run)
    assert state is not None
    pid = int(state.nodes[0]["pid"])  # type: ignore[arg-type]
    mount = str(state.nodes[0]["mount"])
    assert Path("/sys/class/net/fogtbd0").exists() and Path("/sys/class/net/vb-tbd1").exists()
    removed = testbed.down(run=run, progress=lambda line: None)
    assert "bridge fogtbd0" in removed and f"mount {mount}" in removed
    assert not Path("/sys/class/net/fogtbd0").exists() and not Path("/sys/class/net/vb-tbd1").exists()
    assert not testbed._is_nspawn(pid)  # gone (or a zombie of this process, with no command line)
    assert mount not in Path("/proc/self/mounts").read_text()
    assert not run.exists()
    # Again, with no state: nothing to remove, and no other testbed's bridge is touched (one named
    # like the default stands for a developer's testbed that is up meanwhile).
    monkeypatch.setattr(testbed, "BRIDGE", "fogtbdx")
    subprocess.run(["ip", "link", "add", "fogtbdx", "type", "bridge"], check=True)
    try:
        assert testbed.down(run=run, progress=lambda line: None) == []
        assert Path("/sys/class/net/fogtbdx").exists()
    finally:
        subprocess.run(["ip", "link", "del", "fogtbdx"], check=False)


@fleet_only
@pytest.mark.timeout(300)
def test_partition_and_power_cut_of_a_container(tmp_path: Path) -> None:
    """The chaos faults on a real node: a cut veth makes it unreachable until healed; a power cut
    stops it without a shutdown, and it boots again on the disk it had."""
    run = tmp_path / "run"
    testbed.up(1, "amd64", run=run, prefix="tbf", bridge="fogtbf0", subnet="10.216.0", progress=lambda line: None)
    try:
        def reachable() -> bool:
            return testbed.ssh("tbf1", "true", run=run, check=False, timeout=30).returncode == 0

        testbed.ssh("tbf1", "echo before > /root/mark && sync", run=run)
        pid1_start = "cut -d' ' -f22 /proc/1/stat"  # the container's init, in host clock ticks
        started_before = int(testbed.ssh("tbf1", pid1_start, run=run).stdout)
        testbed.partition("tbf1", cut=True, run=run)
        assert not reachable()
        testbed.partition("tbf1", cut=False, run=run)
        assert reachable()
        state = testbed.load_state(run=run)
        assert state is not None
        old_pid = int(state.nodes[0]["pid"])  # type: ignore[arg-type]
        testbed.kill_node("tbf1", run=run)
        assert not testbed._is_nspawn(old_pid) and not reachable()
        with pytest.raises(testbed.TestbedError):
            testbed.kill_node("tbf1", run=run)
        new_pid = testbed.start_node("tbf1", run=run)
        assert new_pid != old_pid and testbed._is_nspawn(new_pid)
        assert testbed.ssh("tbf1", "cat /root/mark", run=run).stdout.strip() == "before"
        assert testbed.ssh("tbf1", "cat /proc/1/comm", run=run).stdout.strip() == "systemd"
        assert int(testbed.ssh("tbf1", pid1_start, run=run).stdout) > started_before  # a new boot
    finally:
        testbed.down(run=run, progress=lambda line: None)
    assert not Path("/sys/class/net/fogtbf0").exists()
