"""A worker module for tests/test_footprint.py: the fork server preloads it (its `preimport` is the
worker's) and a forked child runs its `main`, which reports what the child holds: its modules and
the objects frozen before the fork."""

from __future__ import annotations

import gc
import json
import sys


def preimport() -> None:
    from agent.instance import worker

    worker.preimport()


def main() -> int:
    loaded = hasattr(sys.modules["urllib.request"], "__file__")  # the stand-in has none
    sys.stdout.write(json.dumps({"modules": sorted(sys.modules), "frozen": gc.get_freeze_count(),
                                 "urllib_request_loaded": loaded}) + "\n")
    sys.stdout.flush()
    return 0
