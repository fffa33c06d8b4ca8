"""`fog-agent testbed scenarios`: the roles' converge, idempotence and verify on each Debian release.

Why, and why not molecule: what molecule's default scenario gives a role (create, converge,
idempotence, verify, destroy, per platform) is what a change of the roles needs before it reaches
a fleet whose nodes may run the next Debian release; the testbed already boots real Debian
machines with systemd as PID 1, so each platform here is a testbed of a cached root of that
release, and the steps are the playbook the site runs (`ansible/site.yml`, every role):

- **up**: a small fleet of the release's root (its own prefix, bridge and subnet, beside a
  developer's testbed), the `.deb` given;
- **converge**: `site.yml`, failed=0 and unreachable=0 on every host;
- **idempotence**: `site.yml` again, changed=0 on every host;
- **verify**: on every node `fog-agent.service` is active and says `connected` (its sd_notify
  STATUS), and `fogctl status` through the site broker sees every node online;
- **down**: the testbed removed (always, also after a failed step).

A step that fails skips the later ones of that release (not the teardown). The pure parts (the
recap's parse, each step's verdict, the table) are tested without containers
(tests/test_testbed_scenarios.py); the run is a command, not a test (minutes per release).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import agent
from foglab.tools import testbed

STEPS = ("up", "converge", "idempotence", "verify", "down")
# Beside a developer's testbed (fog*/fogtb0/10.213.0) and the suite's (tbt*/fogtbt0/10.214.0).
PREFIX, BRIDGE, SUBNET = "tbs", "fogtbs0", "10.215.0"
ANSIBLE_DIR = Path(agent.__file__).resolve().parents[1] / "ansible"
_RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)
# `"stdout": "..."` only: -v prints the line again in stdout_lines.
_GATE = re.compile(r'"stdout": "(\S+): online, (\d+) instance\(s\) of before running again \(([\d.]+) s\)')

Progress = Callable[[str], None]


@dataclass
class Step:
    suite: str
    step: str
    ok: Optional[bool]  # None: skipped (an earlier step of the release failed)
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Report:
    steps: List[Step] = field(default_factory=list)
    gates: Dict[str, List[float]] = field(default_factory=dict)  # suite -> health gate seconds per node

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    def to_dict(self) -> Dict[str, object]:
        return {"ok": self.ok, "steps": [asdict(s) for s in self.steps], "gates": self.gates}


def parse_recap(text: str) -> Dict[str, Dict[str, int]]:
    """PLAY RECAP lines of ansible-playbook's default output: host -> ok/changed/unreachable/failed."""
    return {m.group(1): {"ok": int(m.group(2)), "changed": int(m.group(3)), "unreachable": int(m.group(4)),
                         "failed": int(m.group(5))} for m in _RECAP.finditer(text)}


def gate_seconds(text: str) -> List[float]:
    """The health gate's waits in a verbose run (its `wait` prints the seconds it took)."""
    return [float(m.group(3)) for m in _GATE.finditer(text)]


def converge_verdict(rc: int, recap: Dict[str, Dict[str, int]], hosts: Sequence[str]) -> Step:
    missing = [h for h in hosts if h not in recap]
    bad = [h for h, r in recap.items() if r["failed"] or r["unreachable"]]
    ok = rc == 0 and not missing and not bad
    detail = " ".join(f"{h} ok={r['ok']} changed={r['changed']} failed={r['failed']}" for h, r in sorted(recap.items()))
    if missing:
        detail += f"; no recap for {', '.join(missing)}"
    return Step("", "converge", ok, detail=detail or f"exit {rc}, no recap")


def idempotence_verdict(rc: int, recap: Dict[str, Dict[str, int]], hosts: Sequence[str]) -> Step:
    step = converge_verdict(rc, recap, hosts)
    changed = [h for h, r in recap.items() if r["changed"]]
    step.step = "idempotence"
    step.ok = bool(step.ok) and not changed
    if changed:
        step.detail = "changed on " + ", ".join(f"{h} ({recap[h]['changed']})" for h in sorted(changed))
    return step


def verify_verdict(services: Dict[str, str], statuses: Dict[str, str], fleet: Optional[dict],
                   hosts: Sequence[str]) -> Step:
    """services: node -> `systemctl is-active`; statuses: node -> the unit's StatusText; fleet: the
    `fogctl status --json` document read through the site broker (None: it could not be read)."""
    problems = []
    for h in hosts:
        if services.get(h) != "active":
            problems.append(f"{h} {services.get(h) or 'unknown'}")
        elif "connected" not in statuses.get(h, ""):
            problems.append(f"{h} not connected ({statuses.get(h) or 'no status'})")
    online = {n.get("node") for n in (fleet or {}).get("nodes") or [] if n.get("status") == "online"}
    if fleet is None:
        problems.append("fogctl status unreadable")
    else:
        problems += [f"fogctl: {h} not online" for h in hosts if h not in online]
    return Step("", "verify", not problems,
                detail="; ".join(problems) or f"{len(hosts)} agents active, connected, online in fogctl")


