"""One validation everywhere (agent.pipeline_check), sans-IO: no broker is started here.

- check-config catches what used to pass it and fail later: an MQTT feedback loop, an
  `[operators] modules` entry that does not import, a misspelt function (named as such), an
  operator form the loader cannot build; with --json it prints a JSON object on an error too.
- `fog-agent deploy` and `fogctl deploy` run the same checks before they connect to anything and
  print check-config's lines; nothing is spawned (no connection is even opened).
- Both deploys end with the same exit status for the same outcome (agent.exitcodes), and
  docs/fogctl.md prints that table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import pytest

from agent import exitcodes
from agent.cli import config_cmd

ROOT = Path(__file__).resolve().parent.parent

LOOP = """
[pipeline]
name = "loop"
[[operator]]
name = "readings"
kind = "source"
function = "agent.operators.taxi:mqtt_source"
params = {{ topic = "{filt}" }}
[[operator]]
name = "out"
kind = "sink"
function = "agent.operators.builtin:mqtt_sink"
params = {{ topic = "{topic}" }}
"""

# The measured case: a params typo of a keyed operator (its worker failed with KeyError 'field').
TYPO = """
[pipeline]
name = "typo"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "valid"
function = "agent.operators.builtin:validate"
key = "medallion"
[[operator]]
name = "fares"
function = "agent.operators.keyed:keyed_sum"
params = { feild = "fare_amount" }
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


