"""MQTT for every process: the client factory and client ids (client.py), the worker's one-owner
Transport (transport.py), the tools' blocking requester (requester.py). docs/runtime.md, "MQTT layer"."""
