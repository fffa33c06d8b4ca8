"""`fog-agent` with and without the lab (fog-agent-lab, package foglab): where it is installed its
commands are there, as before the split; where it is not (a node's .deb), each of them says what to
install and the node's commands work as ever. In-process, no broker."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

import pytest

from agent.cli import main as cli


def _choices(parser: argparse.ArgumentParser, *path: str) -> List[str]:
    """The subcommand names under `path` (e.g. () for the root, ("bench",) for the benchmarks)."""
    for name in path:
        parser = _subparsers(parser).choices[name]
    return sorted(_subparsers(parser).choices)


def _subparsers(parser: argparse.ArgumentParser) -> "argparse._SubParsersAction":
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _hide_lab(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lab as a node sees it: not importable (None in sys.modules makes `import foglab` fail)."""
    for name in [n for n in sys.modules if n == "foglab" or n.startswith("foglab.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "foglab", None)


@pytest.fixture
def no_lab(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_lab(monkeypatch)


def test_with_the_lab_its_commands_are_the_ones_the_node_names_and_the_groups_fill() -> None:
    with_lab = _choices(cli.build_parser())
    for name in cli.LAB_COMMANDS:
        assert name in with_lab
    parser = cli.build_parser()
    assert {"dataplane", "rescale", "spill", "fuzz", "gme", "policies", "latency"} <= set(_choices(parser, "bench"))
    assert {"scaling", "gme", "instance", "policies"} <= set(_choices(parser, "simulate"))
    args = parser.parse_args(["demo", "--duration", "3", "--json"])
    assert args.func.__module__ == "foglab.cli.demo_cmd" and args.duration == 3.0


def test_without_the_lab_the_root_lists_the_same_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    """So a lab command added at the root without its name in LAB_COMMANDS fails here."""
    with_lab = _choices(cli.build_parser())
    _hide_lab(monkeypatch)
    assert _choices(cli.build_parser()) == with_lab


@pytest.mark.parametrize("argv", [["demo", "--duration", "3"], ["demo", "--help"], ["chaos"],
                                  ["testbed", "up", "--nodes", "0"], ["dev", "up"], ["bench", "dataplane", "--json"],
                                  ["simulate", "scaling", "--seed", "3"], ["bench"]])
def test_without_the_lab_a_lab_command_says_what_to_install(no_lab: None, argv: List[str],
                                                            capsys: pytest.CaptureFixture) -> None:
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"fog-agent {argv[0]}: ") and "fog-agent-lab" in err and "pip install ./lab" in err


def test_without_the_lab_the_node_commands_parse_and_reject_what_they_did(no_lab: None) -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["run", "--config", "a.toml"]).func.__module__ == "agent.cli.runtime_cmd"
    assert parser.parse_args(["rollout-gate", "snapshot", "--node", "n1"]).func.__module__ == "agent.cli.rollout_cmd"
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--no-such-option"])
    assert exc.value.code == cli.EXIT_USAGE


def test_a_broken_lab_install_is_not_taken_for_a_missing_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "foglab"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli" / "__init__.py").write_text("import foglab_dependency_that_is_not_installed\n")
    for name in [n for n in sys.modules if n == "foglab" or n.startswith("foglab.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as exc:
        cli.build_parser()
    assert exc.value.name == "foglab_dependency_that_is_not_installed"


def test_the_lab_distribution_goes_with_this_agent_version() -> None:
    """The lab drives the agent's internals: lab/pyproject.toml names this version and pins it."""
    from agent import __version__
    from agent.schema import tomllib

    root = Path(__file__).resolve().parents[1]
    lab = tomllib.loads((root / "lab" / "pyproject.toml").read_text())
    assert lab["project"]["name"] == "fog-agent-lab" and lab["project"]["version"] == __version__
    assert f"fog-agent=={__version__}" in lab["project"]["dependencies"]
    assert lab["tool"]["setuptools"]["packages"]["find"]["include"] == ["foglab*"]
    node = tomllib.loads((root / "pyproject.toml").read_text())
    assert node["tool"]["setuptools"]["packages"]["find"]["include"] == ["agent*"]
