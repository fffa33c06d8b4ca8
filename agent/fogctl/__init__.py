"""fogctl: inspect and steer a fog-agent fleet over MQTT (see docs/fogctl.md).

Modules, one job each:
  config      settings from ~/.config/fogctl.toml, FOGCTL_* environment variables and options
  client      the one MQTT connection: retained snapshots, live streams, MQTT 5 request/response
  fleet       pure parsing of the retained agent state, status and latency payloads
  views       pure: fleet snapshot -> rows/documents for each command
  render      plain-text tables
  rpc_schema  the steering request/response JSON the agents implement
  commands    the command handlers (I/O lives here and in client only)
  testing     a fake fleet publisher and rpc responder for tests and demos
  schemas     the JSON Schema of every command's --json output (docs/fogctl.md, "JSON output")
  rollout_gate  the health gate of a rolling change (`fog-agent rollout-gate`, run on the node)
"""
