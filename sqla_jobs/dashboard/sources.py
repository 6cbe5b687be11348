"""Where the dashboard reads jobs from, and the job list's pages over one or more sources.

A :class:`TableSource` is a table with the job columns whose ids grow with time: the job
table, and for a model with ``partitioned_history`` its history table of finished jobs as a
second source. :func:`read_page` merges the sources' windows by id, newest first, so the
list and its cursor stay the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, RowMapping, Table

from sqla_jobs._queries.dashboard import JOB_PAGE, WINDOW_FLOOR, JobPageParams, job_record
from sqla_jobs.queue import readable_values
from sqla_jobs.schema import JobStatus

__all__ = ["ListQuery", "Page", "TableSource", "find_job", "read_page"]


@dataclass(frozen=True)
class ListQuery:
    """The job list's filters and cursor, checked (``before`` is an id, or
    :data:`sqla_jobs._queries.dashboard.MAX_ID` for the first page)."""

    queue: str | None
    task: str | None
    status: JobStatus | None
    before: int


@dataclass(frozen=True)
class Page:
    """One page of the job list: its rows, newest first; the next page's cursor (None on
    the last page); ``sparse``: the page ended at the edge of a window, not because it was
    full (older jobs may still match)."""

    rows: list[Any]
    next_before: int | None
    sparse: bool


@dataclass(frozen=True)
class TableSource:
    """Jobs in ``table`` (the job columns, ids growing with time), read in windows of
    ``scan`` ids (see :mod:`sqla_jobs._queries.dashboard`)."""

    table: Table
    scan: int

    def window(self, connection: Connection, query: ListQuery, limit: int) -> tuple[list[Any], int]:
        """Up to ``limit`` matching jobs below the cursor, newest first, and the lowest id
        down to which they are all of this source's matches (0: none is left below)."""
        params: JobPageParams = {"before": query.before}
        if query.queue is not None:
            params["queue"] = query.queue
        if query.task is not None:
            params["task"] = query.task
        rows: list[Any] = JOB_PAGE.rows(
            connection,
            self.table,
            params,
            status=query.status,
            queue=query.queue is not None,
            task=query.task is not None,
            scan=self.scan,
            limit=limit,
        )
        if len(rows) == limit:
            return rows, rows[-1].id
        # Short: the window ran out. Every match down to its lowest id is here.
        floor = WINDOW_FLOOR.one(connection, self.table, {"before": query.before}, scan=self.scan)
        return rows, 0 if floor is None else int(floor.id)

    def job(self, connection: Connection, job_id: int) -> RowMapping | None:
        """Every column of job ``job_id``, or None."""
        return job_record(connection, self.table, job_id)


def read_page(
    connection: Connection, sources: Sequence[TableSource], query: ListQuery, size: int
) -> Page:
    """One page of ``size`` jobs over all ``sources``, merged newest first.

    Each source answers for the ids down to its own bound; below the highest of those
    bounds some source has not looked yet, so the page stops there, and the next page
    starts there: no job is skipped or shown twice. A time Python cannot hold shows as its
    text (:func:`~sqla_jobs.queue.readable_values`).
    """
    rows: list[Any] = []
    cover = 0
    with readable_values(connection):
        for source in sources:
            found, bound = source.window(connection, query, size + 1)
            rows += found
            cover = max(cover, bound)
    complete = sorted((row for row in rows if row.id >= cover), key=lambda r: r.id, reverse=True)
    if len(complete) > size:
        shown = complete[:size]
        return Page(shown, shown[-1].id, sparse=False)
    return Page(complete, cover or None, sparse=cover > 0)


def find_job(
    connection: Connection, sources: Sequence[TableSource], job_id: int
) -> RowMapping | None:
    """Job ``job_id`` from the first source that has it. A jsonb value Python cannot decode
    (a row another program wrote) shows as an :class:`~sqla_jobs.queue.UnreadableJson`, a
    time Python cannot hold as its text (:func:`~sqla_jobs.queue.readable_values`)."""
    with readable_values(connection):
        for source in sources:
            row = source.job(connection, job_id)
            if row is not None:
                return row
    return None
