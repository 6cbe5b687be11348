"""The worker's settings that have a rule: their defaults and limits, and the checks that
refuse a bad one with a :class:`~sqla_jobs.errors.ConfigurationError` before the worker
touches the database (:class:`~sqla_jobs.worker.Worker`'s constructor runs them)."""

from __future__ import annotations

import importlib.util
from typing import Final

from sqla_jobs.errors import ConfigurationError
from sqla_jobs.queue import MAX_CLAIM_LIMIT

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "HISTORY_EVERY",
    "MAX_PREFETCH",
    "check_history_partitions",
    "check_metrics",
    "check_numbers",
    "int_in",
    "positive_int",
]

#: Seconds between two runs of the history role (partitions, mover, retention).
HISTORY_EVERY: Final = 60.0
#: The default largest claim (``batch_size``), unless the concurrency is larger: the plain
#: loop's best batch in the bench's sweeps.
DEFAULT_BATCH_SIZE: Final = 500
#: The most jobs a worker may claim beyond its free slots (``prefetch``).
MAX_PREFETCH: Final = 10_000


def check_numbers(
    *,
    concurrency: int,
    batch_size: int | None,
    prefetch: int | None,
    poll_interval: float,
    grace: float,
    lock_timeout: float,
    history_every: float,
) -> None:
    """The worker's numeric settings: each in its range, or a ConfigurationError naming it."""
    if not positive_int(concurrency):
        raise ConfigurationError(f"concurrency must be a positive integer, not {concurrency!r}")
    if batch_size is not None and not (positive_int(batch_size) and batch_size <= MAX_CLAIM_LIMIT):
        raise ConfigurationError(f"batch_size must be an integer in [1, {MAX_CLAIM_LIMIT}]")
    if prefetch is not None and not int_in(prefetch, 0, MAX_PREFETCH):
        raise ConfigurationError(
            f"prefetch must be an integer in [0, {MAX_PREFETCH}], not {prefetch!r}"
        )
    for label, value in (("poll_interval", poll_interval), ("grace", grace)):
        if not value >= 0:
            raise ConfigurationError(f"{label} must not be negative, got {value!r}")
    if not 0 < lock_timeout < 3600:
        raise ConfigurationError(f"lock_timeout must be in (0, 3600) seconds, not {lock_timeout!r}")
    if not history_every > 0:
        raise ConfigurationError(f"history_every must be positive, not {history_every!r}")


def check_history_partitions(partitions: object, retention: object) -> bool:
    """``history_partitions``: a bool; False (partition DDL left to the history table's
    owner) cannot go with a ``history_retention``, since retention drops partitions."""
    if not isinstance(partitions, bool):
        raise ConfigurationError(f"history_partitions must be True or False, not {partitions!r}")
    if not partitions and retention is not None:
        raise ConfigurationError(
            "history_retention drops partitions, which history_partitions=False leaves to "
            "the history table's owner: give the retention to its `sqla-jobs history "
            "--retention` instead"
        )
    return partitions


def check_metrics(port: object, host: object, max_age: object) -> None:
    """The metrics server's settings (nothing to check without a port), and its extra."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigurationError(f"metrics_port must be an integer in [0, 65535], not {port!r}")
    if not isinstance(host, str) or not host:
        raise ConfigurationError(f"metrics_host must be a host name or address, not {host!r}")
    if isinstance(max_age, bool) or not isinstance(max_age, int | float) or not 0 < max_age <= 3600:
        raise ConfigurationError(f"metrics_max_age must be in (0, 3600] seconds, not {max_age!r}")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigurationError(
            "metrics_port needs prometheus_client: pip install 'sqla-jobs[metrics]'"
        )


def positive_int(value: object) -> bool:
    return int_in(value, 1, None)


def int_in(value: object, low: int, high: int | None) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= low
        and (high is None or value <= high)
    )
