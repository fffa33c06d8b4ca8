"""MQTT for every process: the client factory and client ids (client.py), the worker's one-owner
Transport (transport.py), the tools' blocking requester (requester.py). docs/runtime.md, "MQTT layer".

Importing this package defers `urllib.request` (`defer_urllib_request`) before any of its modules
imports paho."""

from __future__ import annotations

import sys
import types
from typing import Any


def defer_urllib_request() -> None:
    """Put a stand-in for `urllib.request` into sys.modules that imports the real module at its
    first attribute read, unless it is imported already.

    Why: paho.mqtt.client imports urllib.request at its top, but reads it only to find a proxy
    in the environment when PySocks is installed (`Client._get_proxy`). urllib.request brings
    email, http.client, tempfile, shutil, bz2 and lzma: 1.2-1.4 MB resident in the fork server
    and so in every worker, 0.4-0.8 MB in the agent (docs/runtime.md, "Memory"). Any use of it
    (`urllib.request.urlopen`, `from urllib.request import x`) reads an attribute and gets the
    real module, so nothing changes but when it is loaded. Dunder names
    (`__file__`, `__path__`, which the import system and tools probe) do not load it: the
    stand-in has none of them but `__name__`, `__doc__`, `__spec__` (None) and `__loader__`."""
    if "urllib.request" in sys.modules:
        return
    import urllib

    stand_in = types.ModuleType("urllib.request", "urllib.request, imported at its first use (agent.mqtt)")

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if sys.modules.get("urllib.request") is stand_in:
            del sys.modules["urllib.request"]
        import importlib

        return getattr(importlib.import_module("urllib.request"), name)  # also sets urllib.request

    stand_in.__getattr__ = __getattr__  # type: ignore[attr-defined]  # PEP 562
    sys.modules["urllib.request"] = stand_in
    urllib.request = stand_in  # type: ignore[attr-defined]


defer_urllib_request()
