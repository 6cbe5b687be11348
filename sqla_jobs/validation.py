"""Checks on job values and on the queue operations' arguments, run in Python before any SQL.

Pure functions: each takes the field name and the value and either returns the value to store
or raises :class:`~sqla_jobs.errors.InvalidJobError` naming the field.
"""

from __future__ import annotations

import functools
import json
import marshal
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, Final, TypeVar, cast

from sqlalchemy.sql.elements import ClauseElement

from sqla_jobs.errors import ConfigurationError, InvalidJobError, JobArgumentsError

__all__ = [
    "DEFAULT_MAX_ARGS_BYTES",
    "DEFAULT_MAX_ATTEMPTS",
    "JOB_FIELDS",
    "MAX_ATTEMPTS_LIMIT",
    "MAX_DEBOUNCE_SECONDS",
    "MAX_DURATION_SECONDS",
    "MAX_FAIR_WEIGHT",
    "MAX_JSON_DEPTH",
    "MAX_KEY_LENGTH",
    "MAX_KEY_LIMIT",
    "MAX_NAME_LENGTH",
    "MAX_PROGRESS_MESSAGE",
    "MAX_QUEUE_LIMIT",
    "MAX_RATE_LIMIT",
    "MAX_RATE_SECONDS",
    "MAX_SNOOZES",
    "MAX_SNOOZE_SECONDS",
    "MAX_TIME_LIMIT_SECONDS",
    "MAX_TRACE_ENTRIES",
    "MAX_TRACE_VALUE_LENGTH",
    "NAME_RULE",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "FairShare",
    "RateLimit",
    "args_snapshot",
    "as_configuration",
    "check_args",
    "check_debounce_window",
    "check_duration",
    "check_fair_shares",
    "check_field",
    "check_job_id",
    "check_json",
    "check_key_limit",
    "check_max_attempts",
    "check_name",
    "check_ordering_key",
    "check_priority",
    "check_progress",
    "check_queue_limits",
    "check_rate_limits",
    "check_rate_window",
    "check_run_at",
    "check_snooze_delay",
    "check_time_limit",
    "check_trace_context",
    "checked_args",
    "text_problem",
]

DEFAULT_MAX_ARGS_BYTES = 256 * 1024
DEFAULT_MAX_ATTEMPTS = 20
MAX_ATTEMPTS_LIMIT = 1000
MAX_NAME_LENGTH = 200
#: The longest ordering key, in characters.
MAX_KEY_LENGTH = 200
#: The largest per-key limit (the column is a smallint).
MAX_KEY_LIMIT = 10_000
#: The largest per-queue limit (more jobs at once than any fleet of workers runs).
MAX_QUEUE_LIMIT = 1_000_000
#: The longest duration a lease, delay or age may be: past it, a timestamp computed from it
#: would overflow.
MAX_DURATION_SECONDS = 100 * 365 * 86_400
#: The longest time limit of a job (a week): a handler meant to run longer has no use for
#: one, and a larger figure is taken for a mistake (milliseconds given as seconds, say).
MAX_TIME_LIMIT_SECONDS = 7 * 86_400
#: The most times one job may snooze (:class:`~sqla_jobs.Snooze`) before the next snooze
#: fails its attempt instead: a job cannot snooze forever unnoticed.
MAX_SNOOZES = 100
#: The longest one snooze may be (a year).
MAX_SNOOZE_SECONDS = 366 * 86_400
#: The deepest nesting of arrays and objects in job arguments and stored results. Python's
#: json reads a value by recursion, a frame per level, under the interpreter's recursion
#: limit (1,000, less what the reading thread's stack holds already): a worker must always
#: be able to read back what was enqueued, so the limit is well below it.
MAX_JSON_DEPTH: Final = 100
PRIORITY_MIN = -100
PRIORITY_MAX = 100

# Queue, task and worker names appear in logs, metrics and NOTIFY payloads: keep them
# printable and unambiguous. Dotted module paths ("billing.tasks.send_receipt") and "a:b"
# forms are fine. The one definition of the rule: _NAME enforces it, NAME_RULE says it (in
# the error message, and word for word in docs/how-to/enqueueing.md, which tests/test_docs.py
# checks).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]*")
#: What :func:`check_name` accepts, in words.
NAME_RULE: Final = (
    f"1-{MAX_NAME_LENGTH} characters, each an ASCII letter (A-Z, a-z), a digit (0-9) or one "
    "of _ . : -, the first one a letter, a digit or _"
)


