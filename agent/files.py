"""Writing a file that a crash must never leave half written (specs, worker state, capacity
records, pins): write a sibling `<name>.tmp`, then rename it over the file, which POSIX makes
atomic, so a reader (or the next start after a crash) sees the old file or the new one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
