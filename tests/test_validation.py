"""Bad input: a typed error naming the field, before any SQL, and nothing written."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from models import ArchiveJob, EmailJob, EmailJobResult, Order
from no_sql import no_sql
from sqlalchemy import event
from sqlalchemy.orm import DeclarativeBase, Session, validates

import sqla_jobs
from sqla_jobs import (
    ConfigurationError,
    InvalidJobError,
    JobArgumentsError,
    JobMixin,
    Registry,
    validation,
)
from sqla_jobs.queue import DEFAULT_LEASE
from sqla_jobs.validation import MAX_JSON_DEPTH


class Unserialisable:
    pass


BAD_ARGS: list[tuple[str, Any, str]] = [
    ("not a dict", ["a", "list"], "must be a JSON object"),
    ("a set", {"s": {1, 2}}, "set, which is not JSON"),
    ("an object", {"o": Unserialisable()}, "which is not JSON"),
    ("bytes", {"b": b"raw"}, "bytes, which is not JSON"),
    ("NUL in a value", {"s": "a\x00b"}, "NUL"),
    ("NUL in a key", {"a\x00": 1}, "NUL"),
    ("NUL deep inside", {"l": [{"x": ["ok", "\x00"]}]}, "NUL"),
    ("NaN", {"f": float("nan")}, "NaN or Infinity"),
    ("Infinity", {"f": float("inf")}, "NaN or Infinity"),
    ("-Infinity", {"f": [float("-inf")]}, "NaN or Infinity"),
    ("a lone surrogate", {"s": "\ud800"}, "surrogate"),
    ("a non-string key", {1: "one"}, "keys must be strings"),
]


@pytest.mark.parametrize(("case", "args", "message"), BAD_ARGS, ids=[c[0] for c in BAD_ARGS])
def test_bad_arguments_raise_before_any_sql(
    queue_engine: sa.Engine, case: str, args: Any, message: str
) -> None:
    with no_sql(queue_engine), pytest.raises(JobArgumentsError, match=message) as info:
        EmailJob(task="t", args=args)
    assert info.value.field == "args"
    assert isinstance(info.value, InvalidJobError)
    assert isinstance(info.value, ValueError)


def _nested(depth: int) -> dict[str, Any]:
    """A dict holding dicts ``depth`` levels deep in all (itself the first)."""
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(depth - 1):
        node["a"] = {}
        node = node["a"]
    return deep


# 101: just past the limit; 1,500: what json encodes but a worker's json may not decode (it
# reached the driver before: a bare RecursionError at flush); 5,000: past json's own limit.
@pytest.mark.parametrize("depth", [101, 1500, 5000])
def test_arguments_nested_too_deeply_raise_a_typed_error(
    queue_engine: sa.Engine, depth: int
) -> None:
    deep = _nested(depth)
    too_deep = f"nested more than {MAX_JSON_DEPTH} levels deep"
    with no_sql(queue_engine), pytest.raises(JobArgumentsError, match=too_deep):
        EmailJob(task="t", args=deep)
    with no_sql(queue_engine), pytest.raises(JobArgumentsError, match=too_deep):
        sqla_jobs.validation.check_json("result", [deep])
    with no_sql(queue_engine), pytest.raises(JobArgumentsError, match=too_deep):
        sqla_jobs.validation.check_json("result", [[deep]] * 3)
    # Changed in place after it was assigned: the flush refuses it, before any SQL.
    with Session(queue_engine) as session:
        job = EmailJob(task="t", args={"a": {}})
        job.args["a"] = deep
        session.add(job)
        with no_sql(queue_engine), pytest.raises(JobArgumentsError, match=too_deep):
            session.flush()


def test_arguments_at_the_depth_limit_are_stored_and_read_back(queue_engine: sa.Engine) -> None:
    args = _nested(MAX_JSON_DEPTH)
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t", args=args))
    with Session(queue_engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, EmailJob)
    assert job.args == args


def test_arguments_over_the_size_limit(queue_engine: sa.Engine) -> None:
    limit = EmailJob.max_args_bytes
    EmailJob(task="t", args={"s": "x" * (limit - 20)})  # just under the limit is fine
    with no_sql(queue_engine), pytest.raises(JobArgumentsError, match="the limit is"):
        EmailJob(task="t", args={"s": "x" * limit})


def test_size_limit_is_a_per_model_option() -> None:
    class TinyArgs(EmailJob):
        max_args_bytes = 32

    TinyArgs(task="t", args={"a": 1})
    with pytest.raises(JobArgumentsError, match="the limit is 32"):
        TinyArgs(task="t", args={"a": "a long string over thirty-two bytes"})


BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("queue", {"queue": ""}, "must not be empty"),
    ("queue", {"queue": "has space"}, "malformed"),
    ("queue", {"queue": "-leading-dash"}, "malformed"),
    ("queue", {"queue": "q" * 201}, "the limit is 200"),
    ("queue", {"queue": 5}, "must be a string"),
    ("task", {"task": ""}, "must not be empty"),
    ("task", {"task": "semi;colon"}, "malformed"),
    ("task", {"task": None}, "must be a string"),
    ("priority", {"priority": 101}, "out of range"),
    ("priority", {"priority": -101}, "out of range"),
    ("priority", {"priority": True}, "must be an integer"),
    ("priority", {"priority": 1.5}, "must be an integer"),
    ("max_attempts", {"max_attempts": 0}, "out of range"),
    ("max_attempts", {"max_attempts": 1001}, "out of range"),
    ("run_at", {"run_at": datetime(2030, 1, 1)}, "timezone-aware"),  # noqa: DTZ001
    ("run_at", {"run_at": "tomorrow"}, "must be a datetime"),
    ("status", {"status": "paused"}, "must be one of"),
]


@pytest.mark.parametrize(
    ("field", "values", "message"),
    BAD_FIELDS,
    ids=[f"{c[0]}-{next(iter(c[1].values()))!r}"[:40] for c in BAD_FIELDS],
)
def test_bad_fields_raise_naming_the_field(
    queue_engine: sa.Engine, field: str, values: dict[str, Any], message: str
) -> None:
    with no_sql(queue_engine), pytest.raises(InvalidJobError, match=message) as info:
        EmailJob(**({"task": "t"} | values))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_assignment_after_construction_is_checked_too() -> None:
    job = EmailJob(task="t")
    with pytest.raises(InvalidJobError) as info:
        job.priority = 1000
    assert info.value.field == "priority"


def test_in_place_change_is_caught_at_flush_and_nothing_is_written(
    queue_engine: sa.Engine,
) -> None:
    inserted_jobs: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "INSERT INTO email_jobs" in statement:
            inserted_jobs.append(statement)

    event.listen(queue_engine, "before_cursor_execute", record)
    try:
        with Session(queue_engine) as session:
            session.begin()
            session.add(Order(id=1, customer="ada"))
            session.flush()  # the business row reaches the server first
            job = EmailJob(task="t", args={"values": [1.0]})
            job.args["values"].append(float("nan"))  # no validator sees this
            session.add(job)
            with pytest.raises(JobArgumentsError, match="NaN"):
                session.commit()
            session.rollback()
    finally:
        event.remove(queue_engine, "before_cursor_execute", record)

    assert inserted_jobs == []  # the job's INSERT never ran
    with queue_engine.connect() as connection:
        assert connection.execute(sa.text("SELECT count(*) FROM orders")).scalar() == 0
        assert connection.execute(sa.text("SELECT count(*) FROM email_jobs")).scalar() == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"queues": []}, "queues"),
        ({"queues": ["ok", "not ok"]}, "queues"),
        ({"limit": 0}, "limit"),
        ({"limit": 10_001}, "limit"),
        ({"limit": True}, "limit"),
        ({"lease": 0}, "lease"),
        ({"lease": -1.0}, "lease"),
        ({"lease": float("nan")}, "lease"),
        ({"lease": timedelta(0)}, "lease"),
        ({"worker": "bad worker name"}, "worker"),
    ],
)
def test_bad_claim_arguments_raise_before_any_sql(
    queue_engine: sa.Engine, kwargs: dict[str, Any], field: str
) -> None:
    with Session(queue_engine) as session:
        with no_sql(queue_engine), pytest.raises(InvalidJobError) as info:
            sqla_jobs.claim(session, EmailJob, **kwargs)
        assert info.value.field == field


@pytest.mark.parametrize("value", [0, -1, float("nan"), 1e-7, timedelta(0), timedelta(-1)])
def test_a_duration_must_be_positive(value: timedelta | float) -> None:
    with pytest.raises(InvalidJobError, match=r"^lease: must be positive, got ") as info:
        validation.check_duration("lease", value)
    assert info.value.field == "lease"


def test_a_duration_is_a_timedelta_or_seconds() -> None:
    assert validation.check_duration("lease", 1.5) == timedelta(seconds=1.5)
    assert validation.check_duration("lease", 30) == DEFAULT_LEASE
    assert validation.check_duration("lease", timedelta(minutes=2)) == timedelta(minutes=2)


def test_the_registry_checks_durations_the_same_way_as_configuration() -> None:
    # The same check as the queue's; a task option is configuration, so the error is the
    # registry's own.
    assert Registry(EmailJob).default_lease == DEFAULT_LEASE
    with pytest.raises(ConfigurationError, match=r"^default_lease must be positive, got 0$"):
        Registry(EmailJob, default_lease=0)
    with pytest.raises(ConfigurationError, match=r"^lease must be positive, got -2\.0$"):
        Registry(EmailJob).add(lambda ctx: None, name="t", lease=-2.0)


def test_models_without_the_mixin_are_refused() -> None:
    with Session() as session, pytest.raises(sqla_jobs.ConfigurationError):
        sqla_jobs.claim(session, Order, queues="q")  # type: ignore[arg-type]


def test_a_result_jsonb_cannot_store_changes_nothing(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t"))
    with Session(queue_engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, EmailJob)
    with Session(queue_engine) as session, session.begin():
        with no_sql(queue_engine), pytest.raises(JobArgumentsError) as info:
            sqla_jobs.complete(
                session, job, result={"x": float("nan")}, result_model=EmailJobResult
            )
        assert info.value.field == "result"
    with queue_engine.connect() as connection:
        status = connection.execute(sa.text("SELECT status FROM email_jobs")).scalar()
        assert status == "running"
        assert connection.execute(sa.text("SELECT count(*) FROM email_job_results")).scalar() == 0


def test_text_that_looks_like_an_escape_is_not_mistaken_for_nul(queue_engine: sa.Engine) -> None:
    # "\\u0000" is six ordinary characters, which jsonb stores as they are.
    args = {"pattern": "\\u0000", "emoji": "\U0001f600"}
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t", args=args))
    with Session(queue_engine) as session:
        assert session.execute(sa.select(EmailJob.args)).scalar_one() == args


@pytest.mark.parametrize("value", [float("inf"), 1e12, timedelta(days=365 * 101)])
def test_a_duration_past_a_century_is_refused(value: timedelta | float) -> None:
    # A timestamp computed from it would overflow in the database, mid-transaction.
    with pytest.raises(InvalidJobError, match=r"^delay: must be at most .* \(about 100 years\)"):
        validation.check_duration("delay", value)


# -- the fast path of the args check at assignment (validation.checked_args) ----------------

_ARGS_CASES: list[Any] = [
    {"n": 1},
    {"n": [1, 2.5, "x", None, True, False, {"k": "v"}, (1, 2)]},
    {"big": 10**40, "neg": -(2**63), "tiny": -1.2345678901234567e-308},
    {"ctl": '\x1f\n\t"\\'},
    {"s": "x" * 60},
    {"e": "\u00e9"},
    {"nul": "a\x00b"},
    {"nul\x00key": 1},
    {"nan": float("nan")},
    {"inf": [float("-inf")]},
    {1: "int key"},
    {None: "None key"},
    {"b": b"bytes"},
    {"set": {1, 2}},
    {"c": 1 + 2j},
    {"surrogate": "\ud800"},
    {"deep": [[[[{"ok": [None]}]]]]},
    ["not", "a", "dict"],
]


@pytest.mark.parametrize("max_bytes", [16, 64, validation.DEFAULT_MAX_ARGS_BYTES])
@pytest.mark.parametrize("value", _ARGS_CASES, ids=repr)
def test_the_fast_args_check_agrees_with_the_full_one(value: Any, max_bytes: int) -> None:
    def outcome(check: Any) -> str | None:
        try:
            check("args", value, max_bytes=max_bytes)
        except JobArgumentsError as exc:
            return str(exc)
        return None

    assert outcome(validation.checked_args) == outcome(validation.check_args)


@pytest.mark.parametrize(
    "value",
    [
        {"s": "\x1f" * 1000},
        {"s": "\x00\x01" * 10},
        {"f": [False] * 1000},
        {"n": [None] * 1000},
        {"i": [-(2**31)] * 100, "l": [10**100, -(10**300)]},
        {"x": [-1.2345678901234567e-308] * 100},
        {"": {"": {"": [[], {}, ""]}}},
        {"u": "\u00e9" * 100, "k\u00e9": "\U0001f600"},
    ],
    ids=lambda v: repr(v)[:40],
)
def test_a_snapshot_bounds_the_json_size(value: Any) -> None:
    # The fast path's size bound: no JSON text is longer than 6 bytes per snapshot byte.
    snapshot = validation.args_snapshot(value)
    assert snapshot is not None
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    assert size <= 6 * len(snapshot)


def test_a_models_own_validator_runs_after_the_mixins_check() -> None:
    class Base(DeclarativeBase):
        pass

    class LowerQueueJob(JobMixin, Base):
        __tablename__ = "lower_queue_jobs"

        @validates("queue")
        def _lower(self, key: str, value: str) -> str:
            return value.lower()

    assert LowerQueueJob(task="t", queue="Email").queue == "email"
    job = LowerQueueJob(task="t")
    job.queue = "Billing"
    assert job.queue == "billing"
    with pytest.raises(InvalidJobError) as info:
        LowerQueueJob(task="t", queue="")
    assert info.value.field == "queue"


# -- values that reached the driver or the server: refused before any SQL, and the caller's
# -- transaction goes on (issue 29, finding 8) ---------------------------------------------


def _still_usable(session: Session, engine: sa.Engine, order_id: int) -> None:
    """The caller's transaction was not aborted: its business row commits."""
    session.add(Order(id=order_id, customer="ada"))
    session.commit()
    with Session(engine) as check:
        assert check.get(Order, order_id) is not None


