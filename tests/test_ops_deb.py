"""The Debian package: builds, lists units and wheels, installs into a scratch root with the real
dpkg and the real maintainer scripts (`dpkg --root --force-script-chrootless`), gives a runnable
`fog-agent --version`, and purges cleanly.

The venv is not in the archive: postinst builds /opt/fog-agent/venv from the bundled wheels (see
packaging/build-deb.sh for why), so the test checks the wheels in the listing and the venv after
installation.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent import __version__

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "packaging" / "build-deb.sh"
SYSTEM_PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed")


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, f"{' '.join(cmd)} -> {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The wheelhouse lives in the session's base temp dir, shared with the Ansible test.
    wheelhouse = tmp_path_factory.getbasetemp() / "ops-wheelhouse"
    out = tmp_path_factory.mktemp("deb")
    res = run("bash", str(BUILD), "--out", str(out), "--wheelhouse", str(wheelhouse))
    path = Path(res.stdout.strip().splitlines()[-1])
    assert path.is_file() and path.name == f"fog-agent_{__version__}_all.deb"
    return path


def test_deb_info(deb: Path) -> None:
    info = run("dpkg-deb", "--info", str(deb)).stdout
    fields = dict(re.findall(r"^ (\w[\w-]*): (.*)$", info, re.M))
    assert fields["Package"] == "fog-agent"
    assert fields["Version"] == __version__
    assert fields["Architecture"] == "all"
    # Never the system Python's site (PEP 668): the package needs venv support, not pip.
    assert "python3-venv" in fields["Depends"] and "python3-pip" not in fields["Depends"]
    for script in ("postinst", "prerm", "postrm", "conffiles"):
        assert re.search(rf"\s{script}\b", info), script


def test_deb_contents_lists_units_wheels_and_commands(deb: Path) -> None:
    listing = run("dpkg-deb", "--contents", str(deb)).stdout
    names = {line.split()[5] for line in listing.splitlines() if len(line.split()) >= 6}
    for unit in ("fog-agent.service", "fog-netem.service", "fog-collector.service",
                 "fog-analytics.service", "fog-analytics.timer"):
        assert f"./lib/systemd/system/{unit}" in names, unit
    wheels = [n for n in names if n.startswith("./opt/fog-agent/wheels/")]
    assert any(f"fog_agent-{__version__}-py3-none-any.whl" in w for w in wheels)
    assert any("paho_mqtt-" in w for w in wheels) and any("prometheus_client-" in w for w in wheels)
    # Only pure wheels: that is what makes Architecture: all true for arm64 and amd64.
    assert all(w.endswith("-none-any.whl") for w in wheels if w.endswith(".whl"))
    assert "./usr/share/fog-agent/agent.toml.example" in names
    assert "./etc/default/fog-agent" in names
    assert "./usr/bin/fog-agent" in names
    assert "/opt/fog-agent/venv/bin/fog-agent" in listing  # the symlink target


def test_deb_units_match_the_repository(deb: Path, tmp_path: Path) -> None:
    run("dpkg-deb", "-x", str(deb), str(tmp_path))
    for unit in (ROOT / "systemd").glob("fog-*.*"):
        assert (tmp_path / "lib/systemd/system" / unit.name).read_bytes() == unit.read_bytes()


@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no Debian python3")
def test_install_into_scratch_root_runs_fog_agent_then_purges(deb: Path, tmp_path: Path) -> None:
    check = subprocess.run([SYSTEM_PYTHON, "-c", "import venv, ensurepip, psutil"], capture_output=True)
    assert check.returncode == 0, (
        "the .deb Depends on python3-venv and python3-psutil: apt-get install python3-venv python3-psutil"
    )
    root = tmp_path / "root"
    admin = root / "var/lib/dpkg"
    for d in ("info", "updates", "triggers"):
        (admin / d).mkdir(parents=True)
    (admin / "status").touch()
    (admin / "available").touch()
    dpkg = ["dpkg", f"--root={root}", "--force-script-chrootless", "--log=/dev/null"]
    env = dict(os.environ, FOG_AGENT_NODE="pi-07", FOG_AGENT_PYTHON=SYSTEM_PYTHON)
    env.pop("PYTHONPATH", None)  # the venv must work on its own, not through this checkout
    # Dependencies are the host's (python3, python3-venv, python3-psutil), not the empty root's.
    run(*dpkg, "--force-depends", "-i", str(deb), env=env)

    venv = root / "opt/fog-agent/venv"
    script = venv / "bin/fog-agent"
    # The console script points at the FINAL location, as on a Pi imaged with `dpkg --root`.
    assert script.read_text().splitlines()[0] == "#!/opt/fog-agent/venv/bin/python"
    out = run(str(venv / "bin/python"), str(script), "--version", env=env, cwd=str(tmp_path)).stdout
    assert out.strip() == f"fog-agent {__version__}"
    # It runs from the venv's own site-packages, not from this checkout.
    where = run(str(venv / "bin/python"), "-c", "import agent; print(agent.__file__)", env=env,
                cwd=str(tmp_path)).stdout
    assert where.startswith(str(venv))

    # postinst wrote a config for this node that the installed agent accepts.
    conf = root / "etc/fog-agent/agent.toml"
    assert 'node = "pi-07"' in conf.read_text()
    run(str(venv / "bin/python"), str(script), "check-config", str(conf), env=env, cwd=str(tmp_path))
    # The service user and the enablement symlink.
    passwd = (root / "etc/passwd").read_text()
    assert re.search(r"^fog-agent:x:\d+:\d+:[^:]*:/var/lib/fog-agent:/usr/sbin/nologin$", passwd, re.M)
    wants = root / "etc/systemd/system/multi-user.target.wants/fog-agent.service"
    assert os.readlink(wants) == "/lib/systemd/system/fog-agent.service"

    run(*dpkg, "--purge", "fog-agent", env=env)
    assert not (root / "opt/fog-agent").exists()
    assert not conf.exists()
    assert not wants.exists() and not os.path.lexists(wants)
