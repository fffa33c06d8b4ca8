"""Pipeline texts shared by the integration tests (one place to change the operators' names)."""

from __future__ import annotations


def taxi_in_zone(name: str, seed: int = 1, rate: float = 50.0) -> str:
    """source (synthetic taxi records at a constant rate) -> in_zone -> counting sink, no scaling."""
    return f"""
[pipeline]
name = "{name}"
[scaling]
policy = "none"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
params = {{ seed = {seed}, profile = "constant", rate = {float(rate)} }}
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def with_work(function: str) -> str:
    """Pipeline "p": taxi source -> `work` running `function` -> counting sink (no params: what
    an allow-list or a spec check looks at, not what it computes)."""
    return f"""
[pipeline]
name = "p"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "work"
function = "{function}"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""
