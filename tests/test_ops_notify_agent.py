"""sd_notify end to end: the real agent daemon (`python -m agent run`) against a NOTIFY_SOCKET the
test owns. READY=1 only once the broker is reachable; WATCHDOG=1 at half of WATCHDOG_USEC; when a
worker hangs (SIGSTOP: alive, silent), the pings stop.

Workers are a minimal stand-in that speaks the agent<->worker contract of agent/instance/spec.py
(ready, heartbeats), started through the daemon's own supervisor, so that the test depends on the
daemon's health gating and not on the data path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent

import agent.node.daemon  # noqa: E402,F401  (a broken daemon must fail here, not skip)
import psutil  # noqa: E402

WORKER = r'''
import json, sys, threading, time
spec = json.loads(sys.stdin.readline())
stop = threading.Event()
def reader():
    for line in sys.stdin:
        if json.loads(line).get("event") == "stop":
            stop.set()
    stop.set()
threading.Thread(target=reader, daemon=True).start()
sys.stdout.write(json.dumps({"event": "ready"}) + "\n"); sys.stdout.flush()
hb = 0
while not stop.wait(0.2):
    hb += 1
    sys.stdout.write(json.dumps({"event": "heartbeat", "stats": {"load": 1.0, "capacity": 100.0, "hb": hb}}) + "\n")
    sys.stdout.flush()
sys.stdout.write(json.dumps({"event": "exit", "code": 0, "reason": "stopped"}) + "\n"); sys.stdout.flush()
'''

PIPELINE = """
[pipeline]
name = "wd"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""

WATCHDOG_USEC = 1_000_000  # WatchdogSec=1s: the agent must ping every 0.5 s


