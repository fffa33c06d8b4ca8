"""systemd's handling of fog-agent.service checked live on a testbed node (docs/operations.md, "Testbed").

Each check acts on the real unit inside a booted container (systemd as PID 1) and reads what
systemd and journald report: `systemctl show` properties and journal lines. Only the restart-retry
check changes the unit, with a runtime drop-in (`/run/systemd/system/...`, gone after it) that
shortens RestartSec= so that more starts than the default start limit (5 in 10 s) happen within
seconds; it removes the drop-in afterwards.

The node is reached through a `Shell` (a function running one shell line and returning its exit
code and output), so the same checks run over SSH on the testbed or elsewhere.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

Shell = Callable[[str], Tuple[int, str]]
UNIT = "fog-agent.service"
CONFIG = "/etc/fog-agent/agent.toml"
FAST_RESTART_DROPIN = "/run/systemd/system/fog-agent.service.d/zz-testbed-fast-restart.conf"


@dataclass
class Check:
    name: str
    ok: bool
    detail: Dict[str, object]


def parse_show(text: str) -> Dict[str, str]:
    """`systemctl show -p A,B` output (A=value lines) as a dict."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value
    return out


class Node:
    def __init__(self, sh: Shell) -> None:
        self.sh = sh

    def run(self, line: str) -> str:
        code, out = self.sh(line)
        if code != 0:
            raise RuntimeError(f"`{line}` exited {code}: {out.strip()[-300:]}")
        return out

    def show(self, *props: str) -> Dict[str, str]:
        return parse_show(self.run(f"systemctl show -p {','.join(props)} {UNIT}"))

    def cursor(self) -> str:
        out = self.run(f"journalctl -u {UNIT} -n 0 --show-cursor --no-pager")
        return out.strip().splitlines()[-1].split("cursor: ", 1)[-1]

    def journal(self, cursor: str, priority: int = 7, unit_only: bool = True) -> List[str]:
        """Messages after the cursor at `priority` or more urgent (syslog numbers: 4 = warning).

        Filtered here, not with `-p`: journalctl 252 returns nothing for `-p` together with
        `--after-cursor` when the cursor's own entry does not match the priority."""
        unit = f"-u {UNIT} " if unit_only else ""
        out = self.run(f"journalctl {unit}--after-cursor='{cursor}' -o json --output-fields=MESSAGE,PRIORITY "
                       "--no-pager")
        entries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return [str(e.get("MESSAGE", "")) for e in entries if int(e.get("PRIORITY", 6)) <= priority]

    def wait(self, what: str, pred: Callable[[Dict[str, str]], bool], timeout: float,
             props: Tuple[str, ...] = ("MainPID", "ActiveState", "SubState", "NRestarts", "Result")) -> Dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            state = self.show(*props)
            if pred(state):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not reached within {timeout:.0f} s (last {state})")
            time.sleep(0.5)


def _running(s: Dict[str, str]) -> bool:
    return s.get("ActiveState") == "active" and s.get("SubState") == "running" and s.get("MainPID", "0") != "0"


def check_ready(node: Node) -> Check:
    """Type=notify: `active (running)` is reached only by READY=1; STATUS= lines arrive."""
    s = node.wait("running", _running, 120, ("Type", "NotifyAccess", "ActiveState", "SubState", "MainPID",
                                              "StatusText", "WatchdogUSec"))
    ok = s["Type"] == "notify" and s["StatusText"].startswith("connected")
    return Check("ready", ok, {k: s[k] for k in ("Type", "NotifyAccess", "StatusText", "WatchdogUSec")})


def check_reload(node: Node) -> Check:
    """`systemctl reload` (ExecReload, SIGHUP): the log level changes, the process stays."""
    before = node.wait("running", _running, 60)
    cursor = node.cursor()
    node.run(f"sed -i '/^\\[log\\]/,/^\\[/ s/^level = .*/level = \"debug\"/' {CONFIG}")
    try:
        t0 = time.monotonic()
        node.run(f"systemctl reload {UNIT}")
        seconds = time.monotonic() - t0
        after = node.wait("running", _running, 30)
        # journald stores the line a moment after `reload` returns (READY=1 comes first).
        deadline = time.monotonic() + 15
        while True:
            warnings = node.journal(cursor, 4)
            if any(w.startswith("SIGHUP: reloaded") for w in warnings) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        node.run(f"sed -i '/^\\[log\\]/,/^\\[/ s/^level = .*/level = \"info\"/' {CONFIG}")
        node.run(f"systemctl reload {UNIT}")
    line = next((w for w in warnings if w.startswith("SIGHUP: reloaded")), None)
    ok = (line is not None and "log level debug" in line and after["MainPID"] == before["MainPID"]
          and after["NRestarts"] == before["NRestarts"])
    return Check("reload", ok, {"main_pid_kept": after["MainPID"] == before["MainPID"],
                                "journal_warning": line, "reload_seconds": round(seconds, 2)})


