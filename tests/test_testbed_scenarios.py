"""`fog-agent testbed scenarios`, its pure parts (foglab.tools.testbed_scenarios): the PLAY RECAP's
parse, each step's verdict and the table, without containers (milliseconds). The run itself is a
command (docs/operations.md, "Scenarios per Debian release")."""

from __future__ import annotations

from pathlib import Path

from foglab.tools import testbed, testbed_scenarios as sc

RECAP = """
PLAY RECAP *********************************************************************
tbs1                       : ok=40   changed=18   unreachable=0    failed=0    skipped=20   rescued=0    ignored=0
tbs2                       : ok=23   changed=0    unreachable=0    failed=1    skipped=17   rescued=0    ignored=0
"""


def test_recap_and_gate_lines_are_parsed() -> None:
    recap = sc.parse_recap(RECAP)
    assert recap == {"tbs1": {"ok": 40, "changed": 18, "unreachable": 0, "failed": 0},
                     "tbs2": {"ok": 23, "changed": 0, "unreachable": 0, "failed": 1}}
    line = "tbs1: online, 0 instance(s) of before running again (4.2 s)"
    out = f'ok: [tbs1] => {{"changed": false, "stdout": "{line}", "stdout_lines": ["{line}"]}}'
    assert sc.gate_seconds(out) == [4.2] and sc.gate_seconds("nothing") == []


def test_converge_fails_on_a_failed_or_missing_host_and_idempotence_on_any_change() -> None:
    recap = sc.parse_recap(RECAP)
    assert not sc.converge_verdict(0, recap, ["tbs1", "tbs2"]).ok  # tbs2 failed=1
    good = {"tbs1": dict(recap["tbs1"]), "tbs2": dict(recap["tbs2"], failed=0)}
    assert sc.converge_verdict(0, good, ["tbs1", "tbs2"]).ok
    assert not sc.converge_verdict(2, good, ["tbs1", "tbs2"]).ok
    assert not sc.converge_verdict(0, good, ["tbs1", "tbs2", "tbs3"]).ok  # no recap for a host
    idem = sc.idempotence_verdict(0, good, ["tbs1", "tbs2"])
    assert not idem.ok and "tbs1 (18)" in idem.detail
    quiet = {h: dict(r, changed=0) for h, r in good.items()}
    assert sc.idempotence_verdict(0, quiet, ["tbs1", "tbs2"]).ok


def test_verify_needs_active_connected_and_online_in_fogctl() -> None:
    hosts = ["tbs1", "tbs2"]
    fleet = {"nodes": [{"node": "tbs1", "status": "online"}, {"node": "tbs2", "status": "online"}]}
    active = {h: "active" for h in hosts}
    connected = {h: "connected to 10.215.0.11:1883" for h in hosts}
    assert sc.verify_verdict(active, connected, fleet, hosts).ok
    assert not sc.verify_verdict(dict(active, tbs2="failed"), connected, fleet, hosts).ok
    assert not sc.verify_verdict(active, dict(connected, tbs1="connecting"), fleet, hosts).ok
    assert not sc.verify_verdict(active, connected, None, hosts).ok
    off = {"nodes": [{"node": "tbs1", "status": "online"}, {"node": "tbs2", "status": "offline"}]}
    assert "tbs2 not online" in sc.verify_verdict(active, connected, off, hosts).detail


def test_table_has_a_column_per_release_and_names_failures() -> None:
    report = sc.Report(steps=[sc.Step("bookworm", s, True, 12.3) for s in sc.STEPS] + [
        sc.Step("trixie", "up", True, 3), sc.Step("trixie", "converge", False, 80, "tbs2 failed=1"),
        sc.Step("trixie", "idempotence", None), sc.Step("trixie", "verify", None), sc.Step("trixie", "down", True, 5)],
        gates={"bookworm": [4.0, 5.5]})
    text = sc.table(report)
    lines = text.splitlines()
    assert lines[0].split() == ["STEP", "bookworm", "trixie"]
    assert lines[2].split() == ["converge", "pass", "12", "s", "FAIL", "80", "s"]
    assert lines[3].split()[-1] == "skip"
    assert "trixie converge: tbs2 failed=1" in text and "bookworm health gate: 4.0 s, 5.5 s" in text
    assert not report.ok and report.to_dict()["ok"] is False


def test_the_root_builder_knows_both_releases() -> None:
    argv = testbed.debootstrap_argv(Path("/r"), "amd64", "http://m", "trixie")
    assert argv[-3:] == ["trixie", "/r", "http://m"]
    assert testbed.root_dir(Path("/c"), "amd64", "trixie").name == "trixie-amd64"
    assert testbed.root_dir(Path("/c"), "amd64").name == "bookworm-amd64"
    assert testbed.root_signature("amd64", "trixie") != testbed.root_signature("amd64")
    try:
        testbed.debootstrap_argv(Path("/r"), "amd64", "http://m", "sid")
    except testbed.TestbedError as exc:
        assert "sid" in str(exc)
    else:
        raise AssertionError("an unknown release was accepted")
