"""fogctl's contract with a person and a script: exit codes, one-line errors, configuration layers,
steering requests (MQTT 5 request/response) and their refusals, and the pure parsers behind it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid

import pytest

from agent import events, topics
from agent.cli.fogctl import main
from agent.fogctl.config import load_config, parse_broker
from agent.control.fleet import Fleet, LockState, Phase, parse_state, parse_status
from agent.control.rpc_schema import DrainRequest, RequestError, ScaleRequest, check_drain, check_scale, parse_request
from agent.fogctl.testing import FakeAgent, FakeInstance
from agent.schema import ConfigError


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when we return: nothing listens there


# ---- exit codes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", [["status"], ["watch", "--duration", "1"], ["scale", "in_zone", "+1"]])
def test_broker_down_exit_3_one_line_naming_the_address(cmd) -> None:
    port = closed_port()
    proc = subprocess.run([sys.executable, "-m", "agent.cli.fogctl", "--broker", f"127.0.0.1:{port}", *cmd],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "refused" in lines[0]
    assert "Traceback" not in proc.stderr


def test_unknown_host_is_unreachable_too(capsys) -> None:
    code = main(["--broker", "no-such-host.invalid:1883", "--timeout", "2", "status"])
    err = capsys.readouterr().err
    assert code == 3 and "no-such-host.invalid:1883" in err


@pytest.mark.parametrize("argv", [[], ["scale", "in_zone", "2"], ["scale", "in_zone", "+0"], ["nope"],
                                  ["watch", "--count", "x"]])
def test_usage_errors_exit_2(argv, capsys) -> None:
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_bad_filter_and_bad_config_exit_1(capsys, tmp_path, monkeypatch) -> None:
    cfg = tmp_path / "fogctl.toml"
    cfg.write_text('brokr = "x:1"\n')
    assert main(["--config", str(cfg), "status"]) == 1
    err = capsys.readouterr().err
    assert "fogctl.toml" in err and "brokr" in err and len(err.strip().splitlines()) == 1


def test_tls_misconfiguration_is_one_line_exit_1(capsys, tmp_path) -> None:
    code = main(["--broker", f"127.0.0.1:{closed_port()}", "--cafile", str(tmp_path / "missing-ca.crt"), "status"])
    err = capsys.readouterr().err
    assert code == 1 and "TLS set-up failed" in err and len(err.strip().splitlines()) == 1


def test_json_flag_after_the_command(capsys) -> None:
    from agent.cli.fogctl import build_parser

    assert build_parser().parse_args(["status", "--json"]).json is True
    assert build_parser().parse_args(["--json", "status"]).json is True
    assert build_parser().parse_args(["status"]).json is False


# ---- configuration layers ---------------------------------------------------------------------------


def test_config_layers_file_env_options(tmp_path) -> None:
    f = tmp_path / "fogctl.toml"
    f.write_text('broker = "broker.lan:8883"\ncluster = "site1"\ntimeout = 3.0\ncafile = "/etc/ca.crt"\n')
    cfg = load_config({}, env={}, path=f)
    assert (cfg.broker, cfg.cluster, cfg.timeout, cfg.cafile) == ("broker.lan:8883", "site1", 3.0, "/etc/ca.crt")
    cfg = load_config({}, env={"FOGCTL_CLUSTER": "site2", "FOGCTL_TIMEOUT": "7"}, path=f)
    assert (cfg.broker, cfg.cluster, cfg.timeout) == ("broker.lan:8883", "site2", 7.0)
    cfg = load_config({"cluster": "site3", "broker": None}, env={"FOGCTL_CLUSTER": "site2"}, path=f)
    assert cfg.cluster == "site3" and cfg.broker == "broker.lan:8883"
    # The default path follows HOME / XDG_CONFIG_HOME / FOGCTL_CONFIG.
    (tmp_path / ".config").mkdir()
    (tmp_path / ".config" / "fogctl.toml").write_text('cluster = "home"\n')
    assert load_config({}, env={"HOME": str(tmp_path)}).cluster == "home"
    with pytest.raises(ConfigError, match="FOGCTL_TIMEOUT"):
        load_config({}, env={"FOGCTL_TIMEOUT": "soon"}, path=f)
    with pytest.raises(ConfigError, match="cluster"):
        load_config({"cluster": "a/b"}, env={}, path=f)


@pytest.mark.parametrize("text,want", [("h:1", ("h", 1)), ("h", ("h", 1883)), ("[::1]:8883", ("::1", 8883))])
def test_parse_broker(text, want) -> None:
    assert parse_broker(text) == want


@pytest.mark.parametrize("text", ["h:0", "h:x", ":1", "h:70000", "[::1", ""])
def test_parse_broker_rejects(text) -> None:
    with pytest.raises(ValueError):
        parse_broker(text)


# ---- pure parsers ---------------------------------------------------------------------------------


def test_parse_state_tolerates_aliases_and_garbage() -> None:
    n = parse_state("n1", json.dumps({"node": "n1", "cpu_percent": 5, "mem": {"percent": 7.5}, "temp": 48,
                                      "slots": 3, "instances": {"a-1": {"operator": "a", "active": False}}}).encode())
    assert (n.cpu, n.memory, n.temperature, n.slots, n.free_slots) == (5.0, 7.5, 48.0, 3, 2)
    (i,) = n.instances
    assert (i.id, i.operator, i.phase) == ("a-1", "a", Phase.STARTING)
    assert parse_state("n1", b"\xff").error and parse_state("n1", b"[1]").error
    assert parse_status(b"online") == "online" and parse_status(b'{"status":"offline"}') == "offline"
    assert parse_status(b"??") == "unknown"


def test_fleet_from_messages_ignores_other_clusters_and_cleared_topics() -> None:
    msgs = {
        "fog/c/agents/n1/state": json.dumps({"instances": [{"id": "x-1", "operator": "x", "lock": "in_cs"}]}).encode(),
        "fog/c/agents/n1/status": b"online",
        "fog/c/agents/n2/status": b"offline",
        "fog/d/agents/n3/status": b"online",
        "fog/c/agents/n4/state": b"",
    }
    f = Fleet.from_messages("c", msgs)
    assert [(n.node, n.status) for n in f.nodes] == [("n1", "online"), ("n2", "offline")]
    assert f.instances[0].lock is LockState.IN_CS


def test_events_roundtrip_and_validation() -> None:
    e = events.decision(ts=1.5, node="n1", instance="i-1", operator="i", load=600, capacity=500,
                        probability=0.7, draw=0.2, action="duplicate", count=1, type="scale_out")
    assert events.parse(e.to_json()) == e and events.parse(e.to_json().encode()) == e
    assert e.reason is not None and e.reason.ratio == pytest.approx(1.2)
    for bad in (b"{", b"[]", b'{"ts": 1, "node": "n", "type": "explode"}', b'{"ts": "x", "node": "n", "type": "decision"}',
                b'{"ts": 1, "node": "", "type": "decision"}', b'{"ts": 1, "node": "n", "type": "decision", "reason": {"load": 1}}'):
        with pytest.raises(events.EventError):
            events.parse(bad)
    hist = []
    for k in range(25):
        hist = events.remember(hist, events.make("decision", ts=float(k), node="n"), keep=5)
    assert [h.ts for h in hist] == [20.0, 21.0, 22.0, 23.0, 24.0]
    assert events.parse_history(json.dumps([h.to_dict() for h in hist])) == hist


# ---- steering: invariant checks (pure) --------------------------------------------------------------


def _fleet(*nodes) -> Fleet:
    msgs = {}
    for name, status, slots, insts in nodes:
        msgs[f"fog/c/agents/{name}/status"] = status.encode()
        msgs[f"fog/c/agents/{name}/state"] = json.dumps({"slots": slots, "instances": insts}).encode()
    return Fleet.from_messages("c", msgs)


def test_check_scale_refuses_what_would_break_an_invariant() -> None:
    f = _fleet(("n1", "online", 2, [{"id": "z-1", "operator": "z", "keeper": True, "phase": "active"},
                                    {"id": "z-2", "operator": "z", "phase": "active"}]),
               ("n2", "online", 2, [{"id": "z-3", "operator": "z", "phase": "terminating"}]),
               ("n3", "offline", 4, []))
    assert check_scale(f, ScaleRequest("z", 1)) == [("n1", ScaleRequest("z", 1))]  # the keeper's node
    assert check_scale(f, ScaleRequest("z", -1)) == [("n1", ScaleRequest("z", -1, None, ("z-2",)))]
    with pytest.raises(RequestError, match="keeper never terminates, so at most 1"):
        check_scale(f, ScaleRequest("z", -2))
    with pytest.raises(RequestError, match="needs 3 free slots, the online nodes have 1"):
        check_scale(f, ScaleRequest("z", 3))  # n3's 4 free slots are offline
    with pytest.raises(RequestError, match="no instance of operator 'q'"):
        check_scale(f, ScaleRequest("q", 1))
    with pytest.raises(RequestError):
        ScaleRequest("z", 0)
    with pytest.raises(RequestError, match="free slot"):
        check_drain(_fleet(("n1", "online", 1, [{"id": "z-1", "operator": "z", "keeper": True}]),
                           ("n2", "online", 1, [{"id": "y-1", "operator": "y"}])), DrainRequest("n1"))
    with pytest.raises(RequestError, match="offline"):
        check_drain(f, DrainRequest("n3"))
    assert check_drain(f, DrainRequest("n2")) == ["z-3"]
    assert parse_request(ScaleRequest("z", -1).to_dict()) == ScaleRequest("z", -1)
    with pytest.raises(RequestError):
        parse_request({"op": "reboot"})


# ---- steering over the broker with a fake responder -------------------------------------------------


@pytest.fixture
def steer_fleet(mosquitto):
    cluster = "s" + uuid.uuid4().hex[:8]
    a1 = FakeAgent(mosquitto.host, mosquitto.port, cluster, "n1", slots=6, instances=[
        FakeInstance("in_zone-1", "in_zone", keeper=True), FakeInstance("in_zone-2", "in_zone")]).start()
    a2 = FakeAgent(mosquitto.host, mosquitto.port, cluster, "n2", slots=4, instances=[
        FakeInstance("in_zone-3", "in_zone"), FakeInstance("validate-1", "validate", keeper=False)]).start()
    yield cluster, a1, a2
    a1.stop()
    a2.stop()


def run(capsys, broker, cluster, *argv):
    code = main(["--broker", broker.address, "--cluster", cluster, "--timeout", "5", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.broker
def test_scale_plus_two_adds_two_instances(capsys, mosquitto, steer_fleet) -> None:
    cluster, a1, a2 = steer_fleet
    code, out, err = run(capsys, mosquitto, cluster, "--json", "scale", "in_zone", "+2", "--wait", "5")
    assert code == 0, err
    doc = json.loads(out)
    (sent,) = doc["requests"]
    assert sent["node"] == "n1"  # sent to the keeper's agent
    # The pin (docs/fogctl.md: a manual scale pins the count) goes to every online agent first.
    pin = {"v": 1, "op": "pin", "operator": "in_zone", "pipeline": "taxi", "seconds": None, "release": False}
    assert a1.requests == [pin, {"v": 1, "op": "scale", "operator": "in_zone", "delta": 2, "pipeline": None}]
    assert a2.requests[-1] == pin
    assert doc["pinned"] == {"pipeline": "taxi", "seconds": None, "nodes": ["n1", "n2"]}
    assert len(sent["result"]["instances"]) == 2
    assert (doc["instances"], doc["expected"]) == (5, 5)


@pytest.mark.broker
def test_scale_in_refused_locally_before_sending(capsys, mosquitto, steer_fleet) -> None:
    cluster, a1, a2 = steer_fleet
    code, out, err = run(capsys, mosquitto, cluster, "scale", "in_zone", "-3")
    assert code == 1 and "keeper never terminates" in err and len(err.strip().splitlines()) == 1
    assert a1.requests == [] and a2.requests == []
    code, out, err = run(capsys, mosquitto, cluster, "scale", "in_zone", "-2", "--wait", "5")
    assert code == 0, err
    assert "in_zone now has 1 active instances" in out
    # One request per node, naming the leaving instances; the keeper stays.
    # (after the pin, which every online agent gets first)
    pin = {"v": 1, "op": "pin", "operator": "in_zone", "pipeline": "taxi", "seconds": None, "release": False}
    assert a1.requests == [pin, {"v": 1, "op": "scale", "operator": "in_zone", "delta": -1, "pipeline": None,
                                 "instances": ["in_zone-2"]}]
    assert a2.requests == [pin, {"v": 1, "op": "scale", "operator": "in_zone", "delta": -1, "pipeline": None,
                                 "instances": ["in_zone-3"]}]


@pytest.mark.broker
def test_agent_refusal_is_reported(capsys, mosquitto, steer_fleet) -> None:
    cluster, a1, _ = steer_fleet
    a1.refuse = "lock held by validate|in_zone"
    code, _, err = run(capsys, mosquitto, cluster, "scale", "in_zone", "+1")
    assert code == 1 and "n1 refused scale in_zone +1: lock held by validate|in_zone" in err


@pytest.mark.broker
def test_drain_empties_node(capsys, mosquitto, steer_fleet) -> None:
    cluster, _, a2 = steer_fleet
    code, out, err = run(capsys, mosquitto, cluster, "drain", "n2", "--wait", "5")
    assert code == 0, err
    assert "leaving: in_zone-3, validate-1" in out and "n2 is empty" in out
    assert a2.requests == [{"v": 1, "op": "drain", "node": "n2"}]


@pytest.mark.broker
def test_rpc_timeout_when_agent_does_not_answer(capsys, mosquitto, steer_fleet) -> None:
    cluster, a1, _ = steer_fleet
    a1.client.unsubscribe(topics.agent_rpc_inbox(cluster, "n1"))
    time.sleep(0.2)
    code, _, err = run(capsys, mosquitto, cluster, "--timeout", "1", "scale", "in_zone", "+1")
    assert code == 1 and "no reply" in err


def test_agent_actions_the_daemon_side_of_steering() -> None:
    from agent.control.fleet import Instance
    from agent.control.rpc_schema import Action, ActionKind, agent_actions

    local = [Instance("z-1", "z", "n1", keeper=True, phase=Phase.ACTIVE),
             Instance("z-2", "z", "n1", phase=Phase.ACTIVE),
             Instance("z-3", "z", "n1", phase=Phase.STARTING),
             Instance("y-1", "y", "n1", phase=Phase.TERMINATING)]
    assert agent_actions(ScaleRequest("z", 2), "n1", local) == [Action(ActionKind.DUPLICATE, "z-1", 2)]
    assert agent_actions(ScaleRequest("z", -1, None, ("z-2",)), "n1", local) == [Action(ActionKind.TERMINATE, "z-2")]
    for bad in (("z-1",), ("z-3",), ("q-9",)):
        with pytest.raises(RequestError):
            agent_actions(ScaleRequest("z", -1, None, bad), "n1", local)
    assert agent_actions(DrainRequest("n1"), "n1", local) == [
        Action(ActionKind.TERMINATE, "z-2"), Action(ActionKind.TERMINATE, "z-3"), Action(ActionKind.HANDOVER, "z-1")]
    with pytest.raises(RequestError):
        agent_actions(DrainRequest("n2"), "n1", local)