def check_name(field: str, value: object) -> str:
    """A queue, task or worker name: :data:`NAME_RULE`."""
    if not isinstance(value, str):
        raise InvalidJobError(field, f"must be a string, not {type(value).__name__}")
    return _check_name_text(field, value)


# Queue and task names repeat from job to job: check each distinct one once. (Only a name
# that passes is remembered; a bad one raises again every time.)
@functools.lru_cache(maxsize=1024)
def _check_name_text(field: str, value: str) -> str:
    if not value:
        raise InvalidJobError(field, "must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidJobError(field, f"is {len(value)} characters, the limit is {MAX_NAME_LENGTH}")
    if not _NAME.fullmatch(value):
        raise InvalidJobError(field, f"{value!r} is malformed: a name is {NAME_RULE}")
    return value


#: The range of a job id (a bigint identity column).
BIGINT_MIN: Final = -(2**63)
BIGINT_MAX: Final = 2**63 - 1


def check_job_id(field: str, value: object) -> int:
    """A job id: an integer within bigint's range (one outside it would reach PostgreSQL
    and fail there, aborting the caller's transaction, instead of being merely not found)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJobError(field, f"must be an integer, not {type(value).__name__}")
    if not BIGINT_MIN <= value <= BIGINT_MAX:
        raise InvalidJobError(field, f"must be within bigint's range, got {value}")
    return value


def check_priority(field: str, value: object) -> int:
    """An integer from -100 to 100; lower values are claimed first."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJobError(field, f"must be an integer, not {type(value).__name__}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise InvalidJobError(field, f"{value} is out of range [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    return value


def check_max_attempts(field: str, value: object) -> int:
    """An integer from 1 to 1000."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJobError(field, f"must be an integer, not {type(value).__name__}")
    if not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise InvalidJobError(field, f"{value} is out of range [1, {MAX_ATTEMPTS_LIMIT}]")
    return value


def check_duration(field: str, value: timedelta | float) -> timedelta:
    """A positive duration, given as a ``timedelta`` or a number of seconds: a lease, a
    retry delay, an age. Less than a microsecond (the resolution of ``timedelta`` and of
    PostgreSQL's intervals) is not positive."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds > MAX_DURATION_SECONDS:  # infinity too
        raise InvalidJobError(
            field,
            f"must be at most {MAX_DURATION_SECONDS:,} seconds (about 100 years), got {value!r}",
        )
    if not seconds > 0:  # NaN too
        raise InvalidJobError(field, f"must be positive, got {value!r}")
    duration = value if isinstance(value, timedelta) else timedelta(seconds=seconds)
    if duration <= timedelta(0):  # less than a microsecond
        raise InvalidJobError(field, f"must be positive, got {value!r}")
    return duration


def check_run_at(field: str, value: object) -> object:
    """A timezone-aware datetime, a SQL expression evaluated by the database, or None."""
    if value is None or isinstance(value, ClauseElement):
        return value
    if not isinstance(value, datetime):
        raise InvalidJobError(field, f"must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidJobError(
            field, "must be timezone-aware (a naive datetime has no defined instant)"
        )
    return value


def _walk(field: str, value: Any, path: str) -> None:
    # An explicit walk, because json.dumps accepts several things jsonb will not store
    # (NUL, lone surrogates) and silently rewrites others (non-string keys).
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise JobArgumentsError(field, f"{path} is {value}: jsonb cannot store NaN or Infinity")
        return
    if isinstance(value, str):
        _check_text(field, value, path)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise JobArgumentsError(
                    field, f"{path} has key {key!r}: JSON object keys must be strings"
                )
            _check_text(field, key, f"{path} key {key!r}")
            _walk(field, item, f"{path}[{key!r}]")
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _walk(field, item, f"{path}[{index}]")
        return
    raise JobArgumentsError(field, f"{path} is a {type(value).__name__}, which is not JSON")


def text_problem(text: str) -> str | None:
    """Why PostgreSQL would refuse ``text`` in a text or jsonb value, or None: a NUL
    character, or a lone surrogate (not valid UTF-8, which the driver cannot encode: the
    error would come at the flush, and abort the caller's transaction). The one rule for
    every string sqla_jobs writes."""
    if "\x00" in text:
        return "contains a NUL character, which PostgreSQL rejects"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "contains a lone surrogate, which is not valid UTF-8"
    return None


def _check_text(field: str, text: str, path: str) -> None:
    problem = text_problem(text)
    if problem is not None:
        raise JobArgumentsError(field, f"{path} {problem}")


# Built once: json.dumps() with options other than the defaults builds an encoder per call.
_COMPACT: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _compact_size(field: str, value: object) -> int | None:
    """The byte size of ``value`` as compact JSON when it is certainly storable, else None.

    The fast path, in C: ``json.dumps`` refuses NaN, Infinity and non-JSON types, encoding
    the text to UTF-8 refuses lone surrogates, and a NUL can only appear escaped as
    ``\\u0000``. None sends the value through the exact walk, which finds and names the
    problem (or finds none: a string that merely contains a backslash and ``u0000``).
    """
    try:
        text = _COMPACT.encode(value)
        # ASCII text is its own UTF-8 (and holds no lone surrogate): no need to encode it.
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except (TypeError, ValueError):  # UnicodeEncodeError is a ValueError
        return None
    if "\\u0000" in text or not _string_keys(value):
        return None
    return size


def _string_keys(value: object) -> bool:
    # json.dumps silently turns int, float, bool and None keys into strings; refuse them.
    # Exact type checks first (isinstance against the Mapping ABC is slow on the hot path),
    # and scalars are never pushed: most values are flat.
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is dict or (kind not in _SEQUENCES and isinstance(node, Mapping)):
            for key, item in node.items():  # type: ignore[attr-defined]
                if type(key) is not str:
                    return False
                if type(item) not in _SCALARS:
                    stack.append(item)
        elif kind in _SEQUENCES or isinstance(node, list | tuple):
            stack.extend(item for item in node if type(item) not in _SCALARS)  # type: ignore[attr-defined]
    return True


_SCALARS: Final = frozenset({str, int, float, bool, type(None)})
_SEQUENCES: Final = frozenset({list, tuple})


def _exact_size(field: str, value: object) -> int:
    _walk(field, value, field)
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def check_args(field: str, value: object, *, max_bytes: int = DEFAULT_MAX_ARGS_BYTES) -> int:
    """Job arguments: a JSON object that jsonb stores unchanged, at most ``max_bytes``.

    Returns the size in bytes of its compact JSON form.
    """
    if not isinstance(value, Mapping):
        raise JobArgumentsError(
            field, f"must be a JSON object (a dict), not {type(value).__name__}"
        )
    return check_json(field, value, max_bytes=max_bytes)


def check_json(field: str, value: object, *, max_bytes: int = DEFAULT_MAX_ARGS_BYTES) -> int:
    """Any JSON value (a stored result, say) that jsonb stores unchanged, at most
    ``max_bytes``. Returns the size in bytes of its compact JSON form."""
    try:
        size = _compact_size(field, value)
        if size is None:
            size = _exact_size(field, value)
    except RecursionError:
        # Nesting deeper than Python's recursion limit: json cannot encode it either.
        size = None
    # Each level of nesting takes at least 2 bytes of JSON ("[]"): a smaller value cannot
    # be too deep, and is not walked again.
    if size is None or (size >= 2 * (MAX_JSON_DEPTH + 1) and _too_deep(value)):
        raise JobArgumentsError(
            field,
            f"is nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects), which "
            "a worker could not be sure to read back",
        )
    if size > max_bytes:
        raise JobArgumentsError(field, f"is {size} bytes as JSON, the limit is {max_bytes}")
    return size


def _too_deep(value: object) -> bool:
    """Whether arrays and objects nest more than :data:`MAX_JSON_DEPTH` levels in ``value``
    (an iterative walk: it must not hit the recursion limit it guards against)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            return True
        stack.extend((child, depth + 1) for child in children if type(child) not in _SCALARS)
    return False


# Each level of nesting takes at least this many bytes of marshal format 2 (a list or tuple:
# a type byte and a 4-byte length; a dict more): a smaller snapshot cannot be too deep.
_SNAPSHOT_BYTES_PER_LEVEL: Final = 5


def args_snapshot(value: object) -> bytes | None:
    """An exact fingerprint of a JSON value that passed :func:`check_json`, to tell later,
    cheaply, whether it is still the same value; None when there is none to take.

    ``marshal`` format 2, in C and several times faster than a JSON encoding: it takes only
    the exact built-in types (a subclass or any other type gives None), writes no
    back-references (format 3 and later would mark shared objects, so the bytes would depend
    on reference counts), and can be read back, so equal bytes mean a value of the same
    exact types, structure, order and contents: one with the same JSON text, which passes
    the same checks. Any change, even ``1`` to ``True`` or ``1.0`` (equal in Python, longer
    in JSON), gives other bytes.
    """
    try:
        return marshal.dumps(cast(Any, value), 2)
    except ValueError:  # a type marshal does not take; also nesting too deep for it
        return None


# No JSON text is longer than this many times the value's args_snapshot() (marshal format
# 2), in bytes: the worst case is a string of control characters, 1 byte in marshal and 6 in
# JSON (\u001f); an int, float, bool or None, a container's framing and a dict's key are
# all cheaper. So a snapshot of n bytes bounds the JSON size by 6 * n, without encoding.
_JSON_BYTES_PER_SNAPSHOT_BYTE: Final = 6


def checked_args(field: str, value: object, *, max_bytes: int) -> bytes | None:
    """:func:`check_args`, returning the value's :func:`args_snapshot` (None when there is
    none to take) instead of its size.

    The common case takes a fast path with no JSON encoding: the snapshot takes only the
    exact built-in types, and when it is small enough to bound the JSON size under
    ``max_bytes`` and one walk finds only string keys, ASCII text without NUL, finite floats,
    ints, bools, None, lists, tuples and dicts, the value is storable as it is. Anything else
    goes through :func:`check_args`, which finds and names the problem.
    """
    snapshot = args_snapshot(value)
    if (
        snapshot is None
        or type(value) is not dict
        or _JSON_BYTES_PER_SNAPSHOT_BYTE * len(snapshot) > max_bytes
        or not _plain_json(value)
        or (len(snapshot) > _SNAPSHOT_BYTES_PER_LEVEL * MAX_JSON_DEPTH and _too_deep(value))
    ):
        check_args(field, value, max_bytes=max_bytes)
    return snapshot


def _plain_json(value: object) -> bool:
    # Exact types only (the snapshot has refused subclasses and every other type already).
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is str:
            if not node.isascii() or "\x00" in node:
                return False
        elif kind is dict:
            for key, item in node.items():
                if type(key) is not str or not key.isascii() or "\x00" in key:
                    return False
                stack.append(item)
        elif kind is list or kind is tuple:
            stack.extend(node)
        elif kind is float:
            if not math.isfinite(node):
                return False
        elif kind is not int and kind is not bool and node is not None:
            return False
    return True


#: The job fields an enqueuer sets, each with its check. The mixin's validators and
#: ``enqueue_many`` both go through :func:`check_field`, so they cannot disagree.
JOB_FIELDS: Final = frozenset(
    {
        "queue",
        "task",
        "args",
        "priority",
        "max_attempts",
        "run_at",
        "ordering_key",
        "key_limit",
        "time_limit",
    }
)


#: The longest progress message, in characters.
MAX_PROGRESS_MESSAGE = 200


def check_progress(value: object, message: object) -> dict[str, Any]:
    """A handler's progress report: ``value`` a finite number (a fraction, a count: the
    handler's to choose), ``message`` text of at most :data:`MAX_PROGRESS_MESSAGE`
    characters without NUL. Returns ``{"value": float, "message": str}``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidJobError("value", f"must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidJobError("value", f"must be a finite number, got {value!r}")
    if not isinstance(message, str):
        raise InvalidJobError("message", f"must be a string, not {type(message).__name__}")
    if len(message) > MAX_PROGRESS_MESSAGE:
        raise InvalidJobError(
            "message", f"is {len(message)} characters, the limit is {MAX_PROGRESS_MESSAGE}"
        )
    problem = text_problem(message)
    if problem is not None:
        raise InvalidJobError("message", problem)
    return {"value": float(value), "message": message}


def _bounded_duration(field: str, value: object, maximum: int, said: str) -> timedelta:
    """A positive ``timedelta`` or number of seconds (not a bool), at most ``maximum``
    seconds (``said`` in words, for the message)."""
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise InvalidJobError(
            field, f"must be a timedelta or a number of seconds, not {type(value).__name__}"
        )
    duration = check_duration(field, value)
    if duration.total_seconds() > maximum:
        raise InvalidJobError(field, f"must be at most {maximum:,} seconds ({said}), got {value!r}")
    return duration


def check_snooze_delay(field: str, value: object) -> timedelta:
    """A snooze's delay: a positive ``timedelta`` or number of seconds, at most
    :data:`MAX_SNOOZE_SECONDS` (a year)."""
    return _bounded_duration(field, value, MAX_SNOOZE_SECONDS, "a year")


def check_time_limit(field: str, value: object) -> timedelta:
    """A time limit: a positive ``timedelta`` or number of seconds, at most
    :data:`MAX_TIME_LIMIT_SECONDS` (a week)."""
    return _bounded_duration(field, value, MAX_TIME_LIMIT_SECONDS, "a week")


#: The longest debounce window (and ``max_wait``): a day. A longer quiet period is a
#: schedule (:mod:`sqla_jobs.periodic`), not a debounce.
MAX_DEBOUNCE_SECONDS: Final = 86_400


def check_debounce_window(field: str, value: object) -> timedelta:
    """A debounce's window or ``max_wait``: a positive ``timedelta`` or number of seconds, at
    most :data:`MAX_DEBOUNCE_SECONDS` (a day)."""
    return _bounded_duration(field, value, MAX_DEBOUNCE_SECONDS, "a day")


def check_ordering_key(field: str, value: object) -> str:
    """An ordering key: any non-empty text up to :data:`MAX_KEY_LENGTH` characters without
    NUL (``customer:42``; keys are compared as exact strings)."""
    if not isinstance(value, str):
        raise InvalidJobError(field, f"must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidJobError(field, "must not be empty")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidJobError(field, f"is {len(value)} characters, the limit is {MAX_KEY_LENGTH}")
    problem = text_problem(value)
    if problem is not None:
        raise InvalidJobError(field, problem)
    return value


#: The most entries of a stored trace context, and the longest of its values (characters):
#: a propagator writes two or three short headers (traceparent, tracestate, baggage).
MAX_TRACE_ENTRIES: Final = 16
MAX_TRACE_VALUE_LENGTH: Final = 8192


def check_trace_context(field: str, value: object) -> dict[str, str] | None:
    """A stored trace context (:mod:`sqla_jobs.tracing`): None, or a mapping of strings to
    strings as a propagator writes it (``{"traceparent": "00-...", ...}``), at most
    :data:`MAX_TRACE_ENTRIES` entries of at most :data:`MAX_TRACE_VALUE_LENGTH` characters.
    Returns a plain ``dict`` copy."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidJobError(
            field, f"must be a mapping of strings to strings, not {type(value).__name__}"
        )
    if len(value) > MAX_TRACE_ENTRIES:
        raise InvalidJobError(field, f"has {len(value)} entries, the limit is {MAX_TRACE_ENTRIES}")
    carrier: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise InvalidJobError(
                field,
                f"must map strings to strings; {key!r}: {type(item).__name__} is not "
                f"(a {type(key).__name__} key)",
            )
        if len(item) > MAX_TRACE_VALUE_LENGTH:
            raise InvalidJobError(
                field, f"{key!r} is {len(item)} characters, the limit is {MAX_TRACE_VALUE_LENGTH}"
            )
        problem = text_problem(key) or text_problem(item)
        if problem is not None:
            raise InvalidJobError(field, f"entry {key!r} {problem}")
        carrier[key] = item
    return carrier


def check_key_limit(field: str, value: object) -> int:
    """How many jobs of one ordering key may be in progress at once: an integer in
    [1, :data:`MAX_KEY_LIMIT`]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJobError(field, f"must be an integer, not {type(value).__name__}")
    if not 1 <= value <= MAX_KEY_LIMIT:
        raise InvalidJobError(field, f"must be in [1, {MAX_KEY_LIMIT}], got {value}")
    return value


def check_queue_limits(field: str, value: object) -> dict[str, int]:
    """Per-queue concurrency limits: a mapping of queue names (:func:`check_name`) to
    integers in [1, :data:`MAX_QUEUE_LIMIT`], each the most jobs of that queue running at
    once across all workers. ``None`` is no limits. Returns a plain ``dict`` copy."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidJobError(
            field, f"must be a mapping of queue names to limits, not {type(value).__name__}"
        )
    limits: dict[str, int] = {}
    for queue, limit in value.items():
        name = check_name(field, queue)
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidJobError(
                field, f"the limit of queue {name!r} must be an integer, not {type(limit).__name__}"
            )
        if not 1 <= limit <= MAX_QUEUE_LIMIT:
            raise InvalidJobError(
                field, f"the limit of queue {name!r} must be in [1, {MAX_QUEUE_LIMIT}], got {limit}"
            )
        limits[name] = limit
    return limits


_Checked = TypeVar("_Checked")


def as_configuration(check: Callable[[str, Any], _Checked], field: str, value: object) -> _Checked:
    """``check`` (one of this module's, the rule a job's field follows) on a setting of
    the application's own, a task option, a registry default, a dashboard argument: the
    same rule, but configuration, so a :class:`~sqla_jobs.errors.ConfigurationError`
    (``"<field> <reason>"``) instead of an :class:`~sqla_jobs.errors.InvalidJobError`."""
    try:
        return check(field, value)
    except InvalidJobError as exc:
        raise ConfigurationError(f"{field} {exc.reason}") from None


#: The most starts a rate limit allows per window.
MAX_RATE_LIMIT: Final = 100_000
#: The longest window of a rate limit: a day.
MAX_RATE_SECONDS: Final = 86_400


@dataclass(frozen=True)
class RateLimit:
    """At most ``limit`` job starts in any window of ``per`` (a ``timedelta`` or seconds;
    one second by default) in a queue, across every worker that claims with it: every
    attempt counts, first or retried or taking over an expired lease, from the moment its
    claim starts it, by the database's clock. ``RateLimit(50)`` is 50 per second,
    ``RateLimit(600, per=timedelta(minutes=1))`` 600 a minute (in bursts: a sliding window,
    not a spacing). ``per_key=True``: the limit is each ordering key's of the queue, each
    with its own window (``RateLimit(5, per_key=True)``: 5 a second per customer, for jobs
    enqueued with ``ordering_key=f"customer:{id}"`` and claimed with ordering keys on); the
    queue's jobs without a key are not limited then. Raises
    :class:`~sqla_jobs.errors.ConfigurationError` for a limit outside [1,
    :data:`MAX_RATE_LIMIT`] or a window not more than 0 and at most a day."""

    limit: int
    per: timedelta | float = 1.0
    per_key: bool = False

    def __post_init__(self) -> None:
        limit, per = self.limit, self.per
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise ConfigurationError(f"RateLimit.limit must be an integer, not {limit!r}")
        if not 1 <= limit <= MAX_RATE_LIMIT:
            raise ConfigurationError(
                f"RateLimit.limit must be in [1, {MAX_RATE_LIMIT}], got {limit}"
            )
        as_configuration(check_rate_window, "RateLimit.per", per)
        if not isinstance(self.per_key, bool):
            raise ConfigurationError(
                f"RateLimit.per_key must be True or False, not {self.per_key!r}"
            )

    @property
    def seconds(self) -> float:
        """The window, in seconds."""
        per = self.per
        return per.total_seconds() if isinstance(per, timedelta) else float(per)


def check_rate_window(field: str, value: object) -> timedelta:
    """A rate limit's window: a positive ``timedelta`` or number of seconds, at most
    :data:`MAX_RATE_SECONDS` (a day)."""
    return _bounded_duration(field, value, MAX_RATE_SECONDS, "a day")


def check_rate_limits(field: str, value: object) -> dict[str, RateLimit]:
    """Per-queue rate limits: a mapping of queue names (:func:`check_name`) to
    :class:`RateLimit`. ``None`` is no limits. Returns a plain ``dict`` copy."""
    return _per_queue(field, value, RateLimit, "limit", "RateLimit(50) is 50 a second")


_Setting = TypeVar("_Setting")


def _per_queue(
    field: str, value: object, kind: type[_Setting], noun: str, example: str
) -> dict[str, _Setting]:
    # A mapping of queue names (check_name) to ``kind`` (None: none), as a plain dict copy;
    # the ``noun`` of a queue and an ``example`` of a ``kind`` name them in the errors.
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidJobError(
            field,
            f"must be a mapping of queue names to {kind.__name__}, not {type(value).__name__}",
        )
    settings: dict[str, _Setting] = {}
    for queue, setting in value.items():
        name = check_name(field, queue)
        if not isinstance(setting, kind):
            raise InvalidJobError(
                field,
                f"the {noun} of queue {name!r} must be a {kind.__name__} ({example}), "
                f"not {type(setting).__name__}",
            )
        settings[name] = setting
    return settings


#: The largest weight of a tenant in fair shares (:class:`FairShare`).
MAX_FAIR_WEIGHT: Final = 1_000


@dataclass(frozen=True)
class FairShare:
    """Claim a queue fairly across tenants: the values of ``column``, a column of the job
    model (a customer, an account, an API token). Each claim spreads its slots over the
    tenants that have runnable jobs, round robin: every tenant's first job comes before any
    tenant's second, so one tenant's backlog of 100,000 jobs takes no more of a claim than
    another's ten. ``weights`` (tenant value to a weight in [1, :data:`MAX_FAIR_WEIGHT`],
    default 1 each) gives a tenant that many jobs per round: ``{"acme": 3}``. Within a
    tenant, jobs keep their ``(priority, run_at, id)`` order. Jobs whose column is NULL
    share one tenant. Applies to the queue's jobs without an ordering key (keyed jobs keep
    their keys' own order and ``key_limit``). Raises
    :class:`~sqla_jobs.errors.ConfigurationError` for a column that is not a name or a weight
    outside that range; the column must be one of the model's, checked where the model is
    known (the claim, the worker's start)."""

    column: str
    weights: Mapping[Any, int] | None = None

    def __post_init__(self) -> None:
        column: object = self.column
        if not isinstance(column, str) or not column.isidentifier():
            raise ConfigurationError(
                f"FairShare.column must be a column name of the job model, not {column!r}"
            )
        if self.weights is None:
            return
        if not isinstance(self.weights, Mapping):
            raise ConfigurationError(
                "FairShare.weights must be a mapping of tenant values to weights, not "
                f"{type(self.weights).__name__}"
            )
        for tenant, weight in self.weights.items():
            if isinstance(weight, bool) or not isinstance(weight, int):
                raise ConfigurationError(
                    f"FairShare.weights: the weight of {tenant!r} must be an integer, "
                    f"not {type(weight).__name__}"
                )
            if not 1 <= weight <= MAX_FAIR_WEIGHT:
                raise ConfigurationError(
                    f"FairShare.weights: the weight of {tenant!r} must be in "
                    f"[1, {MAX_FAIR_WEIGHT}], got {weight}"
                )
        # A copy of its own, read-only: the caller's mapping changing later changes nothing.
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))

    def weight(self, tenant: object) -> int:
        """The weight of ``tenant`` (1 unless :attr:`weights` names it)."""
        return 1 if self.weights is None else self.weights.get(tenant, 1)


def check_fair_shares(field: str, value: object) -> dict[str, FairShare]:
    """Per-queue fair shares: a mapping of queue names (:func:`check_name`) to
    :class:`FairShare`. ``None`` is none. Returns a plain ``dict`` copy."""
    return _per_queue(field, value, FairShare, "fair share", "FairShare('tenant_id')")


def check_field(field: str, value: object, *, max_args_bytes: int) -> object:
    """Check ``value`` for the job field ``field`` (one of :data:`JOB_FIELDS`); return the
    value to store."""
    if field in ("queue", "task"):
        return check_name(field, value)
    if field == "args":
        checked_args(field, value, max_bytes=max_args_bytes)
        return value
    if field == "priority":
        return check_priority(field, value)
    if field == "max_attempts":
        return check_max_attempts(field, value)
    if field == "run_at":
        return check_run_at(field, value)
    if field in ("ordering_key", "key_limit"):
        if value is None:  # no key; no limit of its own (1)
            return None
        if field == "ordering_key":
            return check_ordering_key(field, value)
        return check_key_limit(field, value)
    if field == "time_limit":
        return None if value is None else check_time_limit(field, value)  # None: the task's
    raise ValueError(f"{field!r} is not one of {sorted(JOB_FIELDS)}")
