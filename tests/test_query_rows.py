"""Each statement the query layer reads rows of returns exactly its row type's fields, in
order (sqla_jobs._queries.rows): a column added, dropped, renamed or moved in a RETURNING list
fails here, not as a value read from the wrong position above the layer."""

from __future__ import annotations

from typing import Any, NamedTuple, TypedDict

import pytest
import sqlalchemy as sa
from models import ArchiveJob, EmailJob

from sqla_jobs import ClaimedJob
from sqla_jobs._queries import claims, history, keyed, outcomes
from sqla_jobs._queries.rows import (
    ClaimRow,
    CompleteRow,
    DeleteRow,
    FailRow,
    FenceRow,
    LockKeysRow,
    LockRow,
    RowType,
    WalkKeysRow,
)
from sqla_jobs._queries.run import NoParams, Query, QueryDefinitionError
from sqla_jobs.history import history_table

#: The row type of each statement the queue reads rows of.
ROW_TYPES: dict[Any, RowType] = {
    claims.claim: ClaimRow,
    keyed.claim_keyed: ClaimRow,
    keyed.lock_keys: LockKeysRow,
    keyed.walk_keys: WalkKeysRow,
    outcomes.complete: CompleteRow,
    outcomes.complete_held: FenceRow,
    outcomes.complete_and_delete: DeleteRow,
    outcomes.fail: FailRow,
    outcomes.heartbeat: FenceRow,
    outcomes.release: FenceRow,
    outcomes.cancel_attempts: FenceRow,
    outcomes.lock: LockRow,
    history.complete: CompleteRow,
    history.move_finished: CompleteRow,
}

#: The variants each builder is built in (its options), as the queue builds them.
VARIANTS: dict[Any, list[dict[str, Any]]] = {
    claims.claim: [
        {"queue_count": 1},
        {"queue_count": 2},
        {"queue_count": 1, "limited": True},
        {"queue_count": 1, "json_text": True},
    ],
    keyed.claim_keyed: [{}, {"limited": True}, {"json_text": True}],
    keyed.lock_keys: [
        {"rows": 16, "queue_count": 1},
        {"rows": 16, "queue_count": 2},
        {"rows": 16, "queue_count": 1, "limited": True},
    ],
    keyed.walk_keys: [
        {"rows": 16, "queue_count": 1},
        {"rows": 16, "queue_count": 2, "busy": True},
    ],
    history.complete: [{}, {"held": True}],
}

#: A value for each parameter the key statements take, which they run with on an empty table.
PARAMETERS: dict[str, Any] = {
    "queue_name": "q",
    "queue_names": ["q", "r"],
    "scan": 4,
    "per_key": 2,
    "limit": 2,
    "queue_slots": 1,
    "capacity": 0,
    "keep": True,
}


def _cases() -> list[tuple[str, Any, dict[str, Any]]]:
    return [
        (f"{builder.__module__}.{builder.__name__}{options or ''}", builder, options)
        for builder in ROW_TYPES
        for options in VARIANTS.get(builder, [{}])
    ]


def _table(builder: Any) -> sa.Table:
    # The history's statements are built on a model with a partitioned history.
    model = ArchiveJob if builder.__module__.endswith(".history") else EmailJob
    table: sa.Table = model.__table__  # type: ignore[assignment]
    return table


@pytest.mark.parametrize(
    ("name", "builder", "options"), _cases(), ids=[case[0] for case in _cases()]
)
def test_each_statement_returns_its_row_type(
    name: str, builder: Any, options: dict[str, Any], queue_engine: sa.Engine
) -> None:
    table = _table(builder)
    if builder.__module__.endswith(".history"):
        history_table(ArchiveJob)  # the history table the statement moves rows into
    statement = builder(table, **options)
    if isinstance(statement, sa.TextClause):
        # Text: its columns are known once it runs (here on an empty table, rolled back).
        compiled = statement.compile(dialect=queue_engine.dialect)
        params = {key: PARAMETERS[key] for key in compiled.binds}
        with queue_engine.connect() as connection, connection.begin():
            returned = list(connection.execute(statement, params).keys())
    else:
        returned = [column.key for column in statement.exported_columns]
    # A variant may leave out trailing fields that have a default (lock_keys' free slots).
    fields, defaults = ROW_TYPES[builder]._fields, ROW_TYPES[builder]._field_defaults
    assert tuple(returned) == fields[: len(returned)], name
    assert set(fields[len(returned) :]) <= set(defaults), name


def test_a_claimed_job_is_the_model_then_the_claimed_row_without_its_status() -> None:
    # claim() builds each ClaimedJob as (model, row.id, *row[2:]) from a ClaimRow.
    rest = tuple("attempt" if f == "attempts" else f for f in ClaimRow._fields[2:])
    assert ClaimRow._fields[:2] == ("id", "status")
    assert ClaimedJob._fields == ("model", "id", *rest)


@pytest.mark.parametrize("row_type", [FenceRow, CompleteRow, DeleteRow, LockRow])
def test_every_fenced_row_starts_with_the_fence(row_type: RowType) -> None:
    # queue._plumbing._fenced reads (row[0], row[1]) as (id, attempts) of each such row.
    assert row_type._fields[:2] == ("id", "attempts")


# -- a Query checks its record of parameters and its row against its statement -------------


class _IdParams(TypedDict):
    job_id: int


class _WrongParams(TypedDict):
    id: int


class _IdStatus(NamedTuple):
    id: int
    status: str


class _StatusId(NamedTuple):
    status: str
    id: int


def _id_and_status(table: sa.Table) -> sa.Select[Any]:
    return sa.select(table.c.id, table.c.status).where(table.c.id == sa.bindparam("job_id"))


def test_a_query_runs_with_its_record_and_reads_its_row(queue_engine: sa.Engine) -> None:
    table = _table(claims.claim)
    query = Query(_id_and_status, _IdParams, _IdStatus)
    with queue_engine.connect() as connection, connection.begin():
        (job_id,) = connection.execute(
            sa.insert(table).values(task="t").returning(table.c.id)
        ).one()
        row = query.one(connection, table, {"job_id": job_id})
        connection.rollback()
    assert row == _IdStatus(job_id, "pending")
    assert row is not None
    assert row.status == "pending"


@pytest.mark.parametrize(
    ("params", "row", "message"),
    [
        (_WrongParams, _IdStatus, r"takes \['job_id'\], its record _WrongParams \['id'\]"),
        (NoParams, _IdStatus, r"takes \['job_id'\], its record NoParams \[\]"),
        (_IdParams, _StatusId, r"returns \['id', 'status'\], its row _StatusId"),
    ],
)
def test_a_query_whose_record_or_row_does_not_match_fails_when_first_built(
    params: Any, row: Any, message: str
) -> None:
    query = Query(_id_and_status, params, row)
    with pytest.raises(QueryDefinitionError, match=message):
        query.statement(_table(claims.claim))
