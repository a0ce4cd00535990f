"""How the server's processes log: a line a record, its time in UTC and marked so."""

from __future__ import annotations

import logging
import time


class UtcFormatter(logging.Formatter):
    """Log lines' times in UTC, marked so (2025-01-31T09:30:00.123Z): local time without a zone
    could not be lined up with a proxy's or another host's log."""

    converter = time.gmtime
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"


def log_to_stderr(level: str, process: str = "") -> None:
    """The root logger to stderr at `level`; `process` (worker-1234) names a child process's lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(UtcFormatter(f"%(asctime)s %(levelname)s {process + ' ' if process else ''}%(name)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
