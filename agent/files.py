"""Writing a file that a crash must never leave half written (specs, worker state, capacity
records, pins): write a sibling `<name>.tmp`, then rename it over the file, which POSIX makes
atomic, so a reader (or the next start after a crash) sees the old file or the new one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_atomic_parts(path: Path, parts: Iterable[str]) -> int:
    """`write_atomic` of the text `"".join(parts)`, written piece by piece (a large document is
    never whole in memory); returns its length in characters."""
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w") as fh:
        for part in parts:
            fh.write(part)
            n += len(part)
    os.replace(tmp, path)
    return n
