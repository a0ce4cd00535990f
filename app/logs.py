"""How the server's processes log: a line a record, its time in UTC and marked so."""

from __future__ import annotations

import logging
import sys
import time


class UtcFormatter(logging.Formatter):
    """Log lines' times in UTC, marked so (2025-01-31T09:30:00.123Z): local time without a zone
    could not be lined up with a proxy's or another host's log."""

    converter = time.gmtime
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"


def line_format(process: str = "") -> str:
    return f"%(asctime)s %(levelname)s {process + ' ' if process else ''}%(name)s %(message)s"


def log_to_stderr(level: str, process: str = "") -> None:
    """The root logger to stderr at `level`; `process` (worker-1234) names a child process's lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(UtcFormatter(line_format(process)))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def announce(message: str, name: str = "manyeyes") -> None:
    """A line the server says whatever the log level (that it serves, and where), to stderr,
    stamped as its log lines are: printed as it was, it was the one line without a time."""
    record = logging.LogRecord(name, logging.INFO, __file__, 0, message, None, None)
    print(UtcFormatter(line_format()).format(record), file=sys.stderr)
