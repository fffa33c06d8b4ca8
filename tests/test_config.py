"""Config loading: every bad input gives one message naming file, key path and expectation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import load_agent_config, load_pipeline, load_pipeline_text
from agent.schema import ConfigError

ROOT = Path(__file__).resolve().parent.parent

GOOD_AGENT = """
[agent]
node = "n1"
[mqtt]
port = 1883
"""

GOOD_PIPELINE = """
[pipeline]
name = "p"
[[operator]]
name = "src"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "snk"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def write(tmp_path: Path, text: str, name: str = "agent.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_examples_are_valid() -> None:
    cfg = load_agent_config(ROOT / "examples/agent.toml")
    assert cfg.agent.node == "n1" and cfg.mqtt.port == 8883 and cfg.mqtt.tls is not None  # TLS on (docs/security.md)
    pipe = load_pipeline(ROOT / "examples/pipeline.toml")
    assert [op.name for op in pipe.operators] == ["source", "validate", "in_zone", "sink"]
    assert pipe.scaling_for("in_zone").capacity == 400.0
    assert pipe.scaling_for("validate").target_ratio == 0.7


def test_defaults_are_paper_values(tmp_path: Path) -> None:
    pipe = load_pipeline(write(tmp_path, GOOD_PIPELINE, "p.toml"))
    s = pipe.scaling
    assert (s.target_ratio, s.up, s.down) == (0.7, 0.8, 0.6)
    assert pipe.pipeline.coordination == "ack"


@pytest.mark.parametrize(
    "text, expected",
    [
        # 1 wrong type for an integer
        ('[agent]\nnode="n1"\n[mqtt]\nport="abc"', 'agent.toml: [mqtt].port: expected an integer 1-65535, got "abc"'),
        # 2 out of range
        ("[agent]\nnode='n1'\n[mqtt]\nport=70000", "agent.toml: [mqtt].port: expected an integer 1-65535, got 70000"),
        # 3 missing required key
        ("[agent]\nslots=2", "agent.toml: [agent].node: missing required key"),
        # 4 unknown key (typo)
        ("[agent]\nnode='n1'\n[mqtt]\nhots='x'", "agent.toml: [mqtt].hots: unknown key"),
        # 5 unknown section
        ("[agent]\nnode='n1'\n[mqt]\nport=1", "agent.toml: mqt: unknown key"),
        # 6 bool where int expected
        ("[agent]\nnode='n1'\nslots=true", "agent.toml: [agent].slots: expected an integer 1-1024, got true"),
        # 7 invalid identifier (topic wildcard)
        ("[agent]\nnode='n/1'", "agent.toml: [agent].node: expected a name of letters"),
        # 8 literal choice
        ("[agent]\nnode='n1'\n[log]\nlevel='loud'", 'agent.toml: [log].level: expected one of "debug", "info", "warning", "error", got "loud"'),
        # 8b the spilling sink's ack mode
        ("[agent]\nnode='n1'\n[spill]\nack='shipped'", 'agent.toml: [spill].ack: expected one of "written", "landed", got "shipped"'),
        ("[agent]\nnode='n1'\n[spill]\nenabled=true\nack='landed'\nship='none'",
         'agent.toml: [spill]: ack = "landed" needs a shipper (ship = "mqtt" or "path")'),
        # 9 section is not a table
        ("agent = 3", "agent.toml: [agent]: expected a table, got 3"),
        # 10 negative period
        ("[agent]\nnode='n1'\nstate_period=-1.0", "agent.toml: [agent].state_period: expected seconds > 0, got -1.0"),
        # 11 nested table key
        ("[agent]\nnode='n1'\n[mqtt.tls]\ncafile='x'", "agent.toml: [mqtt.tls].cafile: unknown key"),
        # 12 cross-field rule
        ("[agent]\nnode='n1'\n[mqtt]\npassword='a'\npassword_file='b'", "agent.toml: [mqtt]: set password or password_file, not both"),
        # 13 invalid TOML syntax
        ("[agent\nnode='n1'", "agent.toml: invalid TOML"),
        # 14 float where string expected
        ("[agent]\nnode=1.5", "agent.toml: [agent].node: expected a string, got 1.5"),
    ],
)
def test_agent_config_errors(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_agent_config(write(tmp_path, text))
    assert str(info.value).startswith(expected), str(info.value)
    assert "\n" not in str(info.value)


def _op(extra: str) -> str:
    return GOOD_PIPELINE + extra + "\n"


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD_PIPELINE.replace("agent.operators.taxi:source", "not a function"),
         'p.toml: [operator[0]].function: expected "package.module:function", got "not a function"'),
        (_op("batch_size = 0"), "p.toml: [operator[1]].batch_size: expected an integer 1-100000, got 0"),
        (_op("[operator.scaling]\ntarget_ratio = 2.0"), "p.toml: [operator[1].scaling].target_ratio: expected a number 0.01-1, got 2.0"),
        (_op("[operator.scaling]\ncapacity = 'auto'"), 'p.toml: [operator[1].scaling].capacity: expected a number or one of "calibrate", got "auto"'),
        (_op("[operator.scaling]\nup = 0.5\ndown = 0.6"), "p.toml: [operator[1].scaling]: down (0.6) must be lower than up (0.5)"),
        (GOOD_PIPELINE.replace('name = "snk"', 'name = "src"'), "p.toml: operator name 'src' is used twice"),
        (GOOD_PIPELINE.replace('kind = "sink"', 'kind = "map"'), 'p.toml: the last operator must have kind = "sink"'),
        (GOOD_PIPELINE.replace("[pipeline]", "[pipeline]\ncoordination = 'lock'"),
         'p.toml: [pipeline].coordination: expected one of "ack", "fgme", got "lock"'),
        ("operator = 3\n[pipeline]\nname='p'", "p.toml: operator: expected an array of tables, got 3"),
    ],
)
def test_pipeline_errors(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_pipeline(write(tmp_path, text, "p.toml"))
    assert str(info.value).startswith(expected), str(info.value)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.toml: file not found"):
        load_agent_config(tmp_path / "nope.toml")


def test_pipeline_text_roundtrip() -> None:
    cfg = load_pipeline_text((ROOT / "examples/pipeline.toml").read_text())
    assert cfg.operator("in_zone").service_time_ms == 2.0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, cwd=ROOT)