@pytest.fixture(autouse=True)
def no_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No node agent.toml unless a test gives one (not the machine's /etc/fog-agent/agent.toml)."""
    monkeypatch.setenv("FOG_AGENT_CONFIG", str(tmp_path / "no-such-agent.toml"))


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def check(path: Path, capsys: Any, agent_config: Any = None, as_json: bool = False) -> Tuple[int, List[str], str]:
    """check-config in this process: (exit status, stderr lines, stdout)."""
    args = argparse.Namespace(file=str(path), kind=None, json=as_json,
                              agent_config=str(agent_config) if agent_config else None)
    rc = config_cmd.run(args)
    out, err = capsys.readouterr()
    return rc, [line for line in err.splitlines() if line], out


# ---- check-config: what it used to let through ------------------------------------------------------


LOOP_CASES = [  # (source filter, sink topic, whether the sink's messages come back in)
    ("lab/#", "lab/out", True),
    ("lab/+", "lab/out", True),
    ("+/out", "lab/out", True),
    ("#", "lab/out", True),
    ("lab/out", "lab/out", True),
    ("lab/+/#", "lab/a/b/c", True),
    ("lab/sensors/+/temperature", "lab/temperature/stats", False),
    ("lab/+", "lab/out/x", False),
    ("lab/#", "labs/out", False),
    ("+", "lab/out", False),
    ("#", "$lab/out", False),  # a leading wildcard never matches a $ topic
]


def test_an_mqtt_feedback_loop_is_refused(tmp_path: Path, capsys: Any) -> None:
    for filt, topic, loops in LOOP_CASES:
        p = write(tmp_path, LOOP.format(filt=filt, topic=topic))
        rc, lines, _ = check(p, capsys)
        if not loops:
            assert (rc, lines) == (0, []), (filt, topic, lines)
            continue
        assert rc == 1 and lines == [
            f"error: {p}: [operator[1]].params.topic: expected a topic that no mqtt_source of this pipeline reads, "
            f'but [operator[0]].params.topic "{filt}" matches it: an MQTT feedback loop (every message \'out\' '
            f"publishes comes back in through 'readings', wrapped again, without end), got \"{topic}\""], lines


def test_operators_modules_that_do_not_import_are_refused_with_the_import_error(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    absent = "chk_absent_" + uuid.uuid4().hex[:8]
    broken = "chk_broken_" + uuid.uuid4().hex[:8]
    fine = "chk_fine_" + uuid.uuid4().hex[:8]
    (tmp_path / f"{broken}.py").write_text("raise RuntimeError('needs a GPIO board')\n")
    (tmp_path / f"{fine}.py").write_text("def f(rec):\n    return rec\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    conf = write(tmp_path, f'[agent]\nnode = "n"\n[operators]\nmodules = ["{fine}", "{absent}", "{broken}"]\n',
                 "agent.toml")
    rc, lines, _ = check(conf, capsys)
    assert rc == 1 and lines == [
        f'error: agent.toml: [operators].modules[1]: expected a module this node can import, got "{absent}" '
        f"(ModuleNotFoundError: No module named '{absent}')",
        f'error: agent.toml: [operators].modules[2]: expected a module this node can import, got "{broken}" '
        f"(RuntimeError: needs a GPIO board)"], lines
    conf.write_text(f'[agent]\nnode = "n"\n[operators]\nmodules = ["{fine}"]\n')
    assert check(conf, capsys)[:2] == (0, [])


def test_a_misspelt_function_is_named_as_such(tmp_path: Path, capsys: Any) -> None:
    p = write(tmp_path, LOOP.format(filt="lab/in", topic="lab/out").replace("builtin:mqtt_sink", "builtin:mqtt_snk"))
    rc, [line], _ = check(p, capsys)
    assert rc == 1 and line.startswith(
        f'error: {p}: [operator[1]].function: "agent.operators.builtin:mqtt_snk" is not allowed on this node: '
        "module 'agent.operators.builtin' has no operator 'mqtt_snk'; did you mean 'mqtt_sink'? (allowed: "), line


SINK_MODULE = '''
from agent.operators import Operator, SinkOperator


class LineSink(SinkOperator):
    """A sink named by its class, as docs/operators.md's table allows."""

    def __init__(self, ctx):
        self.path = ctx.sink_dir / (ctx.instance + ".lines")
        self.lines = 0

    def record(self, items):
        self.lines += len(items)
        return []


class Upper(Operator):
    def process(self, items):
        return [(s, q, str(r).upper()) for s, q, r in items]


class NeedsTwo(SinkOperator):
    def __init__(self, ctx, other):
        pass


class Thing:
    pass


thing = Thing()  # defined here, but neither a function, a factory nor an Operator class
'''


def test_an_operator_class_named_directly_works_as_the_docs_say(tmp_path: Path, capsys: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.operators.admission import AllowList
    from agent.operators.builtin import OperatorContext, load_operator

    mod = "chk_classes_" + uuid.uuid4().hex[:8]
    (tmp_path / f"{mod}.py").write_text(SINK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    node = write(tmp_path, f'[agent]\nnode = "n"\n[operators]\nmodules = ["{mod}"]\n', "agent.toml")
    text = (LOOP.format(filt="lab/in", topic="lab/out")
            .replace("agent.operators.builtin:mqtt_sink", f"{mod}:LineSink").replace('params = { topic = "lab/out" }', ""))
    p = write(tmp_path, text)
    assert check(p, capsys, node)[:2] == (0, [])
    allowed = AllowList.for_node([mod])
    ctx = OperatorContext("loop.out.0", "out", "n", "sink", sink_dir=tmp_path)
    sink = load_operator(f"{mod}:LineSink", ctx, allowed)  # it used to call LineSink() and fail
    assert sink.path == tmp_path / "loop.out.0.lines" and sink.record([("s", 0, {})]) == [] and sink.lines == 1
    upper = load_operator(f"{mod}:Upper", ctx, allowed)  # the argument-free form still works
    assert upper.process([("s", 0, "a")]) == [("s", 0, "A")]
    # what the loader cannot build is refused by check-config, not by a worker after deploy
    for name, expected in (
            ("Upper", "expected a SinkOperator class for a sink (Upper is an Operator that is not a sink)"),
            ("NeedsTwo", "expected an Operator class built as NeedsTwo(ctx) or NeedsTwo() (its constructor "
                         "requires ctx, other; it may take at most the context)")):
        p.write_text(text.replace(":LineSink", f":{name}"))
        rc, lines, _ = check(p, capsys, node)
        assert rc == 1 and lines == [f'error: {p}: [operator[1]].function: {expected}, got "{mod}:{name}"'], lines
    # as a map: a sink's class is refused there, and so is an object of no form at all
    three = text.replace('[[operator]]\nname = "out"', f'[[operator]]\nname = "work"\nfunction = "{mod}:NAME"\n'
                                                        '[[operator]]\nname = "out"')
    for name, expected in (
            ("LineSink", 'expected an operator of kind "map", not the SinkOperator class LineSink (a sink is the '
                         'last operator, kind = "sink")'),
            ("thing", "expected a function, a factory with build(ctx) or an Operator class (found Thing, which is "
                      "none of them)")):
        p.write_text(three.replace("NAME", name))
        rc, lines, _ = check(p, capsys, node)
        assert rc == 1 and lines == [f'error: {p}: [operator[1]].function: {expected}, got "{mod}:{name}"'], lines


def test_check_config_json_prints_an_object_on_an_error_too(tmp_path: Path, capsys: Any) -> None:
    p = write(tmp_path, TYPO)
    rc, lines, out = check(p, capsys, as_json=True)
    doc = json.loads(out)  # stdout was empty on an error
    assert rc == 1 and doc["ok"] is False and doc["warnings"] == []
    assert doc["errors"] == [
        {"file": str(p), "key": "[operator[2]].params.feild",
         "expected": "unknown key (allowed: field, lateness_ms, time_field, time_unit)", "given": "fare_amount",
         "message": f'{p}: [operator[2]].params.feild: unknown key (allowed: field, lateness_ms, time_field, '
                    f'time_unit), got "fare_amount"'},
        {"file": str(p), "key": "[operator[2]].params.field",
         "expected": "missing required key (expected a string)", "given": None,
         "message": f"{p}: [operator[2]].params.field: missing required key (expected a string)"}]
    assert lines == [f"error: {e['message']}" for e in doc["errors"]]
    # a file the loader refuses: the same object
    bad = write(tmp_path, TYPO.replace('name = "typo"', 'name = "ty po"'), "bad.toml")
    rc, lines, out = check(bad, capsys, as_json=True)
    [err] = json.loads(out)["errors"]
    assert rc == 1 and err["file"] == "bad.toml" and err["key"] == "[pipeline].name" and err["given"] == "ty po"
    assert lines == [f"error: {err['message']}"]


# ---- the two deploys run the same checks, before any connection -----------------------------------


class NoBroker:
    """Stands for every way to reach a broker: records that one was tried, then fails as a
    refused connection would."""

    tried: List[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from agent.mqtt.requester import BrokerUnreachable

        NoBroker.tried.append(repr(args)[:80])
        raise BrokerUnreachable("127.0.0.1:1", "connection refused")


def fog_agent(argv: List[str]) -> int:
    """`fog-agent ARGV` in this process (without main's SIGTERM handler)."""
    from agent.cli.main import build_parser

    args = build_parser().parse_args(argv)
    return int(args.func(args))


def fogctl(argv: List[str], connect: Optional[Callable[..., Any]] = None) -> int:
    from agent.cli.fogctl import main

    return main(argv, connect=connect or NoBroker)


def refused_files(tmp_path: Path, capsys: Any) -> List[Tuple[Path, List[str]]]:
    """(pipeline, check-config's error lines) for the measured cases: a params typo, a loop."""
    out = []
    for name, text in (("typo.toml", TYPO), ("loop.toml", LOOP.format(filt="lab/#", topic="lab/out"))):
        p = write(tmp_path, text, name)
        rc, want, _ = check(p, capsys)
        assert rc == 1 and want, want
        out.append((p, want))
    assert "[operator[2]].params.feild: unknown key" in out[0][1][0]
    return out


def test_fog_agent_deploy_refuses_what_check_config_refuses_and_starts_nothing(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.node.deploy

    monkeypatch.setattr(agent.node.deploy, "RpcClient", NoBroker)
    NoBroker.tried = []
    for p, want in refused_files(tmp_path, capsys):
        assert fog_agent(["deploy", str(p), "--host", "127.0.0.1", "--port", "1"]) == exitcodes.ERROR
        out, err = capsys.readouterr()
        assert err.splitlines() == want and out == ""
    assert NoBroker.tried == []  # no connection was attempted: nothing could start


def test_fogctl_deploy_refuses_what_check_config_refuses_and_starts_nothing(tmp_path: Path, capsys: Any) -> None:
    NoBroker.tried = []
    for p, want in refused_files(tmp_path, capsys):
        assert fogctl(["--broker", "127.0.0.1:1", "deploy", str(p)]) == exitcodes.ERROR
        out, err = capsys.readouterr()
        assert err.splitlines() == [f"fogctl: {line}" for line in want] and out == ""
        assert fogctl(["--broker", "127.0.0.1:1", "deploy", str(p), "--json"]) == exitcodes.ERROR
        doc = json.loads(capsys.readouterr().out)
        assert doc["ok"] is False and [f"error: {e['message']}" for e in doc["errors"]] == want
    assert NoBroker.tried == []  # no connection was attempted: nothing could start


def test_deploy_checks_against_the_named_node_and_leaves_modules_it_cannot_know_to_the_nodes(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no node's agent.toml is, a function of a module no allow-list here names is not
    imported (the nodes check it at spawn): the deploy goes on to the broker (the report notes it).
    Given the node's agent.toml, a function it refuses is refused as check-config refuses it."""
    import agent.node.deploy
    from agent.pipeline_check import check_text

    monkeypatch.setattr(agent.node.deploy, "RpcClient", NoBroker)
    NoBroker.tried = []
    mod = "chk_remote_" + uuid.uuid4().hex[:8]
    p = write(tmp_path, TYPO.replace("agent.operators.keyed:keyed_sum", f"{mod}:total")
              .replace('params = { feild = "fare_amount" }', ""))
    assert fog_agent(["deploy", str(p), "--host", "127.0.0.1", "--port", "1"]) == exitcodes.UNREACHABLE
    assert capsys.readouterr().err.splitlines() == ["error: cannot reach the MQTT broker at 127.0.0.1:1: connection refused"]
    assert len(NoBroker.tried) == 1  # it went on to the broker
    _, report = check_text(p.read_text(), str(p), None)
    assert report.ok and report.warnings == [
        f'{p}: [operator[2]].function: "{mod}:total" not checked here: module {mod!r} is on no allow-list of this '
        f"machine (no node agent.toml found at {tmp_path / 'no-such-agent.toml'}); each node checks it when asked "
        "to start it"]
    assert mod not in sys.modules  # not imported
    node = write(tmp_path, '[agent]\nnode = "n"\n', "agent.toml")
    rc, want, _ = check(p, capsys, node)
    assert rc == 1 and len(want) == 1 and "is not allowed on this node" in want[0]
    NoBroker.tried = []
    assert fogctl(["--broker", "127.0.0.1:1", "deploy", str(p), "--agent-config", str(node)]) == exitcodes.ERROR
    assert capsys.readouterr().err.splitlines() == [f"fogctl: {line}" for line in want]
    assert NoBroker.tried == []


# ---- one table of exit statuses ---------------------------------------------------------------------


def outcomes() -> List[Tuple[str, Callable[[], BaseException], int]]:
    from agent.mqtt.requester import BrokerUnreachable
    from agent.node.deploy import DeployRefused, DeployRolledBack, RollbackIncomplete

    return [
        ("no broker", lambda: BrokerUnreachable("127.0.0.1:1", "connection refused"), exitcodes.UNREACHABLE),
        ("refused", lambda: DeployRefused("deploy of typo refused: its 4 keeper(s) need 4 free slot(s)"),
         exitcodes.ERROR),
        ("rolled back", lambda: DeployRolledBack("deploy of typo failed and was rolled back: ..."),
         exitcodes.ROLLED_BACK),
        ("rollback incomplete", lambda: RollbackIncomplete("deploy of typo failed (...); rollback incomplete"),
         exitcodes.ROLLBACK_INCOMPLETE),
    ]


def test_both_deploys_exit_with_the_same_status_for_the_same_outcome(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.fogctl.deploy
    import agent.node.deploy

    good = write(tmp_path, TYPO.replace('params = { feild = "fare_amount" }', 'params = { field = "fare_amount" }'))

    class Conn:
        def __enter__(self) -> "Conn":
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

    for what, make, status in outcomes():
        def fail(*args: Any, make: Callable[[], BaseException] = make, **kwargs: Any) -> Any:
            raise make()

        monkeypatch.setattr(agent.node.deploy, "deploy", fail)  # fog-agent deploy's connection and transaction
        monkeypatch.setattr(agent.fogctl.deploy, "deploy_over", fail)  # fogctl deploy's transaction
        assert fog_agent(["deploy", str(good), "--host", "127.0.0.1", "--port", "1"]) == status, what
        assert capsys.readouterr().err.splitlines() == [f"error: {make()}"]
        assert fogctl(["--broker", "127.0.0.1:1", "deploy", str(good)], connect=lambda cfg: Conn()) == status, what
        assert capsys.readouterr().err.splitlines() == [f"fogctl: error: {make()}"]


def test_a_deploy_to_a_closed_port_exits_unreachable(tmp_path: Path, capsys: Any) -> None:
    """The real client against a loopback port nobody listens on (no broker needed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: refused at once
    good = write(tmp_path, TYPO.replace('params = { feild = "fare_amount" }', 'params = { field = "fare_amount" }'))
    assert fog_agent(["deploy", str(good), "--host", "127.0.0.1", "--port", str(port)]) == exitcodes.UNREACHABLE
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the MQTT broker at 127.0.0.1:{port}"), err
    assert fogctl(["--broker", f"127.0.0.1:{port}", "--timeout", "5", "deploy", str(good)],
                  connect=__import__("agent.fogctl.client", fromlist=["Connection"]).Connection) == exitcodes.UNREACHABLE


def test_docs_print_the_exit_status_table() -> None:
    text = (ROOT / "docs" / "fogctl.md").read_text()
    section = text[text.index("### Exit statuses"):]
    rows = re.findall(r"^\| \*\*(\d)\*\* \| (.+?) \|$", section, re.M)
    assert [(int(code), words) for code, words in rows] == [(c, w) for c, w in exitcodes.TABLE]


def test_a_late_split_sink_loops_through_either_of_its_topics() -> None:
    from agent.config import load_pipeline_text
    from agent.pipeline_check import feedback_loops

    text = """
[pipeline]
name = "p"
[[operator]]
name = "readings"
kind = "source"
function = "agent.operators.taxi:mqtt_source"
params = {{ topic = "lab/#" }}
key = "sensor"
[[operator]]
name = "minute"
function = "agent.operators.windows:window"
params = {{ time_field = "t", size_ms = 60000, late = "emit", aggregates = {{ n = ["count"] }} }}
[[operator]]
name = "out"
kind = "sink"
function = "agent.operators.windows:late_split_sink"
params = {{ topic = "{topic}", late_topic = "{late}" }}
"""
    cfg = load_pipeline_text(text.format(topic="stats/minute", late="lab/late"))
    assert [p.key for p in feedback_loops(cfg, "p.toml")] == ["[operator[2]].params.late_topic"]
    assert feedback_loops(load_pipeline_text(text.format(topic="stats/minute", late="stats/late")), "p.toml") == []
