"""Example fog-agent operators (docs/operators.md): see `fog_example_ops.ops`."""
