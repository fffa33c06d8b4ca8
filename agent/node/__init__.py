"""The per-node daemon: supervisor of worker processes, placement, requests over MQTT, node state, re-homing, deploy."""
