"""The testbed (lab/foglab/tools/testbed.py): its plan without root, then a real two-container fleet.

The smoke test boots two Debian bookworm containers (systemd-nspawn, systemd as PID 1) on a bridge
of its own, runs `ansible/site.yml` against them over SSH with the .deb built from this checkout,
runs it again, and checks what a broken testbed, role or package would not give: the agent active
under systemd in both containers (READY=1 reached, its STATUS= line says connected), a control
request from one container answered by the agent of the other through the broker, and a second
run with changed=0. Then the node faults on the second container (partition, power cut, wiped
disk). The debootstrapped root is cached (~/.cache/fog-agent/testbed/roots, built once);
everything else is removed by `down`, which the last fleet test runs and checks from the host's
/proc, mount table and links (the module teardown's `down` then finds nothing).

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
from typing import Dict, Iterator, List, Optional, Set

import pytest
import yaml

from foglab.tools import testbed
from foglab.tools.testbed_systemd import parse_show

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


def test_the_during_commands_output_is_kept_in_the_given_log(tmp_path: Path) -> None:
    """`testbed pipeline --during CMD`: what CMD prints (a rolling playbook's failure) is kept, not
    sent to /dev/null."""
    import time

    from foglab.tools.testbed_pipeline import _During

    side = _During("echo upgraded; echo failed >&2; exit 3", tmp_path / "during.log")
    deadline = time.monotonic() + 10
    while side.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert side.poll() == 3
    assert (tmp_path / "during.log").read_text().splitlines() == ["upgraded", "failed"]


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
    from foglab.tools.testbed_pipeline import pipeline_text, placement

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
    from foglab.tools.chaos_testbed import instance_nodes

    topo = {"pipelines": [{"pipeline": "tb", "operators": [
        {"operator": "in_zone", "instances": [{"id": "a", "node": "tbt2"}, {"id": "b", "node": "tbt3"},
                                              {"id": "a", "node": "tbt3"}]}]},  # a: dead tbt2's retained state + re-homed
        {"pipeline": "other", "operators": [{"operator": "x", "instances": [{"id": "c", "node": "tbt2"}]}]}]}
    assert instance_nodes(topo, "tb") == {"a": {"tbt2", "tbt3"}, "b": {"tbt3"}}


def test_a_kill_node_stays_off_past_the_fleets_own_dead_after() -> None:
    """With the role's default dead_after (60 s) a fixed 40 s off would never re-home anything."""
    from foglab.tools.chaos_testbed import kill_node_down

    assert kill_node_down(None, "60.0") == 85.0
    assert kill_node_down(None, "15.0") == 40.0 and kill_node_down(None, "") == 40.0
    assert kill_node_down(30.0, "60.0") == 30.0  # given: as given


def test_parse_show() -> None:
    text = "Type=notify\nStatusText=connected; 0/4 slots used; a=b\nNRestarts=3\n"
    assert parse_show(text) == {"Type": "notify", "StatusText": "connected; 0/4 slots used; a=b", "NRestarts": "3"}


def test_the_disk_under_a_process_root_is_read_from_its_mountinfo() -> None:
    """How the host finds a container's processes (its init outlives nspawn, in a session of its
    own): the overlay mounted on "/" in the process's mountinfo names the node's upper directory."""
    container = ("102 82 0:40 / / rw,relatime shared:1 - overlay overlay rw,lowerdir=/c/roots/bookworm-amd64,"
                 "upperdir=/r/machines/tbt2/upper,workdir=/r/machines/tbt2/work,uuid=on\n"
                 "103 102 0:41 / /proc rw,nosuid - proc proc rw\n")
    assert testbed.root_upperdir(container) == "/r/machines/tbt2/upper"
    host = ("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
            "90 27 0:40 / /r/machines/tbt2/root rw - overlay overlay rw,lowerdir=/c,upperdir=/r/machines/tbt2/upper\n")
    assert testbed.root_upperdir(host) is None  # the overlay is mounted elsewhere, not under "/"
    stacked = host + "120 27 0:50 / / rw - overlay overlay rw,lowerdir=/a,upperdir=/b/upper,workdir=/b/work\n"
    assert testbed.root_upperdir(stacked) == "/b/upper"  # the last mount on "/" is the one seen
    assert testbed.root_upperdir("") is None


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
    from foglab.tools.testbed_upgrade import relabel_deb

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


def _live_pids() -> Iterator[int]:
    """The host's processes that are not zombies (an exited process waiting for its parent; the
    PID 1 of some hosts never reaps orphans, and a zombie holds nothing)."""
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat and stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X"):
            yield int(entry)


def _pid_ns(pid: int) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


HOST_PID_NS = _pid_ns(os.getpid())


def machine_processes(hostnames: Set[str]) -> Dict[int, str]:
    """{pid: pid namespace} of the live processes below the host's PID namespace whose root file
    system says it is one of these machines (/proc/PID/root/etc/hostname): independent of how the
    testbed itself finds them (the overlay named in their mountinfo)."""
    found = {}
    for pid in _live_pids():
        ns = _pid_ns(pid)
        if ns is None or ns == HOST_PID_NS:
            continue
        try:
            name = Path(f"/proc/{pid}/root/etc/hostname").read_text().strip()
        except OSError:
            continue
        if name in hostnames:
            found[pid] = ns
    return found


def machine_inits(hostname: str) -> List[int]:
    """PID 1 of each PID namespace running this machine: more than one is two boots on one disk."""
    inits = []
    for pid in machine_processes({hostname}):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
        if len(nspid) > 1 and nspid[-1] == "1":
            inits.append(pid)
    return inits


SEEN_PID_NS: Set[str] = set()  # every container PID namespace the fleet had: none may outlive down


@fleet_only
@pytest.mark.timeout(300)
def test_partition_power_cut_and_wipe_of_a_node(fleet: Fleet) -> None:
    """The chaos faults on tbt2 of the fleet (no fleet of its own: one kill/start cycle, then a
    kill --wipe/start cycle). A cut veth makes it unreachable until healed. A power cut ends every
    process of its PID namespace at once (the container's systemd too, which a signal to nspawn's
    process group missed: it kept running and the next start booted a second one on the same
    disk); the next start boots exactly one init on the disk it had, with the file synced before
    the cut; a wipe loses the disk, and start boots the root image with only the testbed's
    identity on it (the agent the playbook installed is gone)."""
    node, times = "tbt2", {}
    state = testbed.load_state(run=fleet.run)
    assert state is not None
    upper = Path(str(testbed._node_entry(state, node)["mount"])).parent / "upper"

    def reachable() -> bool:
        return testbed.ssh(node, "true", run=fleet.run, check=False, timeout=30).returncode == 0

    testbed.partition(node, cut=True, run=fleet.run)
    assert not reachable()
    testbed.partition(node, cut=False, run=fleet.run)
    assert reachable()

    fleet.sh(node, "echo before > /root/mark && sync")
    boot_time = "cut -d' ' -f22 /proc/1/stat"  # the container's init, in host clock ticks
    started_before = int(fleet.sh(node, boot_time))
    machine_id = fleet.sh(node, "cat /etc/machine-id").strip()
    inits = machine_inits(node)
    assert len(inits) == 1, inits
    old_nspawn = int(testbed._node_entry(state, node)["pid"])  # type: ignore[arg-type]
    namespace = machine_processes({node})[inits[0]]
    SEEN_PID_NS.add(namespace)
    t0 = time.monotonic()
    cut = testbed.kill_node(node, run=fleet.run)
    times["kill_s"] = time.monotonic() - t0
    assert [pid for pid in _live_pids() if _pid_ns(pid) == namespace] == []  # the whole machine, at once
    assert machine_processes({node}) == {} and not testbed._is_nspawn(old_nspawn)
    assert not cut.wiped and cut.processes >= 5  # systemd, journald, networkd, logind, sshd, the agent, ...
    assert not Path(f"/sys/class/net/vb-{node}").exists() and not reachable()
    with pytest.raises(testbed.TestbedError, match="not running"):
        testbed.kill_node(node, run=fleet.run)

    t0 = time.monotonic()
    new_nspawn = testbed.start_node(node, run=fleet.run)
    times["start_s"] = time.monotonic() - t0
    assert new_nspawn != old_nspawn and testbed._is_nspawn(new_nspawn)
    inits = machine_inits(node)
    assert len(inits) == 1, inits  # one boot on the disk
    SEEN_PID_NS.add(machine_processes({node})[inits[0]])
    with pytest.raises(testbed.TestbedError, match="is running"):
        testbed.start_node(node, run=fleet.run)
    assert fleet.sh(node, "cat /root/mark").strip() == "before"  # the disk survived the cut
    assert fleet.sh(node, "cat /proc/1/comm").strip() == "systemd"
    assert int(fleet.sh(node, boot_time)) > started_before  # a new boot

    fleet.sh(node, "echo gone > /root/lost && sync")
    t0 = time.monotonic()
    cut = testbed.kill_node(node, run=fleet.run, wipe=True)
    times["kill_wipe_s"], times["of_which_cut_s"], times["of_which_wipe_s"] = (
        time.monotonic() - t0, cut.seconds, cut.wipe_seconds)
    assert cut.wiped and machine_processes({node}) == {} and list(upper.iterdir()) == []
    t0 = time.monotonic()
    testbed.start_node(node, run=fleet.run)
    times["start_fresh_s"] = time.monotonic() - t0
    assert len(machine_inits(node)) == 1
    SEEN_PID_NS.update(machine_processes({node}).values())
    # A fresh machine: the testbed's identity (reached with the fleet's key, its new host key
    # checked through known_hosts), nothing of before, no agent until the playbook runs again.
    assert fleet.sh(node, "hostname").strip() == node
    assert fleet.sh(node, "cat /etc/machine-id").strip() != machine_id
    assert fleet.sh(node, "ls /root/mark /root/lost 2>/dev/null || true").strip() == ""
    assert testbed.ssh(node, "dpkg-query -W fog-agent", run=fleet.run, check=False).returncode != 0
    print("power cut on the fleet: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()), file=sys.stderr)


@fleet_only
@pytest.mark.timeout(120)
def test_down_leaves_no_process_mount_or_link_behind(fleet: Fleet) -> None:
    """The fleet's `down` (what the module teardown runs; then it has nothing left to do): no
    nspawn of the run, no live process in any container PID namespace the fleet had or on a
    machine of the fleet, no mount under the run directory, no bridge and no vb-* link of it.
    Checked from the host's /proc, mount table and `ip link`, not with the testbed's own finders."""
    state = testbed.load_state(run=fleet.run)
    assert state is not None
    names = {str(nd["name"]) for nd in state.nodes}
    SEEN_PID_NS.update(machine_processes(names).values())
    assert SEEN_PID_NS  # the containers were found while they ran
    t0 = time.monotonic()
    removed = testbed.down(run=fleet.run, progress=lambda line: None)
    print(f"down of the fleet: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    assert f"bridge {BRIDGE}" in removed and all(f"container {n}" in removed for n in names), removed
    assert all(f"mount {nd['mount']}" in removed for nd in state.nodes), removed
    assert [pid for pid in _live_pids() if "systemd-nspawn" in _cmdline(pid) and str(fleet.run) in _cmdline(pid)] == []
    assert [pid for pid in _live_pids() if _pid_ns(pid) in SEEN_PID_NS] == []
    assert machine_processes(names) == {}
    assert [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(fleet.run) in line] == []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert not re.search(rf"^\d+: ({BRIDGE}|vb-{PREFIX}\d+)[@:]", links, re.M), links
    assert not fleet.run.exists()
    assert testbed.down(run=fleet.run, progress=lambda line: None) == []  # the teardown's down: nothing left


@fleet_only
@pytest.mark.timeout(60)
def test_down_without_a_state_touches_no_other_testbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no state nothing of this run was made (up saves the state before it adds anything):
    nothing is removed, and a bridge named like the default (a developer's testbed that is up
    meanwhile) is not touched."""
    monkeypatch.setattr(testbed, "BRIDGE", "fogtbdx")
    subprocess.run(["ip", "link", "add", "fogtbdx", "type", "bridge"], check=True)
    try:
        assert testbed.down(run=tmp_path / "run", progress=lambda line: None) == []
        assert Path("/sys/class/net/fogtbdx").exists()
    finally:
        subprocess.run(["ip", "link", "del", "fogtbdx"], check=False)