def table(report: Report) -> str:
    suites = list(dict.fromkeys(s.suite for s in report.steps))
    cells = {(s.suite, s.step): s for s in report.steps}
    rows = [["STEP"] + suites]
    for step in STEPS:
        row = [step]
        for suite in suites:
            s = cells.get((suite, step))
            row.append("-" if s is None else "skip" if s.ok is None else
                       f"{'pass' if s.ok else 'FAIL'} {s.seconds:.0f} s")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for s in report.steps:
        if s.ok is False:
            lines.append(f"{s.suite} {s.step}: {s.detail}")
    for suite, waits in report.gates.items():
        if waits:
            lines.append(f"{suite} health gate: " + ", ".join(f"{w:.1f} s" for w in waits) + " per node")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The run (root, containers, ansible-playbook).


def _ansible(inventory: str, log: Path, timeout: float, args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    bin_dir = Path(sys.executable).parent
    playbook = str(bin_dir / "ansible-playbook") if (bin_dir / "ansible-playbook").exists() else (
        shutil.which("ansible-playbook") or "ansible-playbook")
    tmp = log.parent / "ansible-tmp"
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp), ANSIBLE_GATHERING="explicit", ANSIBLE_STDOUT_CALLBACK="default")
    # -v: the health gate's wait prints how long it waited (gate_seconds reads it back).
    proc = subprocess.run([playbook, "-v", "-i", inventory, "site.yml", *args], cwd=str(ANSIBLE_DIR), env=env,
                          capture_output=True, text=True, timeout=timeout)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def _verify(run: Path, hosts: Sequence[str], state: testbed.State) -> Step:
    services, statuses = {}, {}
    for h in hosts:
        out = testbed.ssh(h, "systemctl is-active fog-agent.service; systemctl show -p StatusText --value "
                             "fog-agent.service", check=False, run=run, timeout=60)
        lines = out.stdout.splitlines() + ["", ""]
        services[h], statuses[h] = lines[0].strip(), lines[1].strip()
    from foglab.tools.testbed_pipeline import _fogctl

    broker = f"{state.nodes[0]['address']}:1883"
    try:
        fleet: Optional[dict] = _fogctl(broker, state.admin_password or "", "status", timeout=60)
    except (testbed.TestbedError, ValueError, subprocess.TimeoutExpired):
        fleet = None
    return verify_verdict(services, statuses, fleet, hosts)


def run_scenarios(deb: Path, suites: Sequence[str] = testbed.SUITES, nodes: int = 2,
                  arch: str = "amd64", progress: Progress = lambda line: None,
                  ansible_timeout: float = 1800.0) -> Report:
    cache = testbed.cache_dir()
    logs = cache / "scenarios"
    logs.mkdir(parents=True, exist_ok=True)
    run = cache / "scenarios-run"
    report = Report()
    for suite in suites:
        if suite not in testbed.SUITES:
            raise testbed.TestbedError(f"--distros {suite}: expected some of {', '.join(testbed.SUITES)}")
    for suite in suites:
        failed = False

        def record(step: Step, started: float) -> None:
            nonlocal failed
            step.suite, step.seconds = suite, round(time.monotonic() - started, 1)
            report.steps.append(step)
            failed = failed or not step.ok
            progress(f"{suite} {step.step}: {'pass' if step.ok else 'FAIL'} in {step.seconds:.0f} s {step.detail}")

        started = time.monotonic()
        try:
            up = testbed.up(nodes, arch=arch, deb=deb, run=run, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET,
                            suite=suite, progress=progress)
            hosts = [n["name"] for n in up.nodes]
            record(Step(suite, "up", True, detail=f"{nodes} nodes" + (", root built" if up.root_built else "")),
                   started)
        except testbed.TestbedError as exc:
            record(Step(suite, "up", False, detail=str(exc)), started)
            hosts, up = [], None
        try:
            for name, judge in (("converge", converge_verdict), ("idempotence", idempotence_verdict)):
                if failed:
                    report.steps.append(Step(suite, name, None))
                    continue
                started = time.monotonic()
                proc = _ansible(up.inventory, logs / f"{suite}-{name}.log", ansible_timeout)
                if name == "converge":
                    report.gates[suite] = gate_seconds(proc.stdout)
                record(judge(proc.returncode, parse_recap(proc.stdout), hosts), started)
            if failed:
                report.steps.append(Step(suite, "verify", None))
            else:
                started = time.monotonic()
                state = testbed.load_state(run=run)
                assert state is not None
                record(_verify(run, hosts, state), started)
        finally:
            if up is not None:
                started = time.monotonic()
                try:
                    testbed.down(run=run, progress=progress)
                    record(Step(suite, "down", True), started)
                except testbed.TestbedError as exc:
                    record(Step(suite, "down", False, detail=str(exc)), started)
                    raise
            else:
                report.steps.append(Step(suite, "down", None))
    return report
