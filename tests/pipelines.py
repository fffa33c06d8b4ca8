"""Pipeline texts shared by the integration tests (one place to change the operators' names)."""

from __future__ import annotations

import json
from typing import Any


def taxi_in_zone(name: str, seed: int = 1, rate: float = 50.0, policy: str = "none",
                 capacity: float = 100.0, period: float = 1.0, **more: Any) -> str:
    """source (synthetic taxi records at a constant rate) -> in_zone -> counting sink. Only
    in_zone may scale: by `policy` (none by default), `capacity` records/s per instance, a
    decision every `period` s, and the other keys of its [operator.scaling] in `more`
    (max_instances = 2, ...)."""
    scaling = ""
    if policy != "none":
        table = dict(policy=policy, period=float(period), capacity=float(capacity), **more)
        scaling = "[operator.scaling]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
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
{scaling}[[operator]]
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