PAST_BIGINT = 2**63


@pytest.mark.parametrize(
    "operation",
    [
        lambda s, i: sqla_jobs.cancel(s, EmailJob, i),
        lambda s, i: sqla_jobs.retry(s, EmailJob, i),
        lambda s, i: sqla_jobs.delete(s, EmailJob, i),
        lambda s, i: sqla_jobs.history.job_record(s, ArchiveJob, i),
    ],
    ids=["cancel", "retry", "delete", "job_record"],
)
@pytest.mark.parametrize("job_id", [PAST_BIGINT, -PAST_BIGINT - 1])
def test_an_id_past_bigint_is_refused_and_the_transaction_goes_on(
    queue_engine: sa.Engine, operation: Any, job_id: int
) -> None:
    with Session(queue_engine) as session:
        session.add(Order(id=1, customer="before"))
        session.flush()
        with no_sql(queue_engine), pytest.raises(InvalidJobError, match="bigint") as info:
            operation(session, job_id)
        assert info.value.field == "job_id"
        _still_usable(session, queue_engine, 2)
    with Session(queue_engine) as check:
        assert check.get(Order, 1) is not None


@pytest.mark.parametrize("text", ["a\ud800b", "a\x00b"])
def test_keys_the_driver_cannot_send_are_refused_and_the_transaction_goes_on(
    queue_engine: sa.Engine, text: str
) -> None:
    with Session(queue_engine) as session:
        with no_sql(queue_engine), pytest.raises(InvalidJobError) as info:
            EmailJob(task="t", ordering_key=text)
        assert info.value.field == "ordering_key"
        with no_sql(queue_engine), pytest.raises(sqla_jobs.UniqueJobError) as unique:
            sqla_jobs.enqueue_unique(session, EmailJob(task="t"), key=text)
        assert unique.value.field == "unique_key"
        with no_sql(queue_engine), pytest.raises(sqla_jobs.UniqueJobError):
            sqla_jobs.enqueue_unique_many(session, EmailJob, [{"task": "t", "unique_key": text}])
        _still_usable(session, queue_engine, 3)
