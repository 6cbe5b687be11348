"""The logging the command line sets up (the only place in sqla_jobs that configures it):
text or JSON lines with each record's structured extras."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any, Final, TextIO

_RECORD_FIELDS: Final = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_FIELDS}


class TextFormatter(logging.Formatter):
    """``time level logger: message  key=value ...`` with the record's structured extras."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = _extras(record)
        if extras:
            text += "  " + " ".join(f"{k}={_plain(v)}" for k, v in extras.items())
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every extra."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _plain(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    text = str(value)
    return json.dumps(text) if " " in text or not text else text


def configure_logging(level: str, style: str, stream: TextIO | None = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if style == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _quiet_alembic(args: argparse.Namespace) -> None:
    if args.log_level == "INFO":  # Alembic narrates every migration at INFO
        logging.getLogger("alembic").setLevel(logging.WARNING)