def test_check_config_cli_ok_and_error(tmp_path: Path) -> None:
    ok = run_cli("check-config", str(ROOT / "examples/agent.toml"))
    assert ok.returncode == 0, ok.stderr
    assert 'node = "n1"' in ok.stdout and "[mqtt]" in ok.stdout
    secret = write(tmp_path, "[agent]\nnode='n1'\n[mqtt]\npassword='hunter2'")
    shown = run_cli("check-config", "--json", str(secret))
    assert shown.returncode == 0 and "hunter2" not in shown.stdout and '"***"' in shown.stdout
    bad = run_cli("check-config", str(write(tmp_path, "[agent]\nnode='n1'\n[mqtt]\nport='abc'")))
    assert bad.returncode == 1
    assert bad.stderr.strip() == 'error: agent.toml: [mqtt].port: expected an integer 1-65535, got "abc"'


def test_fgme_pipelines_default_to_the_damped_lock(tmp_path: Path) -> None:
    """coordination = "fgme" without `fgme_damping`: the lock nodes are damped (DEVIATION 4,
    docs/gme.md "The default: the damped variant") in the file loader, the loader of a pipeline
    received over the bus, the core class the worker's driver builds from it, check-config's
    printed effective values and the chaos command's pipeline; `fgme_damping = false` still
    gives the published line 79. One source of truth: agent.protocol.gme_fgme.DAMPING_DEFAULT."""
    import json

    from agent.protocol.guarded import core_class
    from foglab.tools.chaos import ChaosConfig, chaos_pipeline

    from agent.config import PipelineSection
    from agent.protocol.gme_fgme import DAMPING_DEFAULT

    assert PipelineSection.__dataclass_fields__["fgme_damping"].default is DAMPING_DEFAULT is True
    text = GOOD_PIPELINE.replace("[pipeline]", '[pipeline]\ncoordination = "fgme"')
    path = write(tmp_path, text, "p.toml")
    for cfg in (load_pipeline(path), load_pipeline_text(text)):
        assert cfg.pipeline.fgme_damping is True
        assert core_class(cfg.pipeline.coordination, cfg.pipeline.fgme_damping).damped is True  # the driver's call
    shown = run_cli("check-config", "--json", str(path))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["pipeline"]["fgme_damping"] is True
    shown = run_cli("check-config", str(path))
    assert shown.returncode == 0 and "fgme_damping = true" in shown.stdout, shown.stdout
    assert ChaosConfig(duration=10.0, seed=1).fgme_damping is True
    assert load_pipeline_text(chaos_pipeline(10.0, 1, "fgme")).pipeline.fgme_damping is True
    published = text.replace('coordination = "fgme"', 'coordination = "fgme"\nfgme_damping = false')
    cfg = load_pipeline_text(published)
    assert cfg.pipeline.fgme_damping is False and core_class("fgme", cfg.pipeline.fgme_damping).damped is False
    from agent.protocol import gme_fgme

    assert gme_fgme.DAMPING_DEFAULT is True


def test_help_commands() -> None:
    assert run_cli("--help").returncode == 0
    fogctl = subprocess.run([sys.executable, "-m", "agent.cli.fogctl", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert fogctl.returncode == 0 and "fogctl" in fogctl.stdout


def test_every_policy_the_config_accepts_is_one_the_agent_runs() -> None:
    """threshold / model / sized run in the worker (agent.policy.live), so deploy and check-config
    refuse none of them; a policy name the config does not know is refused naming the key."""
    import pytest

    from agent.config import RUNTIME_POLICIES, load_pipeline_text

    text = """
[pipeline]
name = "p"
[scaling]
policy = "decentralized"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "work"
function = "agent.operators.builtin:validate"
[operator.scaling]
policy = "threshold"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""
    for policy in ("decentralized", "threshold", "model", "sized", "none"):
        assert policy in RUNTIME_POLICIES
        cfg = load_pipeline_text(text.replace('"threshold"', f'"{policy}"'))
        assert cfg.scaling_for("work").policy == policy and cfg.runtime_policy_errors() == []
    with pytest.raises(ValueError, match="policy"):
        load_pipeline_text(text.replace('"threshold"', '"magic"'))


def test_a_saved_spec_with_0_1_operator_names_is_read_under_the_new_names(caplog: pytest.LogCaptureFixture) -> None:
    """An agent upgraded from 0.1 re-reads hosted specs whose pipeline names the built-ins by their
    old modules; they must load (and resolve on the allow-list), not be set aside."""
    from agent.operators.admission import AllowList

    text = (Path(__file__).parent.parent / "examples" / "pipeline.toml").read_text()
    old = text.replace("agent.operators.builtin:", "agent.runtime.operators:").replace(
        "agent.operators.taxi:", "agent.runtime.taxi:")
    assert "agent.runtime.operators:in_zone" in old
    with caplog.at_level("WARNING", logger="agent.refs"):
        cfg = load_pipeline_text(old)
    assert [op.function for op in cfg.operators] == [op.function for op in load_pipeline_text(text).operators]
    assert all(AllowList().resolve(op.function) for op in cfg.operators)
    assert "renamed" in caplog.text and "agent.runtime.operators:in_zone" in caplog.text
