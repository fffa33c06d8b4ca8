"""An upgrade of the .deb under load on the testbed (docs/operations.md, "Upgrade under load").

What a fleet operator does on a Pi, on real separate systems: while the taxi pipeline runs across
the containers (foglab.tools.testbed_pipeline), each node in turn gets `apt-get install` of a newer
build of the package. Its postinst builds the new version's venv beside the running one, switches
the symlink and try-restarts the agent (SIGTERM: the agent drains, docs/design.md invariant 4), and
the pipeline's verdict says whether any record was lost or recorded twice. Per node the summary
has the version, the agent's MainPID and the venv link before and after, apt's exit status and
time, and how long the unit took to be active again.

A "newer build" can be any later package; `relabel_deb` makes one from the installed .deb (the
same wheels under a later version number, which is what dpkg and postinst see of an upgrade).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from foglab.tools import testbed
from foglab.tools.testbed_pipeline import run_pipeline

CACHE = "/var/cache/fog-agent"


def relabel_deb(deb: Path, version: str, out: Path) -> Path:
    """The same package under another version: control's Version and postinst's DEB_VERSION (the
    name of the versioned venv; the wheels, and so the agent's own version, stay as they were)."""
    if not re.fullmatch(r"[0-9][A-Za-z0-9.+~-]*", version):
        raise testbed.TestbedError(f"version {version!r}: expected a Debian version such as 0.2.0+up1")
    tree = out / f"tree-{version}"
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True, capture_output=True)
    control = tree / "DEBIAN" / "control"
    control.write_text(re.sub(r"^Version: .*$", f"Version: {version}", control.read_text(), flags=re.M))
    postinst = tree / "DEBIAN" / "postinst"
    postinst.write_text(re.sub(r'^DEB_VERSION=.*$', f'DEB_VERSION="{version}"', postinst.read_text(), flags=re.M))
    arch = re.search(r"^Architecture: (\S+)$", control.read_text(), re.M)
    new = out / f"fog-agent_{version}_{arch.group(1) if arch else 'all'}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(tree), str(new)], check=True,
                   capture_output=True)
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    return new


def put_file(name: str, data: bytes, dest: str, run: Optional[Path] = None) -> str:
    """Write `data` to `dest` on a node over the fleet's SSH (no scp in the root needed, no quoting
    of the content: it goes through stdin), replacing it in one rename."""
    state = testbed.load_state(run=run)
    if state is None:
        raise testbed.TestbedError("no testbed is up: run `fog-agent testbed up` first")
    address = str(testbed._node_entry(state, name)["address"])
    rundir = run or testbed.run_dir(testbed.cache_dir())
    folder = dest.rsplit("/", 1)[0] or "/"
    proc = subprocess.run(testbed.ssh_argv(address, rundir / "id_ed25519", rundir / "known_hosts",
                                           f"mkdir -p {folder} && cat > {dest}.part && mv {dest}.part {dest}"),
                          input=data, capture_output=True, timeout=300)
    if proc.returncode != 0:
        raise testbed.TestbedError(f"writing {dest} on {name} failed: {proc.stderr.decode(errors='replace')[-300:]}")
    return dest


def copy_to_node(name: str, path: Path, dest_dir: str, run: Optional[Path] = None) -> str:
    """Copy a file from the host into `dest_dir` on a node."""
    return put_file(name, path.read_bytes(), f"{dest_dir}/{path.name}", run)


def node_facts(name: str, run: Optional[Path] = None) -> Dict[str, str]:
    """The package version, the unit's state and MainPID, and the venv the symlink names."""
    out = testbed.ssh(name, "dpkg-query -W -f='${Version}\\n' fog-agent; "
                            "systemctl show -p ActiveState,SubState,MainPID,NRestarts fog-agent.service; "
                            "echo venv=$(readlink /opt/fog-agent/venv); echo venvs=$(ls /opt/fog-agent/venvs | tr '\\n' ' ')",
                      run=run, check=False).stdout.splitlines()
    facts = {"version": out[0].strip() if out else ""}
    for line in out[1:]:
        key, sep, value = line.partition("=")
        if sep:
            facts[key] = value.strip()
    return facts


