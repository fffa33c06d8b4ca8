"""What the long-lived processes import (docs/runtime.md, "Memory"): every process under 40 MB
RSS rests on the daemon and the workers not holding modules they never use. A worker is forked
from the fork server with the worker's imports done and frozen for the collector; the daemon's
command line registers `run` alone. Libraries a feature needs where it is used are not named
here: only what these processes must never hold (and `cryptography`, which an agent no longer
needs to verify a signed spec). Also the sampler the demo reports its peaks per process kind with
(foglab.tools.footprint) and the table it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Set

from agent.cli.main import DAEMON, _command_of
from agent.node.forked import ForkServer

ROOT = Path(__file__).resolve().parents[1]
# Libraries of the tools, the analytics and the tests: never in a node's daemon or worker.
NEVER = {"psutil", "pyspark", "pyarrow", "pandas", "numpy", "matplotlib", "hypothesis", "pytest", "jsonschema",
         "foglab"}
NEVER_AGENT = ("agent.tools", "agent.sim", "agent.analytics", "agent.testing", "agent.fogctl", "agent.collector")


def _foreign(modules: Set[str], also: tuple = ()) -> List[str]:
    return sorted(m for m in modules if m.split(".")[0] in NEVER or m.startswith(NEVER_AGENT + also))


def test_the_daemon_command_is_found_behind_the_global_options() -> None:
    assert DAEMON[0] == "run"
    assert _command_of(["run", "--config", "x"]) == "run"
    assert _command_of(["--log-level", "debug", "run"]) == "run"
    assert _command_of(["--log-level=debug", "run"]) == "run"
    assert _command_of(["bench", "run"]) == "bench"
    assert _command_of(["--help", "run"]) is None and _command_of(["--version"]) is None and _command_of([]) is None


def test_the_daemon_imports_no_tool_simulator_or_other_command() -> None:
    code = ("import json, sys\nfrom agent.cli.main import main\n"
            "rc = main(['--log-level', 'error', 'run', '--config', '/nonexistent/agent.toml'])\n"
            "print(json.dumps({'rc': rc, 'modules': sorted(sys.modules)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT))
    report = json.loads(out.stdout.strip().splitlines()[-1])
    mods = set(report["modules"])
    assert report["rc"] == 78 and "agent.node.daemon" in mods  # run_cmd ran, then refused the config
    commands = sorted(m for m in mods if m.startswith("agent.cli.") and m not in ("agent.cli.main", "agent.cli.runtime_cmd"))
    assert commands == [] and _foreign(mods) == []


def test_the_daemon_verifies_a_signed_spec_without_importing_cryptography(tmp_path: Path) -> None:
    """The demo and the Ansible role make every agent require signed specs: verifying one goes
    through the interpreter's own libcrypto (agent.ed25519), and `cryptography` (9.7 MB
    resident) stays out of the daemon's process; signing stays on the admin's side."""
    from agent import signing

    signing.generate_keypair(tmp_path / "admin.key", tmp_path / "admin.pub")
    sig = signing.load_signer(tmp_path / "admin.key").sign("lab", "g1", "[pipeline]\n", issued_at=5)
    code = ("import json, sys\nfrom agent.cli.main import main\n"
            "rc = main(['--log-level', 'error', 'run', '--config', '/nonexistent/agent.toml'])\n"
            "from agent import signing\n"
            f"trust = signing.SpecTrust(signing.load_verifier([{str(tmp_path / 'admin.pub')!r}]))\n"
            f"ok = trust.check('lab', 'g1', '[pipeline]\\n', {sig.to_extra()!r})\n"
            f"forged = trust.check('lab', 'g1', '[pipeline]\\nx = 1\\n', {sig.to_extra()!r})\n"
            "print(json.dumps({'rc': rc, 'ok': ok, 'forged': forged, 'modules': sorted(sys.modules)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT))
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rc"] == 78 and report["ok"] is None and "forged or altered" in report["forged"]
    mods = set(report["modules"])
    assert "agent.node.daemon" in mods
    assert sorted(m for m in mods if m.split(".")[0] in ("cryptography", "_cffi_backend", "cffi")) == []
    assert "agent.ed25519" in mods


def test_a_forked_worker_holds_the_workers_imports_frozen_and_nothing_it_never_uses() -> None:
    from agent.operators.admission import AllowList

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **AllowList.for_node().env())
    server = ForkServer([sys.executable, "-m", "footprint_probe"], env, None, time.monotonic())
    try:
        deadline = time.monotonic() + 30
        while not server.ready and not server.lost and time.monotonic() < deadline:
            server.wait_readable(0.5)
            server.pump()
        child = server.fork()
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        line = child.stdout.readline()
        assert child.wait(10) == 0
    finally:
        server.close()
    report = json.loads(line)
    mods = set(report["modules"])
    assert {"agent.instance.worker", "agent.instance.core", "paho.mqtt.client"} <= mods  # preloaded
    # the preloaded objects are frozen: the child's collector never touches (copies) their pages
    assert report["frozen"] > 10_000
    assert _foreign(mods, ("agent.node", "agent.cli")) == []
    # paho's urllib.request is a stand-in, never loaded (agent.mqtt.defer_urllib_request); the
    # entry points come from the agent's environment, not from importlib.metadata
    assert sorted(m for m in mods if m.partition(".")[0] in ("email", "http", "zipfile", "statistics")
                  or m in ("urllib.request", "importlib.metadata")) == ["urllib.request"]
    assert report["urllib_request_loaded"] is False


def test_the_sampler_names_each_process_of_a_tree_by_kind_and_keeps_its_peak(tmp_path: Path) -> None:
    """foglab.tools.footprint, which the demo runs on its own tree: a worker is named by the
    operators of the instance locks it holds (a keeper's and a copy's), its peak RSS is the
    kernel's VmHWM, so an allocation freed between two samples still counts."""
    from foglab.tools.footprint import Footprint

    code = ("import sys, time\n"
            "locks = [open(p, 'w') for p in sys.argv[1:-1]]\n"
            "x = bytearray(24 * 2**20); x[::4096] = b'x' * len(x[::4096]); del x\n"  # 24 MB touched, then freed
            "print('ready', flush=True); sys.stdin.read()\n")
    workers = [subprocess.Popen([sys.executable, "-c", code, *(str(tmp_path / n) for n in names), "agent.instance.worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for names in (["taxi.route_counts.0.lock"], ["route_counts-0a1b2c.lock", "taxi.in_zone.3.lock"])]
    try:
        for w in workers:
            assert w.stdout is not None and w.stdout.readline() == "ready\n"
        fp = Footprint(os.getpid())
        fp.sample()
        kinds = fp.per_kind()
    finally:
        for w in workers:
            assert w.stdin is not None
            w.stdin.close()
            w.wait(10)
    assert kinds["worker:route_counts"]["n"] == 1 and kinds["worker:in_zone+route_counts"]["n"] == 1
    assert kinds["driver"]["n"] >= 1  # this test's own process
    for k in ("worker:route_counts", "worker:in_zone+route_counts"):
        assert kinds[k]["rss_peak_mb"] > 24 > kinds[k]["uss_peak_mb"]


def test_urllib_request_waits_for_its_first_use_and_is_then_the_real_module() -> None:
    """agent.mqtt puts a stand-in for urllib.request before paho imports it: nothing of it is
    loaded (email, http.client) until an attribute is read; then every way of using it gets the
    real module."""
    code = ("import json, sys\nimport agent.mqtt.client, urllib\n"
            "before = sorted(m for m in sys.modules if m.split('.')[0] in ('email', 'http'))\n"
            "stand_in = sys.modules['urllib.request']\n"
            "probe = hasattr(stand_in, '__file__')\n"  # a dunder probe does not load it
            "from urllib.request import getproxies\n"
            "import urllib.request\n"
            "real = sys.modules['urllib.request']\n"
            "print(json.dumps({'before': before, 'probe': probe, 'loaded': 'http.client' in sys.modules,"
            " 'real': real is not stand_in and urllib.request is real and getproxies is real.getproxies,"
            " 'via_stand_in': stand_in.urlopen is real.urlopen, 'paho': agent.mqtt.client.mqtt.urllib.request is real}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT))
    assert json.loads(out.stdout) == {"before": [], "probe": False, "loaded": True, "real": True,
                                      "via_stand_in": True, "paho": True}, out.stderr


def test_the_demo_summary_prints_the_peaks_per_kind_with_roles_and_the_budget() -> None:
    import io

    from foglab.tools.demo import print_summary

    row = {"n": 1, "pss_peak_mb": 20.0, "uss_peak_mb": 18.0}
    summary = {"ok": True, "operator_roles": {"route_counts": "keyed", "sink": "sink"},
               "memory_mb": {"agent": dict(row, rss_peak_mb=37.5), "worker:route_counts": dict(row, rss_peak_mb=40.0),
                             "worker:sink": dict(row, rss_peak_mb=31.0)}}
    out = io.StringIO()
    print_summary(summary, out)
    lines = {line.split()[0]: line for line in out.getvalue().splitlines() if line.startswith("    ")}
    assert lines["worker:route_counts"].endswith("40.0      20.0      18.0  keyed OVER 40 MB")
    assert lines["worker:sink"].endswith("sink") and lines["agent"].endswith("18.0")
