"""The central collector: receives spill files over MQTT, verifies them, lands them exactly once.

- `landing`: the landing zone (kind=/date=/node= partitions, content-addressed files, ledger);
- `core`: sans-IO chunk reassembly and verification, acks and nacks;
- `service`: the process (one paho client, persistent session) and the batch-job scheduler.
"""

from agent.collector.core import CollectorCore
from agent.spill.landing import CorruptFile, LandingZone, LandResult

__all__ = ["CollectorCore", "CorruptFile", "LandResult", "LandingZone"]