def _wait_active(name: str, old_pid: str, run: Optional[Path], timeout: float) -> Optional[float]:
    """Seconds until the unit is active with a MainPID other than `old_pid` (None: not within timeout)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        f = node_facts(name, run)
        if f.get("ActiveState") == "active" and f.get("SubState") == "running" and f.get("MainPID") not in ("", "0", old_pid):
            return round(time.monotonic() - started, 1)
        time.sleep(1.0)
    return None


def upgrade_nodes(nodes: List[str], remote_deb: str, run: Optional[Path], progress: Callable[[str], None],
                  results: List[Dict[str, Any]], gap: float = 5.0, timeout: float = 300.0) -> int:
    """`apt-get install` of the copied package on each node in turn; `results` gets one entry per node."""
    status = 0
    for i, name in enumerate(nodes):
        before = node_facts(name, run)
        t0 = time.monotonic()
        proc = testbed.ssh(name, f"DEBIAN_FRONTEND=noninteractive apt-get install -y {remote_deb} 2>&1",
                           run=run, check=False, timeout=timeout)
        apt_s = round(time.monotonic() - t0, 1)
        active_after = _wait_active(name, before.get("MainPID", ""), run, timeout)
        after = node_facts(name, run)
        entry = {"node": name, "apt_exit": proc.returncode, "apt_s": apt_s, "active_again_s": active_after,
                 "before": before, "after": after,
                 "apt_tail": proc.stdout.strip().splitlines()[-3:] if proc.returncode else []}
        results.append(entry)
        progress(f"upgraded {name}: {before.get('version')} -> {after.get('version')} in {apt_s} s (apt exit "
                 f"{proc.returncode}), agent pid {before.get('MainPID')} -> {after.get('MainPID')}")
        if proc.returncode != 0 or active_after is None:
            status = 1
        if i + 1 < len(nodes):
            time.sleep(gap)
    return status


def run_upgrade(new_deb: Path, nodes: Optional[List[str]] = None, duration: float = 90.0, rate: float = 300.0,
                at: float = 15.0, run: Optional[Path] = None,
                progress: Callable[[str], None] = testbed._stderr_progress) -> Dict[str, Any]:
    """The pipeline runs for `duration` s; `at` s after its deploy the nodes are upgraded one by one."""
    state = testbed.load_state(run=run)
    if state is None or not state.admin_password:
        raise testbed.TestbedError("no testbed with an inventory is up: run `fog-agent testbed up` and Ansible first")
    nodes = nodes or [str(n["name"]) for n in state.nodes]
    version = re.search(r"^Version: (\S+)$", subprocess.run(["dpkg-deb", "-f", str(new_deb)], capture_output=True,
                                                            text=True, check=True).stdout, re.M)
    assert version is not None
    remote = {}
    for name in nodes:
        installed = node_facts(name, run).get("version")
        if not installed:
            raise testbed.TestbedError(f"{name}: fog-agent is not installed (run ansible/site.yml first)")
        if subprocess.run(["dpkg", "--compare-versions", version.group(1), "gt", installed]).returncode != 0:
            raise testbed.TestbedError(f"{new_deb.name} ({version.group(1)}) is not newer than {installed} on {name}")
        remote[name] = copy_to_node(name, new_deb, CACHE, run)
    results: List[Dict[str, Any]] = []

    def upgrade() -> int:
        return upgrade_nodes(nodes, remote[nodes[0]], run, progress, results)

    summary = run_pipeline(duration, rate, run=run, progress=progress, during=upgrade, during_at=at)
    upgraded = [r for r in results if r["apt_exit"] == 0 and r["active_again_s"] is not None
                and r["after"].get("version") == version.group(1)
                and r["after"].get("venv") == f"venvs/{version.group(1)}"
                and r["before"].get("venv", "").split("/")[-1] in r["after"].get("venvs", "").split()]
    summary.update(new_version=version.group(1), upgrades=results, nodes_upgraded=len(upgraded),
                   nodes_to_upgrade=len(nodes))
    summary["upgrade_ok"] = len(upgraded) == len(nodes)
    summary["ok"] = bool(summary["ok"] and summary["upgrade_ok"])
    return summary
