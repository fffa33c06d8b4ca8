"""One real agent as a process: `python -m agent run --config CONF` on this checkout's code, its
stdout and stderr in a log file, stopped the way systemd stops it (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
import time
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
# This checkout's two distributions, fog-agent (ROOT) and fog-agent-lab (ROOT/lab), first on the path
# of a subprocess: a test runs the code it checks out, not whatever copy the venv has installed.
CHECKOUT_PATH = os.pathsep.join([str(ROOT), str(ROOT / "lab")])
# Seconds a test gives an agent to come online or a worker it starts itself to say ready, against a
# hang only (a dead process fails at once where the test can see it): under load ~34 an agent had
# not logged its first line after 30 s, and at ~38 most workers of test_runtime_worker_broker were
# not ready after LocalRunner's default 20 s (a python start and the imports on shared cores).
ONLINE_BOUND = 120.0


class AgentProcess:
    STOP_TIMEOUT = 10.0  # seconds between SIGTERM and SIGKILL

    def __init__(self, conf: Path, log_path: Optional[Path] = None) -> None:
        self.conf = conf
        self.log_path = log_path or conf.with_suffix(".log")
        self.start()

    def start(self) -> None:
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(self.conf)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)


def wait_until_answers(client: Any, node: str, alive: Callable[[], bool], timeout: float = ONLINE_BOUND) -> None:
    """Until agent `node` answers a ping through `client` (an RpcClient); re-raises the last
    failure after `timeout` s, or at once when `alive()` says its process is gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert client.call(node, {"op": "ping"}, timeout=2.0)["ok"]
            return
        except Exception:
            if time.monotonic() > deadline or not alive():
                raise


def write_agent_conf(path: Path, node: str, cluster: str, state: Path, broker: Any, slots: int = 4,
                     state_period: float = 0.5, heartbeat_period: float = 0.2, shutdown_timeout: float = 3.0) -> Path:
    """An agent.toml for one test agent on `broker` (host, port), metrics off; returns `path`."""
    path.write_text(f'[agent]\nnode = "{node}"\ncluster = "{cluster}"\nslots = {slots}\nstate_dir = "{state}"\n'
                    f'state_period = {state_period}\nheartbeat_period = {heartbeat_period}\n'
                    f'shutdown_timeout = {shutdown_timeout}\n'
                    f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n[metrics]\nport = 0\n')
    return path
