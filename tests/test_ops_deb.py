"""The Debian package: builds, lists units and wheels, installs into a scratch root with the real
dpkg and the real maintainer scripts (`dpkg --root --force-script-chrootless`), gives a runnable
`fog-agent --version`, and purges cleanly.

The venv is not in the archive: postinst builds /opt/fog-agent/venvs/<version> from the bundled
wheels (see packaging/build-deb.sh for why) and switches the /opt/fog-agent/venv symlink to it, so
the test checks the wheels in the listing, the versioned layout after installation, and that an
upgrade leaves the running version's venv usable while the new one is built.
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
DOCS = ROOT / "docs" / "operations.md"


def documented_build() -> tuple:
    """The build as docs/operations.md ("Debian package") shows it: the `export DEBFULLNAME=...
    DEBEMAIL=...` line and the `packaging/build-deb.sh --out dist` line of its first sh block.
    Returns (the exported variables, the command's arguments after the script)."""
    import shlex

    text = DOCS.read_text()
    section = text[text.index("\n## Debian package"):]
    block = section[section.index("```sh\n") + 6:]
    block = block[:block.index("```")]
    env, args = {}, None
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            env.update(w.split("=", 1) for w in words[1:])
        elif words[:1] == ["packaging/build-deb.sh"]:
            args = words[1:]
    assert set(env) == {"DEBFULLNAME", "DEBEMAIL"} and args == ["--out", "dist"], block
    return env, args


MAINTAINER_ENV, _ = documented_build()
MAINTAINER = f"{MAINTAINER_ENV['DEBFULLNAME']} <{MAINTAINER_ENV['DEBEMAIL']}>"


def build_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DEBFULLNAME", "DEBEMAIL")}
    env.update(extra)
    return env

pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed")


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, f"{' '.join(cmd)} -> {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory, ops_wheelhouse: Path) -> Path:
    wheelhouse = ops_wheelhouse  # built once per test run, shared with the Ansible test (conftest.py)
    out = tmp_path_factory.mktemp("deb")
    # The documented command (its environment, `--out` to a temporary directory) and the wheelhouse
    # this run already built: what lintian checks below is what the docs tell you to build.
    env, _ = documented_build()
    res = run("bash", str(BUILD), "--out", str(out), "--wheelhouse", str(wheelhouse), env=build_env(**env))
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
    # Journal fields and priorities by default (agent.log picks agent.journal when it can import it).
    assert "python3-systemd" in fields["Depends"].split(", ")
    assert "python3-psutil (>= 5.9)" in fields["Depends"]
    assert "python3-cryptography (>= 38)" in fields["Depends"]  # agent.signing: Debian's, compiled
    assert fields["Maintainer"] == MAINTAINER
    assert "bookworm" in info and "bullseye" in info  # the supported platforms, and the one that is not
    for script in ("postinst", "prerm", "postrm", "conffiles"):
        assert re.search(rf"\s{script}\b", info), script


def test_deb_contents_lists_units_wheels_and_commands(deb: Path) -> None:
    listing = run("dpkg-deb", "--contents", str(deb)).stdout
    names = {line.split()[5] for line in listing.splitlines() if len(line.split()) >= 6}
    for unit in ("fog-agent.service", "fog-netem.service", "fog-collector.service",
                 "fog-analytics.service", "fog-analytics.timer"):
        assert f"./lib/systemd/system/{unit}" in names, unit
    wheels = [n for n in names if n.startswith("./usr/share/fog-agent/wheels/")]
    assert any(f"fog_agent-{__version__}-py3-none-any.whl" in w for w in wheels)
    assert any("paho_mqtt-" in w for w in wheels) and any("prometheus_client-" in w for w in wheels)
    # Only pure wheels: that is what makes Architecture: all true for arm64 and amd64.
    assert all(w.endswith("-none-any.whl") for w in wheels if w.endswith(".whl"))
    assert "./usr/share/fog-agent/wheels/requirements.lock" in names
    # Nothing of the package in /opt (lintian's dir-or-file-in-opt): postinst makes the venvs there.
    assert not [n for n in names if n.startswith("./opt")]
    assert {"./usr/share/man/man1/fog-agent.1.gz", "./usr/share/man/man1/fogctl.1.gz"} <= names
    assert "./usr/share/fog-agent/agent.toml.example" in names
    assert "./etc/default/fog-agent" in names
    assert "./usr/bin/fog-agent" in names
    assert "./usr/share/doc/fog-agent/changelog.gz" in names
    assert "/opt/fog-agent/venv/bin/fog-agent" in listing  # the symlink target


def test_the_node_wheel_holds_the_agent_package_and_no_lab(deb: Path, tmp_path: Path) -> None:
    """The lab (lab/, fog-agent-lab: simulators, benchmarks, demo, chaos, testbed) never reaches a node."""
    import zipfile

    run("dpkg-deb", "-x", str(deb), str(tmp_path))
    (wheel,) = (tmp_path / "usr/share/fog-agent/wheels").glob("fog_agent-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"agent", f"fog_agent-{__version__}.dist-info"}
    assert [n for n in names if n.startswith(("agent/tools/", "agent/sim/")) or "foglab" in n] == []


def test_deb_changelog_names_this_version_and_the_maintainer(deb: Path, tmp_path: Path) -> None:
    import gzip

    run("dpkg-deb", "-x", str(deb), str(tmp_path))
    text = gzip.decompress((tmp_path / "usr/share/doc/fog-agent/changelog.gz").read_bytes()).decode()
    assert text.startswith(f"fog-agent ({__version__}) ")
    assert re.search(rf"^ -- {re.escape(MAINTAINER)}  \w{{3}}, \d", text, re.M), text
    # a changelog entry for another version than agent/__init__.py's stops the build
    assert "@MAINTAINER@" not in text


def test_build_refuses_a_malformed_maintainer(tmp_path: Path) -> None:
    res = subprocess.run(["bash", str(BUILD), "--out", str(tmp_path), "--maintainer", "nobody"],
                         capture_output=True, text=True, timeout=60, env=build_env())
    assert res.returncode == 2 and "Name <address>" in res.stderr


def test_build_refuses_to_guess_a_maintainer(tmp_path: Path) -> None:
    """No placeholder any more: without DEBEMAIL (or --maintainer) the build stops before it
    builds anything and says what to export; DEBEMAIL alone counts only as 'Name <address>'."""
    for extra in ({}, {"DEBEMAIL": "jane@lab.example.org"}, {"DEBFULLNAME": "Jane Doe"}):
        res = subprocess.run(["bash", str(BUILD), "--out", str(tmp_path)], capture_output=True, text=True,
                             timeout=60, env=build_env(**extra))
        assert res.returncode == 2 and "DEBEMAIL" in res.stderr, (extra, res.stderr)
    assert not list(tmp_path.iterdir())


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
    # Versioned layout: the venv is a relative symlink to venvs/<version>, and the console script
    # names the FINAL versioned interpreter (not the scratch root, not the build's temporary name).
    assert os.readlink(venv) == f"venvs/{__version__}"
    assert sorted(p.name for p in (root / "opt/fog-agent/venvs").iterdir()) == [__version__]
    assert script.read_text().splitlines()[0] == f"#!/opt/fog-agent/venvs/{__version__}/bin/python"
    out = run(str(venv / "bin/python"), str(script), "--version", env=env, cwd=str(tmp_path)).stdout
    assert out.strip() == f"fog-agent {__version__}"
    # It runs from the venv's own site-packages, not from this checkout.
    where = run(str(venv / "bin/python"), "-c", "import agent; print(agent.__file__)", env=env,
                cwd=str(tmp_path)).stdout
    assert where.startswith(str(venv))
    # The node's package has no lab: a lab command says what to install instead of running.
    demo = subprocess.run([str(venv / "bin/python"), str(script), "demo"], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=60)
    assert demo.returncode == 2 and "install fog-agent-lab" in demo.stderr, demo.stderr

    # postinst wrote a config for this node that the installed agent accepts.
    conf = root / "etc/fog-agent/agent.toml"
    assert 'node = "pi-07"' in conf.read_text()
    run(str(venv / "bin/python"), str(script), "check-config", str(conf), env=env, cwd=str(tmp_path))
    # The service user and the enablement symlink.
    passwd = (root / "etc/passwd").read_text()
    assert re.search(r"^fog-agent:x:\d+:\d+:[^:]*:/var/lib/fog-agent:/usr/sbin/nologin$", passwd, re.M)
    wants = root / "etc/systemd/system/multi-user.target.wants/fog-agent.service"
    assert os.readlink(wants) == "/lib/systemd/system/fog-agent.service"

    # Under systemd (JOURNAL_STREAM set) the installed agent logs to the journal: python3-systemd,
    # a dependency, is visible through the venv's system site.
    if subprocess.run([SYSTEM_PYTHON, "-c", "import systemd.journal"], capture_output=True).returncode == 0:
        code = "import logging, agent.log as l; l.setup_logging(); print(type(logging.getLogger().handlers[0]).__name__)"
        out = run(str(venv / "bin/python"), "-c", code, env=dict(env, JOURNAL_STREAM="8:1234"), cwd=str(tmp_path))
        assert out.stdout.strip() == "JournalHandler"

    # What the fog_agent role writes beside postinst's agent.toml (every file of its configure
    # tasks under the config dir, read from the role), its drop-in and package copy, the agent's
    # state, and a file of another role (fog_netem) that the package must leave alone.
    written = role_written_files(root)
    for path in written:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")
    other_role = root / "etc/fog-agent/latency.toml"
    other_role.write_text("[nodes]\n")

    # remove keeps the configuration (Debian policy), takes the venvs.
    run(*dpkg, "--remove", "fog-agent", env=env)
    assert not (root / "opt/fog-agent").exists()
    assert conf.exists() and all(p.exists() for p in written), [p for p in written if not p.exists()]

    run(*dpkg, "--purge", "fog-agent", env=env)
    assert not conf.exists()
    assert [p for p in written if os.path.lexists(p)] == []
    for gone in ("etc/fog-agent/tls", "etc/fog-agent/pipelines", "var/lib/fog-agent", "var/cache/fog-agent",
                 "etc/systemd/system/fog-agent.service.d"):
        assert not (root / gone).exists(), gone
    assert other_role.read_text() == "[nodes]\n"
    assert not wants.exists() and not os.path.lexists(wants)


def role_written_files(root: Path) -> list:
    """The files the fog_agent role writes for the agent (tasks/configure.yml's `dest:` lines under
    the config and unit dirs, each loop item), the package copy of tasks/install.yml, and files
    under the state dir, mapped into `root`: what a purge must remove."""
    tasks = (ROOT / "ansible/roles/fog_agent/tasks/configure.yml").read_text()
    dests = re.findall(r'^\s+dest: "\{\{ (fog_agent_config_dir|fog_agent_unit_dir) \}\}/([^"]+)"', tasks, re.M)
    items = re.findall(r"dest: (\w[\w.]*), mode:", tasks)  # the TLS loop's file names
    base = {"fog_agent_config_dir": root / "etc/fog-agent", "fog_agent_unit_dir": root / "etc/systemd/system"}
    out = []
    for var, rel in dests:
        if rel == "fog-agent.service":
            continue  # the wheelhouse method's unit copy; with the package, dpkg owns the unit
        rel = rel.replace("{{ item.name }}", "taxi").replace("{{ item.dest }}", "{item}")
        out += [base[var] / rel.format(item=i) for i in items] if "{item}" in rel else [base[var] / rel]
    assert {p.name for p in out} >= {"agent.toml", "mqtt-password", "client-id.secret", "client.key", "taxi.toml",
                                     "sink-dirs.conf"}, out
    out += [root / "var/cache/fog-agent" / f"fog-agent_{__version__}_all.deb",
            root / "var/lib/fog-agent/spool/chunk-1.jsonl.gz", root / "var/lib/fog-agent/node.key"]
    return out


def scratch_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    admin = root / "var/lib/dpkg"
    for d in ("info", "updates", "triggers"):
        (admin / d).mkdir(parents=True)
    (admin / "status").touch()
    (admin / "available").touch()
    return root


def relabel(deb: Path, version: str, out: Path) -> Path:
    """The same wheels as a package of another version (what an upgrade looks like to dpkg and
    to postinst, without a second wheel build): the testbed's upgrade command uses the same."""
    from foglab.tools.testbed_upgrade import relabel_deb

    return relabel_deb(deb, version, out)


@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no Debian python3")
def test_upgrade_keeps_the_running_venv_until_the_switch(deb: Path, tmp_path: Path) -> None:
    """postinst used to `rm -rf` the venv a running agent imports from and rebuild it in place
    (27 failed worker imports over 3 s). Now: the new version is built beside the old one, the
    symlink switches with one rename, and the previous venv stays. The build step's interpreter
    is a wrapper that, at the moment the new venv is being made, checks that the symlink still
    points at the old venv and that a fresh interpreter from it imports the agent."""
    root = scratch_root(tmp_path)
    dpkg = ["dpkg", f"--root={root}", "--force-script-chrootless", "--log=/dev/null", "--force-depends"]
    env = dict(os.environ, FOG_AGENT_NODE="pi-08", FOG_AGENT_PYTHON=SYSTEM_PYTHON)
    env.pop("PYTHONPATH", None)
    run(*dpkg, "-i", str(deb), env=env)
    base = root / "opt/fog-agent"
    old = base / "venvs" / __version__
    assert os.readlink(base / "venv") == f"venvs/{__version__}"

    # A "running agent" of the old version: started as systemd does, through the console script,
    # whose #! names the versioned interpreter (asserted below), so sys.prefix is the versioned
    # venv; it imports agent modules lazily, after the upgrade.
    shebang = (base / "venv/bin/fog-agent").read_text().splitlines()[0]
    assert shebang == f"#!/opt/fog-agent/venvs/{__version__}/bin/python"
    probe = subprocess.Popen([str(root) + shebang[2:], "-c",
                              "import sys, agent; sys.stdin.readline(); import agent.node.daemon as d; "
                              "print(sys.prefix); print(d.__file__)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))

    seen = tmp_path / "during-build.txt"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'{{ readlink "{base}/venv"; "{old}/bin/python" -c "import agent.node.daemon" && echo import-ok; }} > "{seen}" 2>&1\n'
        f'exec {SYSTEM_PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    new_version = f"{__version__}+t2"
    new_deb = relabel(deb, new_version, tmp_path / "v2")
    run(*dpkg, "-i", str(new_deb), env=dict(env, FOG_AGENT_PYTHON=str(wrapper)))

    assert seen.read_text().split() == [f"venvs/{__version__}", "import-ok"], seen.read_text()
    assert os.readlink(base / "venv") == f"venvs/{new_version}"
    assert sorted(p.name for p in (base / "venvs").iterdir()) == sorted([__version__, new_version])
    out, _ = probe.communicate("go\n", timeout=60)
    assert probe.returncode == 0, out
    prefix, daemon_file = out.split()
    # The old process kept its own, versioned venv: its lazy import came from there.
    assert prefix == str(old), prefix
    assert daemon_file.startswith(str(old) + "/"), daemon_file
    new_script = base / "venv/bin/fog-agent"
    assert new_script.read_text().splitlines()[0] == f"#!/opt/fog-agent/venvs/{new_version}/bin/python"
    assert run(str(base / "venv/bin/python"), str(new_script), "--version", env=env,
               cwd=str(tmp_path)).stdout.strip() == f"fog-agent {__version__}"

    # A third version removes the oldest and keeps the previous one.
    third = relabel(deb, f"{__version__}+t3", tmp_path / "v3")
    run(*dpkg, "-i", str(third), env=env)
    assert sorted(p.name for p in (base / "venvs").iterdir()) == sorted([new_version, f"{__version__}+t3"])
    run(*dpkg, "--purge", "fog-agent", env=env)
    assert not base.exists()


LOCK = ROOT / "packaging" / "requirements.lock"


def lock_entries(text: str) -> dict:
    """{name: (version, marker, [sha256, ...])} of a requirements file in the lock's format."""
    out = {}
    for entry in re.sub(r"\\\n\s*", " ", text).splitlines():
        entry = entry.split("#", 1)[0].strip()
        if not entry:
            continue
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)\s*(?:;\s*(.*?))?\s*((?:--hash=sha256:[0-9a-f]{64}\s*)+)$", entry)
        assert m, f"not a pinned and hashed requirement: {entry!r}"
        out[m.group(1).lower().replace("_", "-")] = (m.group(2), m.group(3), re.findall(r"[0-9a-f]{64}", m.group(4)))
    return out


def test_lock_pins_every_pure_runtime_dependency_with_its_hash() -> None:
    """packaging/requirements.lock is what pyproject.toml asks for: each dependency but psutil and
    cryptography (Debian's) pinned to a version its bound allows, with its wheel's sha256, markers kept."""
    import tomllib

    from packaging.requirements import Requirement

    declared = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    locked = lock_entries(LOCK.read_text())
    wanted = {r.name.lower(): r for r in declared if r.name.lower() not in ("psutil", "cryptography")}
    assert set(locked) == set(wanted), "run packaging/lock.sh after changing [project] dependencies"
    for name, req in wanted.items():
        version, marker, hashes = locked[name]
        assert req.specifier.contains(version), (name, version, str(req.specifier))
        assert (marker or None) == (str(req.marker) if req.marker else None), name
        assert len(hashes) == 1


def test_the_package_ships_exactly_the_locked_wheels(deb: Path, tmp_path: Path) -> None:
    import hashlib

    run("dpkg-deb", "-x", str(deb), str(tmp_path))
    wheels = tmp_path / "usr/share/fog-agent/wheels"
    shipped = lock_entries((wheels / "requirements.lock").read_text())
    project = lock_entries(LOCK.read_text())
    # The project's lock plus the agent's own wheel, hashed at build time.
    assert set(shipped) == set(project) | {"fog-agent"}
    assert all(shipped[n] == project[n] for n in project)
    for whl in wheels.glob("*.whl"):
        name = whl.name.split("-")[0].lower().replace("_", "-")
        assert hashlib.sha256(whl.read_bytes()).hexdigest() in shipped[name][2], whl.name


@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no Debian python3")
def test_postinst_refuses_a_wheel_that_does_not_match_its_hash(deb: Path, tmp_path: Path) -> None:
    """A wheel changed after the build (a corrupted mirror, a tampered package) is not installed:
    pip --require-hashes stops postinst before anything is switched."""
    tree = tmp_path / "tree"
    run("dpkg-deb", "-R", str(deb), str(tree))
    (paho,) = (tree / "usr/share/fog-agent/wheels").glob("paho_mqtt-*.whl")
    paho.write_bytes(paho.read_bytes() + b"\0")  # still a readable zip: only the hash tells
    bad = tmp_path / "fog-agent_bad_all.deb"
    run("dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(tree), str(bad))
    root = scratch_root(tmp_path)
    env = dict(os.environ, FOG_AGENT_NODE="pi-09", FOG_AGENT_PYTHON=SYSTEM_PYTHON)
    env.pop("PYTHONPATH", None)
    res = subprocess.run(["dpkg", f"--root={root}", "--force-script-chrootless", "--log=/dev/null", "--force-depends",
                          "-i", str(bad)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode != 0
    assert "hash" in (res.stdout + res.stderr).lower(), res.stdout + res.stderr
    assert not os.path.lexists(root / "opt/fog-agent/venv")


# Every tag lintian still reports (errors, warnings, info and pedantic), with why it stays
# (docs/operations.md, "Lintian").
LINTIAN_JUSTIFIED = {
    # info: the units need systemd (Type=notify, the watchdog, the sandboxing); no sysvinit script.
    "package-supports-alternative-init-but-no-init.d-script",
}


@pytest.mark.skipif(shutil.which("lintian") is None, reason="lintian is not installed (apt-get install lintian)")
def test_lintian_reports_nothing_unjustified(deb: Path) -> None:
    """The package of the documented command (the `deb` fixture): with the placeholder maintainer
    the build used to write, lintian said bogus-mail-host (control) and bogus-mail-host-in-debian-changelog."""
    res = subprocess.run(["lintian", "--tag-display-limit", "0", "--display-info", "--pedantic", str(deb)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr  # exit 1 on an error tag, 2 when lintian itself failed
    tags = sorted({line.split()[2] for line in res.stdout.splitlines() if re.match(r"^[EWIPX]: ", line)})
    assert [t for t in tags if t not in LINTIAN_JUSTIFIED] == [], res.stdout
