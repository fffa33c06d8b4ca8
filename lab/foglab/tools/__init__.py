"""Tools that never run on a fog node: demo, chaos, benchmarks, the private broker and the delay proxy."""
