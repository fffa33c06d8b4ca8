"""2-FGME / RA1 / RA2 through the private Mosquitto: one paho client per node, verifier on events."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from foglab.tools.gme_bench import BenchConfig, run_bench


def test_bench_runs_the_damped_variant_by_default_and_simulate_the_published_one():
    """`fog-agent bench gme` (and its BenchConfig) default to DEVIATIONS 4 + 5, `--no-damping`
    gives the published algorithm; `fog-agent simulate gme` reproduces the thesis's message
    counts, so it stays published unless `--damping`; `fog-agent chaos` runs its fgme pipeline
    damped unless `--no-fgme-damping` (docs/gme.md, "The default: the damped variant")."""
    from agent.cli.main import build_parser
    from foglab.sim.gme_sim import GmeSimConfig

    parser = build_parser()
    assert BenchConfig().damping is True
    assert parser.parse_args(["bench", "gme"]).damping is True
    assert parser.parse_args(["bench", "gme", "--damping"]).damping is True
    assert parser.parse_args(["bench", "gme", "--no-damping"]).damping is False
    assert GmeSimConfig().damping is False
    assert parser.parse_args(["simulate", "gme"]).damping is False
    assert parser.parse_args(["simulate", "gme", "--damping"]).damping is True
    assert parser.parse_args(["chaos", "--coordination", "fgme"]).fgme_damping is True
    assert parser.parse_args(["chaos", "--no-fgme-damping"]).fgme_damping is False
    assert parser.parse_args(["bench", "gme-check"]).damping is False  # the checker starts from the transcription


def test_gme_check_cli_checks_the_damped_variant_on_request(capsys):
    """`bench gme-check --damping` searches DEVIATIONS 4 + 5 (the bench's default variant):
    another state space than the published one's, and the class attributes are restored."""
    from agent.cli.main import main
    from agent.protocol.gme_fgme import FgmeNode

    reports = {}
    for flag in ([], ["--damping"]):
        assert main(["bench", "gme-check", "--groups", "2,1", "--requests", "1", "--json", *flag]) == 0
        reports[bool(flag)] = json.loads(capsys.readouterr().out)
    assert reports[True]["damping"] is True and reports[False]["damping"] is False
    assert reports[True]["verdict"] == reports[False]["verdict"] == "ok"
    assert reports[True]["states"] != reports[False]["states"]
    assert FgmeNode.damped is False and FgmeNode.yield_once is False


@pytest.mark.broker
@pytest.mark.parametrize("alg", ["2fgme", "ra1", "ra2"])
def test_real_broker_run_is_safe_and_serves_every_request(mosquitto, alg):
    r = run_bench(BenchConfig(algorithm=alg, nodes=4, entries=3, think_ms=20, cs_ms=20,
                              host=mosquitto.host, port=mosquitto.port, timeout_s=60))
    assert r["errors"] == []
    assert r["safety_violations"] == 0
    assert r["unserved_requests"] == 0 and r["cs_entries"] == 12
    assert r["timed_out"] is False and "node_states" not in r
    assert r["damping"] is (True if alg == "2fgme" else None)  # the default variant; RA1/RA2 have none
    # the timeline accounts for every message sent, by kind
    assert sum(sum(row["sent"].values()) for row in r["timeline"]) == r["messages"]
    if alg == "ra1":
        assert r["messages"] == 12 * 2 * 3  # 2 (n - 1) per entry, also on the wire
        assert {k for row in r["timeline"] for k in row["sent"]} == {"req", "ack"}


@pytest.mark.broker
def test_nodes_in_separate_processes_share_the_verifier_clock(mosquitto):
    r = run_bench(BenchConfig(algorithm="2fgme", nodes=6, entries=2, think_ms=20, cs_ms=20,
                              host=mosquitto.host, port=mosquitto.port, timeout_s=60, procs=2))
    assert r["procs"] == 2
    assert r["errors"] == [] and r["timed_out"] is False
    assert r["safety_violations"] == 0 and r["unserved_requests"] == 0 and r["cs_entries"] == 12
    assert sum(sum(row["sent"].values()) for row in r["timeline"]) == r["messages"] > 0


@pytest.mark.broker
def test_timeout_ends_the_run_with_a_partial_report_and_every_nodes_state(mosquitto):
    """A CS of 60 s cannot finish in 1.5 s: the run must end at the deadline (the node loops
    used to ignore the stop flag, and shutdown joined each thread for 2 s), say so, and dump
    every node: the one in the CS, the ones waiting for it."""
    t0 = time.monotonic()
    r = run_bench(BenchConfig(algorithm="2fgme", nodes=4, entries=2, think_ms=10, cs_ms=60_000,
                              host=mosquitto.host, port=mosquitto.port, timeout_s=1.5))
    assert time.monotonic() - t0 < 10
    assert r["timed_out"] is True
    assert r["unserved_requests"] > 0
    states = r["node_states"]
    assert [d["node"] for d in states] == [0, 1, 2, 3]
    assert {d["core"]["group"] for d in states} == {0, 1}
    in_cs = [d for d in states if d["core"]["state"] == "in_cs"]
    assert in_cs and len({d["core"]["group"] for d in in_cs}) == 1
    assert all(d["core"]["state"] == "requesting" for d in states if d not in in_cs)
    for d in states:
        assert {"phase", "requests_left", "reorder_held", "inbox_len", "paho_out_len"} <= set(d)
        assert {"waiting_reqs", "reqs_to_send", "competitors_authorized", "acks_rcvd", "epoch"} <= set(d["core"])
    assert r["stuck_threads"] == []
    json.dumps(r)  # the report is JSON as it is


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli.main", "bench", "gme", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.broker
def test_cli_without_broker_starts_a_private_one_and_a_timeout_exits_3():
    ok = _cli("--nodes", "4", "--entries", "2", "--think-ms", "10", "--cs-ms", "10", "--json")
    assert ok.returncode == 0, ok.stderr
    r = json.loads(ok.stdout)
    assert r["cs_entries"] == 8 and r["safety_violations"] == 0 and r["timed_out"] is False
    late = _cli("--nodes", "4", "--entries", "2", "--cs-ms", "60000", "--timeout", "1", "--json")
    assert late.returncode == 3
    assert json.loads(late.stdout)["timed_out"] is True
    assert "timed out" in late.stderr and "Traceback" not in late.stderr


@pytest.mark.broker
def test_timeout_with_nodes_in_separate_processes_exits_3_with_every_nodes_state():
    """The 48- and 96-node runs spread the nodes over processes: there the dump of each node
    crosses a pipe from its worker process. A timeout must still end the run, exit 3 and report
    every node of every process (the node in the CS and the ones waiting for it)."""
    t0 = time.monotonic()
    late = _cli("--nodes", "4", "--entries", "2", "--think-ms", "10", "--cs-ms", "60000",
                "--procs", "2", "--timeout", "1.5", "--json")
    assert time.monotonic() - t0 < 40
    assert late.returncode == 3, late.stderr
    r = json.loads(late.stdout)
    assert r["procs"] == 2 and r["timed_out"] is True and r["unserved_requests"] > 0
    assert r["errors"] == [] and r["stuck_threads"] == []
    states = r["node_states"]
    assert [d["node"] for d in states] == [0, 1, 2, 3]
    in_cs = [d for d in states if d["core"]["state"] == "in_cs"]
    assert in_cs and len({d["core"]["group"] for d in in_cs}) == 1
    assert all(d["core"]["state"] == "requesting" for d in states if d not in in_cs)
    assert "timed out" in late.stderr and "Traceback" not in late.stderr


def test_cli_unreachable_broker_is_one_line_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        p = _cli("--broker", f"127.0.0.1:{port}", "--nodes", "4", "--entries", "1")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "unreachable" in p.stderr


@pytest.mark.broker
def test_bench_clients_turn_nagle_off(mosquitto):
    """paho 2.2 leaves Nagle on: a small publish behind an unacknowledged one then waits for the
    broker's delayed ACK, which serializes each node's messages (the per-publisher queue under
    which 2-FGME's churn feeds itself, docs/gme.md). The bench's clients must set TCP_NODELAY."""
    import threading

    from foglab.tools.gme_bench import _Node
    from foglab.sim.gme_check import make_nodes

    cfg = BenchConfig(nodes=2, host=mosquitto.host, port=mosquitto.port)
    node = _Node(make_nodes("2fgme", (1, 1))[0], cfg, "fog/gme-bench/nagle", threading.Event())
    try:
        assert node.subscribed.wait(10)
        sock = node.client.socket()
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        node.client.disconnect()
        node.client.loop_stop()
