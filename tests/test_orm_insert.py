"""The ORM INSERT of a job: it sends only the columns the caller set; the database fills in
the rest, and the flush reads those defaults back (RETURNING), with no extra query. And the
flush-time recheck of ``args`` catches every change made after the assignment."""

from __future__ import annotations

import enum
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from models import EmailJob
from sqlalchemy import event
from sqlalchemy.orm import Session, attributes

from sqla_jobs import JobArgumentsError, validation
from sqla_jobs.models import Job, metadata
from sqla_jobs.validation import DEFAULT_MAX_ATTEMPTS

_INSERT = re.compile(r"\s*INSERT INTO (\w+) \(([^)]*)\)", re.IGNORECASE)
# Given a type here: SQLAlchemy 2.0.30 leaves set_committed_value unannotated.
set_committed_value: Callable[[object, str, Any], None] = attributes.set_committed_value


@pytest.fixture(scope="module")
def job_engine(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    """A database with the library's own tables (sqla_jobs.models); tests roll back."""
    engine = sa.create_engine(fresh_database("sqla_jobs_orm"))
    metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def recorded(engine: sa.Engine) -> Iterator[list[tuple[str, Any]]]:
    """Every (statement, parameters) sent to the driver inside the block."""
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", record)


def inserts(sent: list[tuple[str, Any]], table: str) -> list[tuple[list[str], Any]]:
    """The column list and parameters of each INSERT INTO ``table`` that was sent."""
    found = []
    for statement, parameters in sent:
        match = _INSERT.match(statement)
        if match and match.group(1) == table:
            found.append(([name.strip() for name in match.group(2).split(",")], parameters))
    return found


def parameter_count(parameters: Any) -> int:
    if isinstance(parameters, dict):
        return len(parameters)
    return sum(parameter_count(p) for p in parameters) if isinstance(parameters, list) else 1


def test_insert_sends_only_the_columns_that_were_set(job_engine: sa.Engine) -> None:
    with Session(job_engine) as session, session.begin():
        with recorded(job_engine) as sent:
            session.add(Job(task="send_receipt", args={"order": 7}))
            session.flush()
        ((columns, parameters),) = inserts(sent, "sqla_jobs")
        assert columns == ["task", "args"]
        assert parameter_count(parameters) == 2

        with recorded(job_engine) as sent:
            session.add_all([Job(task="t", args={"i": i}) for i in range(50)])
            session.add(Job(task="t", args={}, queue="email", priority=5))
            session.add(Job(task="only_task"))
            session.flush()
        # Rows are grouped by the set of columns they carry; each group sends its own.
        found = inserts(sent, "sqla_jobs")
        assert sorted(columns for columns, _ in found) == [
            ["queue", "task", "args", "priority"],
            ["task"],
            ["task", "args"],
        ]
        assert sum(parameter_count(parameters) for _, parameters in found) == 50 * 2 + 4 + 1
        session.rollback()


def test_a_models_own_columns_follow_sqlalchemys_rules(queue_engine: sa.Engine) -> None:
    # The mixin's columns are left out when unset; a model's own nullable column without a
    # default is still sent as NULL (SQLAlchemy's behaviour, not ours to change).
    with Session(queue_engine) as session, session.begin():
        with recorded(queue_engine) as sent:
            session.add(EmailJob(task="send_receipt", args={"order": 7}))
            session.flush()
        ((columns, _parameters),) = inserts(sent, "email_jobs")
        assert columns == ["order_id", "task", "args"]
        session.rollback()


def test_unset_columns_read_none_before_the_flush_and_defaults_after(
    job_engine: sa.Engine,
) -> None:
    with Session(job_engine) as session, session.begin():
        job = Job(task="send_receipt", args={"order": 7})
        bare = Job(task="no_args")
        unset = ("queue", "status", "priority", "run_at", "attempts", "max_attempts", "created_at")
        assert [getattr(job, key) for key in unset] == [None] * len(unset)
        assert sa.inspect(bare).attrs.args.value is None
        session.add_all([job, bare])
        session.flush()
        db_now = session.execute(sa.select(sa.func.now())).scalar_one()

        # The flush read every default back: reading them now sends nothing.
        with recorded(job_engine) as sent:
            for row in (job, bare):
                assert row.id is not None
                assert row.status == "pending"
                assert row.queue == "default"
                assert (row.attempts, row.max_attempts, row.priority) == (
                    0,
                    DEFAULT_MAX_ATTEMPTS,
                    0,
                )
                assert isinstance(row.run_at, datetime)
                assert row.run_at == row.created_at == db_now  # the transaction's clock
                assert row.lease_expires_at is None
                assert row.leased_by is None
                assert row.last_error is None
                assert row.finished_at is None
            assert job.args == {"order": 7}
            assert bare.args == {}
        assert sent == []
        session.rollback()


def test_what_the_flush_read_back_is_what_the_database_stored(job_engine: sa.Engine) -> None:
    with Session(job_engine) as session, session.begin():
        job = Job(task="send_receipt", args={"order": 7}, max_attempts=3)
        session.add(job)
        session.flush()
        seen = {c.key: getattr(job, c.key) for c in sa.inspect(Job).column_attrs}
        table = Job.__table__
        stored = session.execute(sa.select(table).where(table.c.id == job.id)).one()
        assert seen == dict(stored._mapping)
        assert seen["max_attempts"] == 3
        session.rollback()


# -- the flush-time recheck of args --------------------------------------------------------
# The validator checks args at assignment; the flush checks them once more, because a dict
# can be changed in place. It skips the JSON encoding only when the value is byte-for-byte
# what the validator passed (validation.args_snapshot) and the model's limit was not lowered
# since; every other case is checked again.


def test_snapshots_tell_apart_values_that_python_finds_equal() -> None:
    values: list[Any] = [
        {"a": 1},
        {"a": True},
        {"a": 1.0},
        {"a": [1]},
        {"a": (1,)},
        {"a": 1, "b": 2},
        {"b": 2, "a": 1},
        {"a": "\u00e9"},
        {"a": "e\u0301"},
    ]
    snapshots = [validation.args_snapshot(value) for value in values]
    assert None not in snapshots
    assert len(set(snapshots)) == len(values)
    shared = ["x" * 50]
    assert validation.args_snapshot({"a": shared, "b": shared}) == validation.args_snapshot(
        {"a": ["x" * 50], "b": ["x" * 50]}
    )  # no back-references: identity and reference counts do not matter


class Flag(enum.IntEnum):
    ON = 1


@pytest.mark.parametrize(
    "value", [OrderedDict(a=1), {"a": Flag.ON}, {"a": [OrderedDict()]}], ids=repr
)
def test_no_snapshot_of_subclasses(value: Any) -> None:
    validation.check_args("args", value)  # storable...
    assert validation.args_snapshot(value) is None  # ...but always checked again at flush


def _flush_fails(engine: sa.Engine, job: Job, message: str) -> None:
    with Session(engine) as session, recorded(engine) as sent:
        session.begin()
        session.add(job)
        with pytest.raises(JobArgumentsError, match=message) as info:
            session.flush()
        assert info.value.field == "args"
        session.rollback()
    assert sent == [] or all("INSERT" not in statement for statement, _ in sent)


def _set_ones_to_floats(job: Job) -> None:
    values = job.args["v"]
    values[:] = [1.0] * len(values)  # equal in Python (1 == 1.0), "1.0" is longer in JSON


def _set_int_key(job: Job) -> None:
    del job.args["a"]
    job.args[1] = "one"  # type: ignore[index]


def _set_nan_deep(job: Job) -> None:
    job.args["v"].append({"x": float("nan")})


IN_PLACE_CHANGES = [
    ("equal but longer", {"v": [1] * 20}, _set_ones_to_floats, "the limit is 64"),
    ("an int key", {"a": 1}, _set_int_key, "keys must be strings"),
    ("NaN deep inside", {"v": [1]}, _set_nan_deep, "NaN"),
]


@pytest.mark.parametrize(
    ("case", "args", "change", "message"), IN_PLACE_CHANGES, ids=[c[0] for c in IN_PLACE_CHANGES]
)
def test_any_in_place_change_is_caught_at_flush(
    job_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    args: dict[str, Any],
    change: Callable[[Job], None],
    message: str,
) -> None:
    monkeypatch.setattr(Job, "max_args_bytes", 64)
    job = Job(task="t", args=args)  # passes: {"v":[1,1,...]} is 47 bytes at most
    change(job)
    _flush_fails(job_engine, job, message)


def test_a_value_set_without_the_validator_is_checked_at_flush(job_engine: sa.Engine) -> None:
    job = Job(task="t", args={"ok": 1})
    set_committed_value(job, "args", {"f": float("inf")})  # no validator runs
    _flush_fails(job_engine, job, "NaN or Infinity")


def test_a_lower_limit_at_flush_applies(
    job_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = Job(task="t", args={"s": "x" * 100})
    monkeypatch.setattr(Job, "max_args_bytes", 64)
    _flush_fails(job_engine, job, "the limit is 64")


def test_a_mapping_that_is_not_a_plain_dict_is_always_rechecked(job_engine: sa.Engine) -> None:
    args: OrderedDict[str, Any] = OrderedDict(v=[1])
    job = Job(task="t", args=args)
    args["v"].append(float("nan"))
    _flush_fails(job_engine, job, "NaN")


def test_an_unchanged_dict_skips_the_second_encoding(
    job_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    unchanged = Job(task="t", args={"n": [1, 2.5, "x", None, True, {"k": "v"}]})
    changed = Job(task="t", args={"n": 1})
    changed.args["n"] = 2  # still valid, but no longer what the validator saw
    calls: list[object] = []
    check_args = validation.check_args

    def counting(field: str, value: object, *, max_bytes: int) -> int:
        calls.append(value)
        return check_args(field, value, max_bytes=max_bytes)

    monkeypatch.setattr(validation, "check_args", counting)
    with Session(job_engine) as session, session.begin():
        session.add_all([unchanged, changed])
        session.flush()
        assert calls == [{"n": 2}]
        stored = session.execute(
            sa.select(Job.args).where(Job.id.in_([unchanged.id, changed.id])).order_by(Job.id)
        ).scalars()
        assert list(stored) == [{"n": [1, 2.5, "x", None, True, {"k": "v"}]}, {"n": 2}]
        session.rollback()
