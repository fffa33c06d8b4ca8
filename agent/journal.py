"""A logging handler that writes to the systemd journal with structured fields.

Why structured fields: on a fleet, `journalctl -u fog-agent NODE=n3 OPERATOR=in_zone` finds the
lines of one node or one operator without grepping free text, and a log shipper forwards the fields
as labels. Modules already pass context with `extra={"node": ..., "operator": ..., "instance": ...}`
(see `agent.log`); this handler maps them to the journal fields NODE, OPERATOR and INSTANCE, and adds
the usual PRIORITY, LOGGER, CODE_FILE/CODE_LINE/CODE_FUNC, SYSLOG_IDENTIFIER and, when an exception
is attached, EXCEPTION_TEXT.

`agent.log.setup_logging` only selects this handler when JOURNAL_STREAM is set (stderr is connected
to the journal, i.e. we run under systemd) AND systemd-python is importable (the `systemd` extra);
otherwise the agent logs key=value lines to stderr, which journald also captures, just unstructured.

The sender is injectable so the field mapping is testable without a running journald.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Dict, Optional


__all__ = ["CONTEXT_FIELDS", "JournalHandler", "journal_fields", "PRIORITIES"]

# The `extra=` keys every module may pass; `agent.log`'s formatters print the same ones.
CONTEXT_FIELDS = ("node", "operator", "instance")

# syslog(3) priorities, as journald expects them in PRIORITY=.
PRIORITIES = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}

Sender = Callable[..., Any]


def _priority(levelno: int) -> int:
    for threshold in (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO):
        if levelno >= threshold:
            return PRIORITIES[threshold]
    return PRIORITIES[logging.DEBUG]


def journal_fields(record: logging.LogRecord, identifier: str) -> Dict[str, Any]:
    """The journal fields of one record (MESSAGE excluded): pure, so tests assert on it directly.

    Values are strings except CODE_LINE, an int as `systemd.journal.send` requires.
    """
    fields = {
        "PRIORITY": str(_priority(record.levelno)),
        "LOGGER": record.name,
        "SYSLOG_IDENTIFIER": identifier,
        "CODE_FILE": record.pathname,
        "CODE_LINE": int(record.lineno),
        "CODE_FUNC": record.funcName or "",
        "THREAD_NAME": record.threadName or "",
        "PROCESS_NAME": record.processName or "",
    }
    for name in CONTEXT_FIELDS:
        value = getattr(record, name, None)
        if value is not None:
            fields[name.upper()] = str(value)
    if record.exc_info and record.exc_info[0] is not None:
        fields["EXCEPTION_TEXT"] = logging.Formatter().formatException(record.exc_info)
    return fields


def _default_sender() -> Sender:
    from systemd import journal  # the `systemd` extra (systemd-python); ImportError otherwise

    return journal.send


class JournalHandler(logging.Handler):
    """Send each record to journald as MESSAGE plus structured fields.

    `sender(MESSAGE, **fields)` has the signature of `systemd.journal.send`; it is that function by
    default, which is why constructing the handler raises ImportError without systemd-python.
    """

    def __init__(
        self,
        level: int = logging.NOTSET,
        sender: Optional[Sender] = None,
        identifier: Optional[str] = None,
    ) -> None:
        super().__init__(level)
        self._send = sender if sender is not None else _default_sender()
        self.identifier = identifier or os.environ.get("SYSLOG_IDENTIFIER") or _program_name()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            fields = journal_fields(record, self.identifier)
            self._send(message, **fields)
        except Exception:  # a logging failure must never take the daemon down
            self.handleError(record)


def _program_name() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not name or name in ("__main__.py", "-c", "-m"):
        return "fog-agent"
    return name
