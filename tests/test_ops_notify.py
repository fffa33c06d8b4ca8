"""sd_notify and journal logging, against sockets and senders the test owns (systemd is not PID 1 here)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from agent import notify
from agent.journal import JournalHandler, journal_fields


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[Tuple[socket.socket, dict]]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    yield sock, {"NOTIFY_SOCKET": str(path)}
    sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_noop_without_notify_socket() -> None:
    assert notify.enabled({}) is False
    for call in (notify.ready, notify.watchdog, notify.stopping, notify.reloading):
        assert call(env={}) is False
    assert notify.status("x", env={}) is False


def test_messages_reach_the_socket_in_order(notify_socket) -> None:
    sock, env = notify_socket
    assert notify.enabled(env)
    assert notify.ready(env=env)
    assert notify.watchdog(env=env)
    assert notify.status("3 instances\n 1.2k rec/s", env=env)
    assert notify.stopping("draining", env=env)
    assert notify.reloading(env=env, now_usec=42)
    got = [recv(sock) for _ in range(5)]
    assert got == [
        "READY=1",
        "WATCHDOG=1",
        "STATUS=3 instances 1.2k rec/s",
        "STOPPING=1\nSTATUS=draining",
        "RELOADING=1\nMONOTONIC_USEC=42",
    ]


def test_ready_with_status_is_one_datagram_and_status_is_one_line(notify_socket) -> None:
    sock, env = notify_socket
    notify.ready(status="connected\nworkers: 4" + "x" * 1000, env=env)
    msg = recv(sock)
    lines = msg.split("\n")
    assert lines[0] == "READY=1"
    assert len(lines) == 2 and lines[1].startswith("STATUS=connected workers: 4")
    assert len(lines[1]) <= len("STATUS=") + notify.MAX_STATUS_CHARS


def test_abstract_namespace_socket() -> None:
    name = f"fog-agent-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    try:
        assert notify.watchdog(env={"NOTIFY_SOCKET": "@" + name})
        assert recv(sock) == "WATCHDOG=1"
    finally:
        sock.close()


def test_send_failure_is_reported_not_raised(tmp_path: Path, caplog) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")}
    with caplog.at_level(logging.WARNING, logger="agent.notify"):
        assert notify.ready(env=env) is False
    assert "sd_notify" in caplog.text


@pytest.mark.parametrize(
    "env,pid,expected",
    [
        ({}, 10, None),
        ({"WATCHDOG_USEC": "30000000"}, 10, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "10"}, 10, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "11"}, 10, None),  # meant for another process
        ({"WATCHDOG_USEC": "0"}, 10, None),
        ({"WATCHDOG_USEC": "-5"}, 10, None),
        ({"WATCHDOG_USEC": "abc"}, 10, None),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "x"}, 10, None),
    ],
)
def test_watchdog_interval(env, pid, expected) -> None:
    assert notify.watchdog_interval(env, pid=pid) == expected
    period = notify.watchdog_period(env, pid=pid)
    assert period == (None if expected is None else expected / 2)


def test_watchdog_pid_defaults_to_own_pid() -> None:
    env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert notify.watchdog_interval(env) == 2.0
    env["WATCHDOG_PID"] = str(os.getpid() + 1)
    assert notify.watchdog_interval(env) is None


# ---- journal ------------------------------------------------------------------------------------


def _record(level: int = logging.WARNING, **extra) -> logging.LogRecord:
    logger = logging.getLogger("agent.node.test")
    record = logger.makeRecord(logger.name, level, "/x/daemon.py", 12, "hello %s", ("w",), None, "run", extra)
    return record


def test_journal_fields_carry_context_and_priority() -> None:
    rec = _record(node="n1", operator="in_zone", instance="in_zone-3")
    f = journal_fields(rec, "fog-agent")
    assert f["NODE"] == "n1" and f["OPERATOR"] == "in_zone" and f["INSTANCE"] == "in_zone-3"
    assert f["PRIORITY"] == "4"
    assert f["LOGGER"] == "agent.node.test"
    assert f["CODE_FILE"] == "/x/daemon.py" and f["CODE_LINE"] == 12 and f["CODE_FUNC"] == "run"
    assert f["SYSLOG_IDENTIFIER"] == "fog-agent"
    bare = journal_fields(_record(level=logging.DEBUG), "fog-agent")
    assert "NODE" not in bare and "OPERATOR" not in bare and "INSTANCE" not in bare
    assert bare["PRIORITY"] == "7"
    assert journal_fields(_record(level=logging.ERROR), "x")["PRIORITY"] == "3"
    assert journal_fields(_record(level=logging.CRITICAL), "x")["PRIORITY"] == "2"
    assert journal_fields(_record(level=logging.INFO), "x")["PRIORITY"] == "6"


def test_journal_handler_through_real_systemd_python(monkeypatch) -> None:
    """Use systemd-python's own send() (field formatting included); only the final sendv is caught."""
    journal = pytest.importorskip("systemd.journal")
    sent: List[tuple] = []
    monkeypatch.setattr(journal, "sendv", lambda *args: sent.append(args))
    handler = JournalHandler(identifier="fog-agent")
    logger = logging.getLogger("agent.test.journal")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("worker %s hung", "in_zone-3", extra={"node": "n2", "instance": "in_zone-3"})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("crashed", extra={"operator": "sink"})
    finally:
        logger.removeHandler(handler)
    assert len(sent) == 2
    first = set(sent[0])
    assert {"MESSAGE=worker in_zone-3 hung", "NODE=n2", "INSTANCE=in_zone-3", "PRIORITY=4",
            "SYSLOG_IDENTIFIER=fog-agent"} <= first
    assert not any(a.startswith("OPERATOR=") for a in first)
    second = sent[1]
    assert "OPERATOR=sink" in second and "PRIORITY=3" in second
    assert any(a.startswith("EXCEPTION_TEXT=") and "RuntimeError: boom" in a for a in second)


def test_journal_handler_survives_a_failing_sender(monkeypatch) -> None:
    errors: List[logging.LogRecord] = []

    def broken(message: str, **fields: object) -> None:
        raise OSError("journald is gone")

    handler = JournalHandler(sender=broken)
    monkeypatch.setattr(handler, "handleError", errors.append)
    handler.emit(_record())
    assert len(errors) == 1


def test_setup_logging_picks_journal_only_under_systemd(tmp_path: Path) -> None:
    """JOURNAL_STREAM set + systemd-python present -> JournalHandler; otherwise key=value on stderr."""
    pytest.importorskip("systemd.journal")
    code = (
        "import logging, agent.log as l; l.setup_logging(); "
        "print(type(logging.getLogger().handlers[0]).__name__)"
    )
    env = dict(os.environ)
    env.pop("JOURNAL_STREAM", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "StderrHandler"  # agent.log: a StreamHandler on the stderr of the moment
    env["JOURNAL_STREAM"] = "8:1234"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "JournalHandler"
