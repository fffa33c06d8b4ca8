"""Writing files a crash must never leave half written. `write_atomic` (specs, worker state,
capacity records, pins): write a sibling `<name>.tmp`, then rename it over the file, which POSIX
makes atomic, so a reader (or the next start after a crash) sees the old file or the new one.
`append` (logs of changes): one O_APPEND write of whole lines, so a kill -9 leaves them whole or
absent and a power cut at worst a torn last line, which the readers of such logs ignore."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


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
