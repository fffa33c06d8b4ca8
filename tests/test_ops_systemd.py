"""The unit files: `systemd-analyze verify` accepts them, the agent unit is hardened (exposure <= 2.5).

systemd is not PID 1 here, so units are verified offline in a scratch root that holds a copy of the
distribution's units (for sysinit.target & co.) and a stub /opt/fog-agent/venv/bin/fog-agent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from configparser import ConfigParser
from pathlib import Path
from typing import Dict, List

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = sorted((ROOT / "systemd").glob("fog-*.*"))
ANALYZE = shutil.which("systemd-analyze")
SYSTEM_UNITS = Path("/usr/lib/systemd/system")

pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (apt systemd)")


def parse_unit(path: Path) -> Dict[str, Dict[str, List[str]]]:
    """Unit files repeat keys (SystemCallFilter=...): keep every value, in order."""
    sections: Dict[str, Dict[str, List[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path.name}: key outside a section"
        current.setdefault(key, []).append(value)
    return sections


@pytest.fixture(scope="module")
def unit_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sdroot")
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    stub = root / "opt/fog-agent/venv/bin/fog-agent"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    kill = root / "bin/kill"  # ExecReload= (procps on the target)
    kill.parent.mkdir(parents=True)
    kill.write_text("#!/bin/sh\nexit 0\n")
    kill.chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True)
    return root


def verify(root: Path, unit: Path) -> subprocess.CompletedProcess:
    shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    return subprocess.run(
        [ANALYZE, "verify", "--man=no", f"--root={root}", unit.name],
        capture_output=True, text=True, timeout=60,
    )


def test_all_expected_units_exist() -> None:
    names = {u.name for u in UNITS}
    assert {"fog-agent.service", "fog-netem.service", "fog-collector.service",
            "fog-analytics.service", "fog-analytics.timer"} <= names


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_analyze_verify_accepts(unit_root: Path, unit: Path) -> None:
    res = verify(unit_root, unit)
    # verify only WARNS about unknown keys or bad values: any output is a failure too.
    assert res.returncode == 0 and res.stderr.strip() == "" and res.stdout.strip() == "", res.stderr


def test_verify_harness_rejects_a_broken_unit(unit_root: Path, tmp_path: Path) -> None:
    """The check above can fail: a typo'd key and a missing binary are both reported."""
    broken = tmp_path / "fog-broken.service"
    text = (ROOT / "systemd/fog-agent.service").read_text()
    broken.write_text(text.replace("NoNewPrivileges=yes", "NoNewPrivilege=yes").replace(
        "/opt/fog-agent/venv/bin/fog-agent", "/opt/fog-agent/venv/bin/missing"))
    res = verify(unit_root, broken)
    assert "Unknown key" in res.stderr
    assert res.returncode != 0


def security_score(unit: Path) -> float:
    res = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", res.stdout + res.stderr)
    assert m, res.stdout[-2000:] + res.stderr
    return float(m.group(1))


def test_agent_unit_exposure_is_ok() -> None:
    score = security_score(ROOT / "systemd/fog-agent.service")
    print(f"systemd-analyze security fog-agent.service: {score}")
    assert score <= 2.5


@pytest.mark.parametrize("name", ["fog-netem.service", "fog-collector.service", "fog-analytics.service"])
def test_other_units_are_hardened_too(name: str) -> None:
    assert security_score(ROOT / "systemd" / name) <= 2.5


def test_security_score_reacts_to_hardening(tmp_path: Path) -> None:
    """Stripping the hardening raises the score well above the goal: the measurement is real."""
    text = (ROOT / "systemd/fog-agent.service").read_text()
    keep = text.split("# Hardening:")[0] + "\n[Install]\nWantedBy=multi-user.target\n"
    soft = tmp_path / "fog-soft.service"
    soft.write_text(keep)
    assert security_score(soft) > 5.0


def test_agent_unit_contract() -> None:
    u = parse_unit(ROOT / "systemd/fog-agent.service")
    s = u["Service"]
    one = {k: v[-1] for k, v in s.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert int(one["WatchdogSec"]) > 0
    assert one["Restart"] == "on-failure" and one["KillMode"] == "mixed"
    assert one["User"] == "fog-agent" and one["User"] != "root"
    for key in ("StateDirectory", "RuntimeDirectory", "LogsDirectory"):
        assert one[key] == "fog-agent"
    assert one["ProtectSystem"] == "strict"
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectKernelLogs", "ProtectControlGroups"):
        assert one[key] == "yes", key
    assert one["CapabilityBoundingSet"] == "" and one["AmbientCapabilities"] == ""
    assert set(one["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert one["SystemCallArchitectures"] == "native"
    assert one["ExecStart"].startswith("/opt/fog-agent/venv/bin/fog-agent run --config ")
    # The daemon's own shutdown bound must fit inside systemd's: TimeoutStopSec > shutdown_timeout.
    from agent.config import AgentSection

    assert int(one["TimeoutStopSec"]) > AgentSection(node="n").shutdown_timeout


def test_netem_unit_has_only_cap_net_admin() -> None:
    one = {k: v[-1] for k, v in parse_unit(ROOT / "systemd/fog-netem.service")["Service"].items()}
    assert one["Type"] == "oneshot"
    assert one["CapabilityBoundingSet"] == "CAP_NET_ADMIN"
    assert one["AmbientCapabilities"] == "CAP_NET_ADMIN"
    assert one["User"] != "root"
    assert "AF_NETLINK" in one["RestrictAddressFamilies"].split()
    unit = parse_unit(ROOT / "systemd/fog-netem.service")["Unit"]
    assert "fog-agent.service" in unit["Before"][0].split()


def test_agent_unit_survives_oom_and_keeps_restarting() -> None:
    """One worker's OOM kill must not stop the agent (OOMPolicy=continue); the unit never reaches
    the start limit (StartLimitIntervalSec=0) and restarts at a fixed delay; `systemctl reload`
    sends SIGHUP, which the agent handles (tests/test_ops_notify_agent.py::test_sighup_...)."""
    u = parse_unit(ROOT / "systemd/fog-agent.service")
    one = {k: v[-1] for k, v in u["Service"].items()}
    assert one["OOMPolicy"] == "continue"
    assert u["Unit"]["StartLimitIntervalSec"] == ["0"]
    assert "StartLimitBurst" not in u["Unit"]
    # Short (a crash stalls the node's routes until the agent is back), but not a busy loop.
    assert one["Restart"] == "on-failure" and 1 <= int(one["RestartSec"]) <= 5
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"


def test_restart_steps_need_a_newer_systemd_than_bookworms(unit_root: Path, tmp_path: Path) -> None:
    """Why the unit has no RestartSteps=/RestartMaxDelaySec=: systemd < 254 (Debian bookworm has
    252) does not know them and `verify` says so; where systemd is newer, the drop-in of
    docs/operations.md ("Restarts") verifies cleanly instead."""
    version = int(re.search(r"systemd (\d+)", subprocess.run([ANALYZE, "--version"], capture_output=True,
                                                             text=True).stdout).group(1))
    text = (ROOT / "systemd/fog-agent.service").read_text()
    line = re.search(r"^RestartSec=.*\n", text, re.M).group(0)
    unit = tmp_path / "fog-steps.service"
    unit.write_text(text.replace(line, line + "RestartSteps=5\nRestartMaxDelaySec=5min\n"))
    res = verify(unit_root, unit)
    if version >= 254:
        assert res.returncode == 0 and not res.stdout + res.stderr, res.stdout + res.stderr
    else:
        assert "RestartSteps" in res.stderr, res.stderr