def check_journal_priority(node: Node) -> Check:
    """`journalctl -p warning -u fog-agent` shows the agent's warnings (JournalHandler priorities)
    and no info line (a stderr line would have priority 6 and not be listed)."""
    out = node.run(f"journalctl -u {UNIT} -p warning -o json --output-fields=MESSAGE,PRIORITY,LOGGER,"
                   "SYSLOG_IDENTIFIER --no-pager")
    entries = [json.loads(line) for line in out.splitlines() if line.strip()]
    agent = [e for e in entries if e.get("SYSLOG_IDENTIFIER") == "fog-agent"]
    ok = bool(agent) and all(int(e["PRIORITY"]) <= 4 for e in agent) and any(e.get("LOGGER") for e in agent)
    return Check("journal_priority", ok, {"agent_warnings": len(agent),
                                          "example": agent[-1]["MESSAGE"] if agent else None,
                                          "logger": agent[-1].get("LOGGER") if agent else None})


def check_watchdog(node: Node, timeout: float = 150.0) -> Check:
    """SIGSTOP the daemon: its WATCHDOG=1 pings stop, systemd kills it at WatchdogSec and restarts it."""
    before = node.wait("running", _running, 60, ("MainPID", "ActiveState", "SubState", "NRestarts", "WatchdogUSec"))
    cursor = node.cursor()
    pid = before["MainPID"]
    node.run(f"kill -STOP {pid}")
    t0 = time.monotonic()
    after = node.wait("restarted", lambda s: _running(s) and s["MainPID"] != pid, timeout)
    seconds = time.monotonic() - t0
    lines = node.journal(cursor, unit_only=False)
    timeout_line = next((ln for ln in lines if "Watchdog timeout" in ln), None)
    restarts = int(after["NRestarts"]) - int(before["NRestarts"])
    ok = timeout_line is not None and restarts == 1
    return Check("watchdog", ok, {"watchdog_usec": before["WatchdogUSec"], "journal": timeout_line,
                                  "nrestarts_delta": restarts, "stopped_to_running_again_s": round(seconds, 1)})


def check_restart_keeps_retrying(node: Node, kills: int = 8) -> Check:
    """Kill the daemon `kills` times, more than the default start limit allows (5 starts in 10 s):
    StartLimitIntervalSec=0 keeps systemd restarting it instead of leaving it `failed`."""
    node.run(f"mkdir -p {FAST_RESTART_DROPIN.rsplit('/', 1)[0]} && printf '[Service]\\nRestartSec=200ms\\n' > "
             f"{FAST_RESTART_DROPIN} && systemctl daemon-reload")
    try:
        before = node.wait("running", _running, 60)
        t0 = time.monotonic()
        pid = before["MainPID"]
        for _ in range(kills):
            node.run(f"kill -KILL {pid}")
            s = node.wait("a new main process", lambda s: s["MainPID"] not in ("0", pid), 60)
            pid = s["MainPID"]
        seconds = time.monotonic() - t0
        after = node.wait("running", _running, 60)
    finally:
        node.run(f"rm -f {FAST_RESTART_DROPIN} && systemctl daemon-reload")
    limit = node.show("StartLimitIntervalUSec", "StartLimitBurst")
    restarts = int(after["NRestarts"]) - int(before["NRestarts"])
    ok = restarts == kills and after["ActiveState"] == "active"
    return Check("restart_keeps_retrying", ok, {"kills": kills, "nrestarts_delta": restarts,
                                                "seconds": round(seconds, 1), "state": after["ActiveState"],
                                                **limit})


CHECKS = {"ready": check_ready, "reload": check_reload, "journal_priority": check_journal_priority,
          "watchdog": check_watchdog, "restart_keeps_retrying": check_restart_keeps_retrying}


def run_checks(sh: Shell, names: List[str]) -> List[Check]:
    node = Node(sh)
    return [CHECKS[name](node) for name in names]
