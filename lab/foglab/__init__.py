"""The lab of fog-agent: simulators, checkers, the fuzzer, benchmarks, the demo, chaos campaigns and
the container testbed. A separate distribution (`fog-agent-lab`, lab/pyproject.toml) so that the
node's wheel and .deb carry none of it; it depends on `fog-agent` and adds its commands to the
`fog-agent` CLI (agent.cli.main finds `foglab.cli`)."""
