"""The .deb on arm64: one arm64 Debian container under qemu user emulation installs the package
built here (Architecture: all), runs the agent under systemd and a short taxi pipeline through it,
every record exactly once (agent.tools.testbed_arm64; docs/operations.md, "arm64").

Not part of a normal run: the arm64 root takes 10 to 45 minutes to debootstrap under emulation
and the run itself several minutes, far beyond the suite's budget. It runs when asked
(FOG_TESTBED_ARM64=1) on a machine that can (root, nspawn, qemu-user-static with binfmt_misc)
and has the root cached (`fog-agent testbed root --arch arm64`); otherwise it is skipped with the
reason.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from agent.tools import testbed



def _skip_reason() -> str:
    if os.geteuid() != 0 or not shutil.which("systemd-nspawn"):
        return "needs root with systemd-nspawn (apt-get install systemd-container)"
    why = testbed.emulation_missing("arm64") if testbed.needs_emulation("arm64") else None
    if why:
        return f"no arm64 emulation here: {why}"
    marker = testbed.root_dir(testbed.cache_dir(), "arm64") / testbed.ROOT_MARKER
    if not marker.is_file():
        return "no cached arm64 root: build it with `fog-agent testbed root --arch arm64` (10 to 45 minutes)"
    if os.environ.get("FOG_TESTBED_ARM64") != "1":
        return "several minutes under emulation: run with FOG_TESTBED_ARM64=1"
    return ""


@pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "runs")
@pytest.mark.timeout(1800)
def test_the_deb_runs_a_pipeline_on_arm64(tmp_path: Path) -> None:
    from agent.tools.testbed_arm64 import arm64_check

    from tests.test_testbed import build_deb

    deb = build_deb(tmp_path / "dist")
    summary = arm64_check(deb, duration=30.0, rate=50.0, run=tmp_path / "run",
                          progress=lambda line: print(f"arm64: {line}", file=sys.stderr))
    # Really arm64: the kernel reports aarch64 inside (qemu), dpkg and the venv's Python agree.
    assert summary["uname_m"] == "aarch64" and summary["dpkg_arch"] == "arm64", summary
    assert summary["venv_python_machine"].startswith("aarch64 "), summary
    assert summary["package"]["version"] and summary["package"]["ActiveState"] == "active", summary
    assert summary["agent_status"].startswith("connected"), summary
    p = summary["pipeline"]
    assert p["generated"] > 0 and p["lost"] == 0 and p["duplicated"] == 0 and p["ok"], p
    # down removed the node, the bridge and what it registered with binfmt_misc.
    assert not Path("/sys/class/net/fogtba0").exists()
    assert any(r.startswith("bridge ") for r in summary["removed"])
