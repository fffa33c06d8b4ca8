"""TOML tables that the tools' pipeline templates share (chaos: the demo and the stateful
pipeline; the policies bench), so that an operator's table is written once.

Text, not a builder of dicts: the templates are `str.format` templates, and these tables keep
the field names they are filled with ({seed}, {steps}: a JSON list of [t, rate] steps). Each
table ends with a newline; a template adds what follows it (its [operator.scaling], or more keys).
"""

from __future__ import annotations

__all__ = ["STEP_SOURCE", "VALIDATE", "IN_ZONE", "SINK"]

# the synthetic taxi source under a step load (agent.operators.taxi, profile "steps")
STEP_SOURCE = """[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[operator.params]
seed = {seed}
profile = "steps"
steps = {steps}
"""

VALIDATE = """[[operator]]
name = "validate"
function = "agent.operators.builtin:validate"
"""

IN_ZONE = """[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
"""

SINK = """[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""
