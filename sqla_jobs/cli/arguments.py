"""The command line's own vocabulary: its argument types (durations, counts, ports, queue
lists) and the one error a mistake on it raises."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Final

from sqla_jobs.validation import BIGINT_MAX, MAX_DURATION_SECONDS


class CommandError(Exception):
    """A mistake on the command line or in what it names: reported as one line."""


_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*")


_UNITS: Final = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``90``, ``90s``, ``15m``, ``2h``, ``7d``, ``1w`` (seconds when no unit is given)."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30s, 15m, 2h or 7d")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if seconds > MAX_DURATION_SECONDS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is longer than the longest duration sqla_jobs takes (100 years)"
        )
    return timedelta(seconds=seconds)


#: The largest count an option takes (a PostgreSQL integer): past it, a value would fail
#: further on, with a traceback, instead of here with one line.
_MAX_COUNT: Final = 2**31 - 1


def _int_between(minimum: int, maximum: int = _MAX_COUNT) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be in [{minimum}, {maximum}], got {text.strip()}"
            )
        return value

    return parse


_positive_int = _int_between(1)


_count = _int_between(0)


#: A job id: bigint's range (the ids a sequence gives start at 1).
_job_id = _int_between(1, BIGINT_MAX)


def _seconds(text: str) -> float:
    return parse_duration(text).total_seconds()


def _timeout(text: str) -> float:
    seconds = _seconds(text)
    if not 0 < seconds <= 300:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 300s, got {text!r}")
    return seconds


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def _queue_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CommandError("--queues needs at least one queue name")
    return names
