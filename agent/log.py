"""Logging set-up: one logger per module, human lines on a TTY, key=value lines otherwise.

Why key=value off a TTY: journald and log shippers keep a line per event, and `node=n1
instance=in_zone-3` can be grepped and parsed without a JSON decoder on a Pi. Modules add context
with `extra={"node": ..., "instance": ...}`; the journal handler (systemd extra) maps those to
structured journal fields.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator, Optional

from agent.journal import CONTEXT_FIELDS, JournalHandler


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = [
            f"ts={self.formatTime(record, '%Y-%m-%dT%H:%M:%S')}",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
        ]
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                parts.append(f"{name}={value}")
        msg = record.getMessage().replace('"', "'")
        parts.append(f'msg="{msg}"')
        if record.exc_info:
            exc = self.formatException(record.exc_info).replace("\n", " | ").replace('"', "'")
            parts.append(f'exc="{exc}"')
        return " ".join(parts)


class HumanFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ctx = [f"{n}={getattr(record, n)}" for n in CONTEXT_FIELDS if getattr(record, n, None)]
        return line + (" [" + " ".join(ctx) + "]" if ctx else "")


class StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stderr` is when a record is emitted, not when the handler
    was made: tools that redirect stderr (`stdout_to_stderr`, a test's capture, a CLI called
    in-process twice) must not leave the root logger writing to a closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> "object":
        return sys.stderr

    @stream.setter
    def stream(self, value: "object") -> None:
        pass


def setup_logging(level: Optional[str] = None, fmt: str = "auto") -> None:
    """Configure the root logger once per process (workers call it again after fork/spawn)."""
    level = (level or os.environ.get("FOG_AGENT_LOG_LEVEL") or "info").upper()
    handler: logging.Handler
    if fmt == "journal" or (fmt == "auto" and os.environ.get("JOURNAL_STREAM") and _journal_available()):
        handler = JournalHandler()  # needs the systemd extra: _journal_available
    else:
        handler = StderrHandler()
        human = fmt == "human" or (fmt == "auto" and sys.stderr.isatty())
        handler.setFormatter(HumanFormatter() if human else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    known = level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    root.setLevel(getattr(logging, level) if known else logging.INFO)
    if not known:  # only $FOG_AGENT_LOG_LEVEL can get here: --log-level and [log] level are checked
        logging.getLogger(__name__).warning("unknown log level %r (FOG_AGENT_LOG_LEVEL?); using info", level.lower())


def _journal_available() -> bool:
    try:
        import systemd.journal  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout to stderr for the duration (a `--json` command's work).

    Why both levels: `print` from a library or hook goes through `sys.stdout`, while a JVM
    (PySpark), a C library or a child process writes to file descriptor 1 directly. The caller
    writes its JSON after the block, so stdout carries that JSON and nothing else."""
    sys.stdout.flush()
    try:
        saved: Optional[int] = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no fd 1 (a daemon context): the Python-level redirect still holds
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
