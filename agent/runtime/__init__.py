"""The real driver: agent daemon, worker processes, MQTT transport, placement, measurement, spill."""
