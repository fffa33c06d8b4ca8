"""Operators: the API a user's operator is written against, the built-in operators, the taxi
sources, and the node's allow-list of what may be imported (docs/operators.md).

Import the API from here (`from agent.operators import OperatorContext, Param, record_map`);
the built-ins are named in pipelines as `agent.operators.builtin:<name>` and
`agent.operators.taxi:<name>`; the keyed ones `agent.operators.keyed:<name>`, and the declarative
windows `agent.operators.windows:window` (with `late_split_sink`)."""

from agent.operators.builtin import (
    MapOperator,
    Operator,
    OperatorContext,
    Param,
    Publication,
    SinkOperator,
    passes_records,
    record_map,
)
from agent.operators.keyed import EVENT_TIME_PARAMS, KeyedOperator

__all__ = ["EVENT_TIME_PARAMS", "KeyedOperator", "MapOperator", "Operator", "OperatorContext", "Param", "Publication", "SinkOperator", "passes_records",
           "record_map"]