class NotifyListener:
    """The datagram socket systemd would own; records (monotonic time, message)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.got: List[Tuple[float, str]] = []

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.got.append((time.monotonic(), self.sock.recv(4096).decode()))
            except socket.timeout:
                pass

    def pump_until(self, pred, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.pump(0.1)
            if pred():
                return True
        return False

    def times(self, key: str, since: float = 0.0) -> List[float]:
        return [t for t, m in self.got if t >= since and key in m.split("\n")]

    def close(self) -> None:
        self.sock.close()


def start_agent(tmp_path: Path, port: int, sock: Path, worker: Path) -> subprocess.Popen:
    conf = tmp_path / "agent.toml"
    conf.write_text(
        f'[agent]\nnode = "wd1"\ncluster = "ops"\nslots = 2\nstate_dir = "{tmp_path}/state"\n'
        f"state_period = 1.0\nheartbeat_period = 0.2\nshutdown_timeout = 3.0\n"
        f'[mqtt]\nhost = "127.0.0.1"\nport = {port}\nkeepalive = 5\n[metrics]\nport = 0\n'
    )
    env = dict(os.environ, NOTIFY_SOCKET=str(sock), WATCHDOG_USEC=str(WATCHDOG_USEC), PYTHONPATH=str(ROOT))
    env.pop("WATCHDOG_PID", None)
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(conf),
         "--worker-command", json.dumps([sys.executable, str(worker)])],
        stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
    )


@pytest.fixture
def late_broker(tmp_path: Path) -> Iterator[Tuple[int, object]]:
    """A port chosen now, a broker started on it only when the test says so."""
    from conftest import free_port, start_broker, stop_broker

    port = free_port()
    started: List[object] = []
    yield port, lambda: started.append(start_broker(tmp_path / "broker", port=port)) or started[-1]
    for b in started:
        stop_broker(b)


def stop_agent(agent: subprocess.Popen) -> None:
    if agent.poll() is None:
        for c in psutil.Process(agent.pid).children(recursive=True):
            try:
                os.kill(c.pid, signal.SIGCONT)
            except OSError:
                pass
        agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(timeout=15)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_agent_ready_only_after_connect_then_periodic_watchdog(tmp_path: Path, late_broker) -> None:
    port, start = late_broker
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    listener = NotifyListener(tmp_path / "notify.sock")
    agent = start_agent(tmp_path, port, tmp_path / "notify.sock", worker)
    log = tmp_path / "agent.log"
    try:
        # 1. No broker yet: the agent must not claim to be ready.
        listener.pump(3.0)
        assert agent.poll() is None, log.read_text()
        assert not listener.times("READY=1"), listener.got

        # 2. Broker up: READY=1 follows the connection, once.
        t_broker = time.monotonic()
        start()
        assert listener.pump_until(lambda: listener.times("READY=1"), 20), log.read_text()[-3000:]
        assert listener.times("READY=1")[0] > t_broker
        listener.pump(0.5)
        assert len(listener.times("READY=1")) == 1

        # 3. Periodic WATCHDOG=1 at about half of WatchdogSec, with a STATUS= line.
        t0 = time.monotonic()
        listener.pump(3.0)
        pings = listener.times("WATCHDOG=1", since=t0)
        assert len(pings) >= 4, listener.got
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert max(gaps) < WATCHDOG_USEC / 1e6, gaps  # never late enough for systemd to fire
        assert any("STATUS=" in m for _, m in listener.got)

        # 4. SIGTERM: STOPPING=1, and no ping after it.
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0, log.read_text()[-2000:]
        listener.pump(0.5)
        stopping = listener.times("STOPPING=1")
        assert stopping, listener.got
        assert not listener.times("WATCHDOG=1", since=stopping[0] + 0.01)
    finally:
        stop_agent(agent)
        listener.close()


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_watchdog_pings_stop_while_a_worker_hangs(tmp_path: Path, mosquitto) -> None:
    from agent.node.deploy import deploy

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    listener = NotifyListener(tmp_path / "notify.sock")
    agent = start_agent(tmp_path, mosquitto.port, tmp_path / "notify.sock", worker)
    log = tmp_path / "agent.log"
    try:
        assert listener.pump_until(lambda: listener.times("READY=1"), 20), log.read_text()[-3000:]
        placed = deploy(PIPELINE, mosquitto.host, mosquitto.port, "ops", timeout=20)
        assert len(placed) == 2 and {d.node for d in placed} == {"wd1"}
        # The agent also runs a fork server (docs/runtime.md, "Pre-started workers"): take the
        # pids of the two placed instances from the daemon's log. Each is the agent's child (a
        # cold start) or its fork server's.
        started = dict(re.findall(r'instance=(\S+) msg="started worker pid (\d+)"', log.read_text()))
        assert {d.instance for d in placed} <= set(started), log.read_text()[-2000:]
        children = [psutil.Process(int(started[d.instance])) for d in placed]
        for c in children:
            parent = c.parent()
            assert parent is not None and (parent.pid == agent.pid or (
                parent.ppid() == agent.pid and "agent.instance.forkserver" in " ".join(parent.cmdline()))), (
                c.pid, parent and parent.cmdline())
        listener.pump(1.0)
        t_ok = time.monotonic()
        listener.pump(1.5)
        assert len(listener.times("WATCHDOG=1", since=t_ok)) >= 2  # healthy workers: pings go on

        t_hang = time.monotonic()
        os.kill(children[0].pid, signal.SIGSTOP)  # alive but silent: a hung worker
        listener.pump(10.0)
        pings = listener.times("WATCHDOG=1", since=t_hang)
        # From the hang on, the pings must pause for longer than WatchdogSec: that is what lets
        # systemd restart a service whose worker hangs and is not recovered.
        seq = [t_hang] + pings + [time.monotonic()]
        longest = max(b - a for a, b in zip(seq, seq[1:]))
        # Expected: a pause from "heartbeat overdue" (~1 s) to the supervisor's kill (~5 s). Ask for
        # 2.5x WatchdogSec so that scheduling jitter on a loaded machine cannot fake it.
        assert longest > 2.5 * WATCHDOG_USEC / 1e6, (
            f"watchdog kept pinging while a worker was hung: longest gap {longest:.2f}s, "
            f"pings at {[round(p - t_hang, 2) for p in pings]}\n" + log.read_text()[-3000:]
        )
        # ... and they resume once the supervisor has replaced the hung worker.
        assert any(p > t_hang + 5.0 for p in pings), [round(p - t_hang, 2) for p in pings]
    finally:
        stop_agent(agent)
        listener.close()


@pytest.mark.broker
@pytest.mark.timeout(90)
def test_sighup_reloads_the_log_level_and_never_exits(tmp_path: Path, mosquitto) -> None:
    """`systemctl reload` (ExecReload= sends SIGHUP): the agent stays up, re-reads agent.toml,
    applies [log] level, names what needs a restart, tells systemd RELOADING=1 then READY=1; a
    broken file is refused with one warning. Python's default for SIGHUP is to die (exit -1/129)."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    listener = NotifyListener(tmp_path / "notify.sock")
    agent = start_agent(tmp_path, mosquitto.port, tmp_path / "notify.sock", worker)
    log = tmp_path / "agent.log"
    conf = tmp_path / "agent.toml"
    try:
        assert listener.pump_until(lambda: listener.times("READY=1"), 20), log.read_text()[-3000:]
        original = conf.read_text()
        conf.write_text(original.replace("slots = 2", "slots = 3") + '[log]\nlevel = "debug"\n')
        t_hup = time.monotonic()
        agent.send_signal(signal.SIGHUP)
        assert listener.pump_until(lambda: listener.times("READY=1", since=t_hup), 10), log.read_text()[-3000:]
        assert listener.times("RELOADING=1", since=t_hup), listener.got
        text = log.read_text()
        assert re.search(r"SIGHUP: reloaded \S+: log level debug; changed \[agent\] need a restart", text), text[-2000:]
        listener.pump(1.0)
        assert agent.poll() is None, text[-2000:]

        conf.write_text("[agent\nbroken")
        mark = len(log.read_text())
        agent.send_signal(signal.SIGHUP)
        listener.pump(1.5)
        assert agent.poll() is None, log.read_text()[-2000:]
        assert "not reloaded, keeping the running configuration" in log.read_text()[mark:]

        # The level really applies: at "error", the next refusal (a warning) is not logged.
        conf.write_text(original + '[log]\nlevel = "error"\n')
        agent.send_signal(signal.SIGHUP)
        listener.pump(1.0)
        assert "SIGHUP: reloaded" in log.read_text()[mark:].split("not reloaded", 1)[1]
        conf.write_text("[agent\nbroken")
        mark = len(log.read_text())
        agent.send_signal(signal.SIGHUP)
        listener.pump(1.5)
        assert agent.poll() is None, log.read_text()[-2000:]
        assert "not reloaded" not in log.read_text()[mark:]

        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0, log.read_text()[-2000:]
    finally:
        stop_agent(agent)
        listener.close()
