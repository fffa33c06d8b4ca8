"""The MQTT client of a worker process (paho with one owner thread)."""
