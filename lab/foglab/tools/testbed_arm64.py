"""The same .deb on arm64: a booted arm64 Debian container under qemu user emulation
(docs/operations.md, "arm64").

One arm64 node (`arm1`) on a bridge and subnet of its own, so that it can run beside an amd64
testbed: the testbed boots it (binfmt_misc mounted and qemu-aarch64 registered when they are not,
undone by `down`), the package built on amd64 (`Architecture: all`) is installed with apt, the
node's own Mosquitto serves as the broker (anonymous, on the node's address: the ACL and TLS are
the amd64 fleet's business), the agent runs under systemd, and a short taxi pipeline runs through
it with the exactly-once verdict of foglab.tools.testbed_pipeline. Slow is fine: every process of
the node is emulated.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from foglab.tools import testbed
from foglab.tools.testbed_pipeline import run_pipeline
from foglab.tools.testbed_upgrade import CACHE, copy_to_node, node_facts, put_file

PREFIX, BRIDGE, SUBNET = "arm", "fogtba0", "10.217.0"
NODE = f"{PREFIX}1"
ADDRESS = f"{SUBNET}.11"

MOSQUITTO = f"""# Written by fog-agent testbed arm64: the node's own broker, anonymous, on its address.
listener 1883 {ADDRESS}
allow_anonymous true
max_queued_messages 100000
"""

# Only where the node is emulated: qemu user emulation translates the arm64 code with a JIT (it
# needs writable and executable memory) and makes the host's (x86-64) system calls, so the unit's
# MemoryDenyWriteExecute and its seccomp filter (SystemCallArchitectures=native, SystemCallFilter)
# would kill the agent at start; and systemd inside the emulated container cannot set up the IPC
# and user namespaces (PrivateIPC: "Input/output error", PrivateUsers: "Invalid argument", seen on
# arm1). A real arm64 Pi runs the unit as shipped.
QEMU_DROPIN = """# Written by fog-agent testbed arm64 (qemu user emulation only; see docs/operations.md).
[Service]
MemoryDenyWriteExecute=no
SystemCallArchitectures=
SystemCallFilter=
PrivateIPC=no
PrivateUsers=no
"""

AGENT_TOML = f"""# Written by fog-agent testbed arm64.
[agent]
node = "{NODE}"
cluster = "testbed"
slots = 4
state_period = 2.0

[mqtt]
host = "{ADDRESS}"
port = 1883

[metrics]
port = 0
"""


def run_dir() -> Path:
    return testbed.cache_dir() / "run-arm64"


def _step(timings: Dict[str, float], name: str, started: float) -> float:
    now = time.monotonic()
    timings[name] = round(now - started, 1)
    return now


def arm64_check(deb: Path, duration: float = 40.0, rate: float = 60.0, keep_up: bool = False,
                progress: Callable[[str], None] = testbed._stderr_progress,
                run: Optional[Path] = None) -> Dict[str, Any]:
    """Boot, install, start, run the pipeline, verify; the summary is the command's `--json`."""
    run = run or run_dir()
    timings: Dict[str, float] = {}
    t = time.monotonic()
    up = testbed.up(1, "arm64", run=run, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET, progress=progress)
    t = _step(timings, "up_s", t)
    summary: Dict[str, Any] = {"node": NODE, "root_built": up.root_built, "root_s": up.root_seconds}
    try:
        def sh(line: str, timeout: float = 1800.0) -> str:
            return testbed.ssh(NODE, line, run=run, timeout=timeout).stdout

        summary["uname_m"] = sh("uname -m").strip()
        summary["dpkg_arch"] = sh("dpkg --print-architecture").strip()
        remote = copy_to_node(NODE, deb, CACHE, run)
        progress(f"installing {deb.name} on {NODE} (postinst builds the venv under emulation)")
        sh(f"DEBIAN_FRONTEND=noninteractive apt-get install -y {remote} 2>&1")
        t = _step(timings, "apt_install_s", t)
        summary["venv_python_machine"] = sh("/opt/fog-agent/venv/bin/python -c 'import platform, psutil; "
                                            "print(platform.machine(), psutil.__version__)'").strip()
        put_file(NODE, MOSQUITTO.encode(), "/etc/mosquitto/conf.d/testbed.conf", run)
        sh("systemctl enable --now mosquitto && systemctl restart mosquitto")
        put_file(NODE, QEMU_DROPIN.encode(), "/etc/systemd/system/fog-agent.service.d/zz-qemu.conf", run)
        put_file(NODE, AGENT_TOML.encode(), "/etc/fog-agent/agent.toml.new", run)
        sh("fog-agent check-config /etc/fog-agent/agent.toml.new >/dev/null && "
           "mv /etc/fog-agent/agent.toml.new /etc/fog-agent/agent.toml && systemctl daemon-reload && "
           "systemctl restart fog-agent")
        deadline = time.monotonic() + 600
        status = ""
        while time.monotonic() < deadline:
            status = sh("systemctl show -p ActiveState,StatusText fog-agent.service")
            if "ActiveState=active" in status and "StatusText=connected" in status:
                break
            time.sleep(2.0)
        else:
            raise testbed.TestbedError(f"{NODE}: the agent did not become ready: {status.strip()}")
        summary["agent_status"] = status.split("StatusText=", 1)[-1].strip()
        summary["package"] = node_facts(NODE, run)  # the installed version and the running unit
        t = _step(timings, "agent_ready_s", t)
        # The pipeline's administrator: the node's broker is anonymous, any password passes.
        state = testbed.load_state(run=run)
        assert state is not None
        state.admin_password = uuid.uuid4().hex
        state.save(run / testbed.STATE_FILE)
        # Under emulation a worker is several times slower: a gentle step that still makes in_zone
        # (capacity 1000 / 20 ms = 50 records/s) scale out.
        verdict = run_pipeline(duration, rate, run=run, progress=progress, service_ms=20.0, base=20.0,
                               settle_timeout=180.0)
        _step(timings, "pipeline_s", t)
        summary["pipeline"] = verdict
        summary["journal_errors"] = sh("journalctl -u fog-agent -p err --no-pager -q | tail -5").strip().splitlines()
    finally:
        if not keep_up:
            summary["removed"] = testbed.down(run=run, progress=lambda line: None)
    summary["timings"] = timings
    # What tests/test_testbed_arm64.py asserted before this command replaced it (a test that skipped
    # everywhere but on request): aarch64 inside, the venv's Python too, the agent connected, every
    # record exactly once, and `down` removed the node's bridge.
    summary["ok"] = bool(summary.get("uname_m") == "aarch64" and summary.get("dpkg_arch") == "arm64"
                         and str(summary.get("venv_python_machine", "")).startswith("aarch64 ")
                         and str(summary.get("agent_status", "")).startswith("connected")
                         and (summary.get("pipeline") or {}).get("ok")
                         and (keep_up or not Path(f"/sys/class/net/{BRIDGE}").exists()))
    return summary
