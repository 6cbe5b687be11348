"""The query layer's execution: every statement it builds runs through here.

:func:`built` builds a statement once per table and options (building costs far more Python
time than running); :func:`fetch` runs one and returns its rows, on psycopg through the
driver's fast path where it can; :func:`readable_jsonb` and :func:`readable_values` read rows
that other programs wrote without failing on a value Python cannot hold
(:class:`UnreadableJson`); :func:`job_table_of` and :func:`result_table_of` resolve a model to
its table, refusing anything that is not one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import json.scanner
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeAlias, TypedDict, TypeVar, cast

import psycopg
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg.rows import tuple_row
from psycopg.types.json import JsonbLoader
from sqlalchemy import (
    ClauseElement,
    Connection,
    Dialect,
    Executable,
    Table,
    TextClause,
    inspect,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler

from sqla_jobs.errors import ConfigurationError
from sqla_jobs.schema import JobMixin, JobResultMixin

__all__ = [
    "Executor",
    "NoParams",
    "Query",
    "QueryDefinitionError",
    "UnreadableJson",
    "built",
    "driver_sql",
    "fetch",
    "job_table_of",
    "json_text_on_asyncpg",
    "readable_jsonb",
    "readable_values",
    "result_table_of",
]

#: What the operations run their statements on: the caller's session or Core connection.
Executor: TypeAlias = Session | Connection


@functools.lru_cache(maxsize=512)
def built(builder: Callable[..., Executable], table: Table | None, **options: Any) -> Executable:
    """``builder(table, **options)`` (``builder(**options)`` for a statement on no table of
    ours, ``table`` None), built once per table and options."""
    # Building a statement costs far more Python time than running it; each builder's
    # output depends only on the table and the options, so build it once.
    return builder(**options) if table is None else builder(table, **options)


_Params = TypeVar("_Params", bound=Mapping[str, Any])
_Row = TypeVar("_Row", bound=tuple[Any, ...])


class NoParams(TypedDict):
    """The parameters of a statement that takes none."""


class QueryDefinitionError(AssertionError):
    """A :class:`Query` whose record of parameters or row does not match its statement: a
    bug of the query layer, raised the first time the statement is built (so by the first
    test that runs it), never a condition a caller handles."""


@dataclass(frozen=True, eq=False)
class Query(Generic[_Params, _Row]):
    """One statement of the layer, named: how it is built, the record of its bind
    parameters and the row it returns.

    ``params`` is a ``TypedDict`` whose keys are the statement's bind names (its optional keys
    those of variants built with other options); ``row`` a ``NamedTuple`` whose fields are
    the columns it returns, in order (trailing fields with a default may be left out by a
    variant), or None for a statement that returns none. Both are checked against the
    statement once per table and options, when it is first run: a bind the record lacks or
    does not need, a column added, dropped, renamed or moved, fails the first test that runs
    the statement (:class:`QueryDefinitionError`), not as a value read from the wrong place
    above the layer. The callers above pass a record mypy checks and read rows by name.
    """

    builder: Callable[..., Executable]
    params: type[_Params]
    row: type[_Row] | None = None

    def statement(self, table: Table | None = None, **options: Any) -> Executable:
        """The statement, built once per table and options, checked the first time."""
        statement = built(self.builder, table, **options)
        key = (self, table, tuple(sorted(options.items())))
        if key not in _CHECKED:
            self._check(statement)
            _CHECKED.add(key)
        return statement

    def result(
        self, executor: Executor, table: Table | None, params: _Params, **options: Any
    ) -> CursorResult[Any]:
        """Run it in ``executor``'s transaction (the caller's: the layer never begins or
        ends one); the result as SQLAlchemy returns it (for a row count)."""
        statement = self.statement(table, **options)
        result = executor.execute(statement, params)
        if self.row is not None and (self, table, "text") not in _CHECKED:
            # Text: its columns are known once it runs.
            if isinstance(statement, TextClause):
                self._check_columns(tuple(result.keys()))
            _CHECKED.add((self, table, "text"))
        return cast("CursorResult[Any]", result)

    def rows(
        self, executor: Executor, table: Table | None, params: _Params, **options: Any
    ) -> list[_Row]:
        """Its rows, each as :attr:`row`."""
        make = cast(Any, self._row_type())._make
        return [make(row) for row in self.result(executor, table, params, **options)]

    def one(
        self, executor: Executor, table: Table | None, params: _Params, **options: Any
    ) -> _Row | None:
        """Its one row as :attr:`row`, or None when it returns none."""
        row = self.result(executor, table, params, **options).first()
        return None if row is None else cast(Any, self._row_type())._make(row)

    def tuples(
        self, executor: Executor, table: Table, params: _Params, **options: Any
    ) -> Sequence[tuple[Any, ...]]:
        """Its rows as plain tuples, in :attr:`row`'s order, through :func:`fetch` (the
        driver's fast path where it can): for the hot path, which builds no named tuple per
        row and reads them by the positions :mod:`~sqla_jobs._queries.rows` derives."""
        self.statement(table, **options)
        return fetch(executor, self.builder, table, params, **options)

    def _row_type(self) -> type[_Row]:
        if self.row is None:
            raise QueryDefinitionError(f"{self.builder.__qualname__} returns no rows")
        return self.row

    def _check(self, statement: Executable) -> None:
        name = self.builder.__qualname__
        compiled = cast(SQLCompiler, cast(ClauseElement, statement).compile(dialect=_DIALECT))
        binds = {bind.key for bind in compiled.binds.values() if bind.required}
        required = set(getattr(self.params, "__required_keys__", ()))
        known = required | set(getattr(self.params, "__optional_keys__", ()))
        if not required <= binds <= known:
            raise QueryDefinitionError(
                f"{name} takes {sorted(binds)}, its record {self.params.__name__} "
                f"{sorted(known)} ({sorted(required)} required)"
            )
        columns = getattr(statement, "exported_columns", None)
        if self.row is not None and columns is not None:
            # An unnamed expression (a function's value) has no name of its own: only its
            # place is checked.
            self._check_columns(tuple(column.key for column in columns))

    def _check_columns(self, returned: tuple[str | None, ...]) -> None:
        row = self._row_type()
        fields, defaults = row._fields, row._field_defaults  # type: ignore[attr-defined]
        named = tuple(
            field if name is None else name
            for name, field in zip(returned, fields[: len(returned)], strict=False)
        )
        if (
            len(returned) > len(fields)
            or named != fields[: len(returned)]
            or not set(fields[len(returned) :]) <= set(defaults)
        ):
            raise QueryDefinitionError(
                f"{self.builder.__qualname__} returns {list(returned)}, its row "
                f"{row.__name__} {list(fields)}"
            )


#: What :class:`Query` has checked: (query, table, options), and (query, table, "text").
_CHECKED: Final[set[tuple[Any, ...]]] = set()
_DIALECT: Final[Dialect] = postgresql.dialect()  # type: ignore[no-untyped-call]


@functools.lru_cache(maxsize=256)
def driver_sql(
    builder: Callable[..., Executable], table: Table, dialect: Dialect, **options: Any
) -> str | None:
    """The SQL text of a built statement as the psycopg driver takes it, or None when it
    cannot run as plain text (a parameter SQLAlchemy would expand or render at run time)."""
    statement = cast(ClauseElement, built(builder, table, **options))
    compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
    if compiled.post_compile_params or compiled.literal_execute_params:
        return None
    return str(compiled)


def fetch(
    session: Executor,
    builder: Callable[..., Executable],
    table: Table,
    params: Mapping[str, Any],
    **options: Any,
) -> Sequence[Any]:
    """Run one of the hot-path statements (claim, complete) and return its rows, as tuples.

    On a Core ``Connection`` of the psycopg driver, inside a transaction SQLAlchemy knows
    of, the statement's compiled text runs straight on the driver connection: the
    same SQL in the same transaction, without SQLAlchemy's per-execution work (the context,
    the result wrapper, the row processors, the cursor events), which cost a busy worker
    more CPU than the statement itself. Every parameter here is a plain ``str``, ``int``,
    ``float`` or list of ``str``, which psycopg adapts as SQLAlchemy would. Anything else
    (an ORM ``Session``, another driver, ``paramstyle`` changed, a
    ``schema_translate_map``, no transaction begun) goes through ``execute``, and so does
    every statement on an engine with ``before_cursor_execute`` or ``after_cursor_execute``
    listeners (OpenTelemetry's SQLAlchemy instrumentation, a statement logger, ...): they
    see the SQL the hot path sends, at the price of the fast path.
    """
    if (
        type(session) is Connection
        and not session.dispatch.before_cursor_execute
        and not session.dispatch.after_cursor_execute
        and session.in_transaction()
        and session.dialect.driver == "psycopg"
        and session.dialect.paramstyle == "pyformat"
        and not session.get_execution_options().get("schema_translate_map")
    ):
        driver = session.connection.driver_connection
        sql = driver_sql(builder, table, session.dialect, **options)
        if sql is not None and isinstance(driver, psycopg.Connection):
            # Prepared as psycopg decides (after ``prepare_threshold`` runs; never when it
            # is None, as behind PgBouncer in transaction mode); rows as tuples whatever
            # row factory the connection was given.
            try:
                with driver.cursor(row_factory=tuple_row) as cursor:
                    if _stock_jsonb(driver):
                        cursor.adapters.register_loader(_JSONB_OID, _JsonbLoader)
                    return cursor.execute(sql, params).fetchall()
            except psycopg.Error as exc:
                raise _wrapped(session, exc, sql, params) from exc
    statement = built(builder, table, **options)
    connection = (
        session
        if isinstance(session, Connection)
        else session.connection(bind_arguments={"clause": statement})
    )
    if connection.dialect.driver == "asyncpg" and builder in _JSON_TEXT_ON_ASYNCPG:
        # asyncpg decodes jsonb with SQLAlchemy's json.loads codec, which a value Python's
        # json cannot decode would make fail the whole claim: read those columns as text.
        claimed = built(builder, table, json_text=True, **options)
        return [_json_decoded(row) for row in connection.execute(claimed, params)]
    with readable_jsonb(connection):
        return connection.execute(statement, params).all()


#: The statements that return claimed jobs, which take ``json_text`` (:func:`json_text_on_asyncpg`).
_JSON_TEXT_ON_ASYNCPG: Final[set[Callable[..., Executable]]] = set()

_Builder = TypeVar("_Builder", bound=Callable[..., Executable])


def json_text_on_asyncpg(builder: _Builder) -> _Builder:
    """Mark a builder of claimed jobs' rows, which takes ``json_text=True`` to return their
    ``args`` (index 4) and ``trace_context`` (index 10) as text: :func:`fetch` builds it so on
    asyncpg and decodes those columns tolerantly (a value Python's json cannot decode becomes
    an :class:`UnreadableJson` instead of failing the claim)."""
    _JSON_TEXT_ON_ASYNCPG.add(builder)
    return builder


def _json_decoded(row: Sequence[Any]) -> tuple[Any, ...]:
    # A claimed row whose args (4) and trace_context (10) came back as text (json_text).
    fields = list(row)
    for index in (4, 10):
        if fields[index] is not None:
            fields[index] = _loads(fields[index])
    return tuple(fields)


@contextlib.contextmanager
def readable_jsonb(connection: Connection) -> Iterator[None]:
    """Inside the block, jsonb values that Python's json cannot decode are read as an
    :class:`UnreadableJson` instead of failing the statement: on a psycopg connection that
    reads jsonb with psycopg's own loader (one given ``set_json_loads`` keeps its own). For
    the statements that read rows other programs may have written: a claim, a dashboard's
    job page."""
    driver = connection.connection.driver_connection
    if not isinstance(driver, (psycopg.Connection, psycopg.AsyncConnection)) or not _stock_jsonb(
        driver
    ):
        yield
        return
    adapters = driver.adapters
    adapters.register_loader(_JSONB_OID, _JsonbLoader)
    try:
        yield
    finally:
        adapters.register_loader(_JSONB_OID, JsonbLoader)


@contextlib.contextmanager
def readable_values(connection: Connection) -> Iterator[None]:
    """:func:`readable_jsonb`, and a timestamptz Python's datetime cannot hold (``'infinity'``,
    ``'-infinity'``, a year before 1 or after 9999) read as its text (a ``str``) instead of
    failing the statement. For the pages that show whole rows other programs may have written
    (the dashboard's); not for the hot path, where the statements hand back only times they
    made readable (:func:`sqla_jobs._queries._sql._readable_time`)."""
    driver = connection.connection.driver_connection
    if not isinstance(driver, (psycopg.Connection, psycopg.AsyncConnection)):
        yield
        return
    adapters = driver.adapters
    stock = adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT)
    if stock is None:
        yield
        return
    tolerant = type("ReadableTimestamptz", (_ReadableTime,), {"stock": stock})
    adapters.register_loader(_TIMESTAMPTZ_OID, tolerant)
    try:
        with readable_jsonb(connection):
            yield
    finally:
        adapters.register_loader(_TIMESTAMPTZ_OID, stock)


_TIMESTAMPTZ_OID: Final = psycopg.postgres.types["timestamptz"].oid


class _ReadableTime(Loader):
    """The connection's own timestamptz loader (``stock``), or the value's text where it
    cannot make a datetime of it (:func:`readable_values`)."""

    stock: type[Loader]

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        self._load = self.stock(oid, context).load

    def load(self, data: Buffer) -> Any:
        try:
            return self._load(data)
        except psycopg.DataError:
            return bytes(data).decode()


class UnreadableJson:
    """A jsonb value that Python's json cannot decode, where the hot path's statements read
    one (a claimed job's ``args`` or ``trace_context``): nested deeper than the recursion
    limit lets it go, or a number with more digits than ``int()`` converts. Jobs enqueued
    through sqla_jobs never hold one (:func:`sqla_jobs.validation.check_json` refuses them);
    a row written by another program (psql, a trigger, another service) may.

    The rule it carries: **no row can fail a claim**. The loader gives this value instead of
    raising, the claim returns the job like any other, and the worker ends that job alone,
    dead with the reason (:meth:`sqla_jobs.worker.runner.Runner.admit`), while the other jobs
    of the claim run. Raising would fail the whole claim, every time: its queue would stop.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<UnreadableJson: {self.reason}>"


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        return UnreadableJson(
            f"nested deeper than Python's json can decode ({len(text)} characters of JSON)"
        )
    except ValueError as exc:  # a number too long for int() (sys.set_int_max_str_digits)
        return UnreadableJson(f"Python's json cannot decode it: {exc}")


_JSONB_OID: Final = psycopg.postgres.types["jsonb"].oid
# json's C scanner (typeshed types make_scanner's argument wrongly).
_SCAN: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


class _JsonbLoader(Loader):
    """psycopg's own jsonb loader (``json.loads`` of the text) in fewer Python calls, for
    the hot path's statements: a claim decodes every job's ``args``, and the stock loader
    costs more CPU than the rest of the row. A value json cannot decode becomes an
    :class:`UnreadableJson` instead of an error. The text goes straight to json's C scanner;
    anything it does not take whole (surrounding whitespace, which jsonb output never
    has, or an error) goes to ``json.loads``, which gives the same value or the same error.
    :func:`fetch` uses it only where the stock loader is in place: a connection given a
    ``loads`` of its own (``psycopg.types.json.set_json_loads``) keeps it."""

    def load(self, data: Buffer) -> Any:
        text = bytes(data).decode()
        try:
            value, end = _SCAN(text, 0)
        except (StopIteration, RecursionError, ValueError):
            return _loads(text)  # the value, or an UnreadableJson saying why
        return value if end == len(text) else _loads(text)


def _stock_jsonb(driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether ``driver`` reads jsonb with psycopg's own loader and ``json.loads``: neither
    ``set_json_loads`` for it (a loader class of its own) nor for every connection (the
    stock class's ``_loads`` replaced)."""
    loader = driver.adapters.get_loader(_JSONB_OID, Format.TEXT)
    return loader is JsonbLoader and JsonbLoader._loads is json.loads


def _wrapped(
    connection: Connection, exc: psycopg.Error, sql: str, params: Mapping[str, Any]
) -> BaseException:
    """A driver error as ``execute`` would have raised it: the matching
    ``sqlalchemy.exc.DBAPIError`` subclass, with the connection invalidated when the error
    means it is gone (so the pool does not hand it out again)."""
    dialect = connection.dialect
    gone = dialect.is_disconnect(cast(Any, exc), connection.connection.dbapi_connection, None)
    if gone:
        connection.invalidate(exc)
    return DBAPIError.instance(
        sql, params, exc, psycopg.Error, connection_invalidated=gone, dialect=dialect
    )


def _mapped_table(model: object, mixin: type) -> Table:
    if not (isinstance(model, type) and issubclass(model, mixin)):
        raise ConfigurationError(f"{model!r} is not a mapped class that mixes in {mixin.__name__}")
    if inspect(model, raiseerr=False) is None:
        raise ConfigurationError(f"{model.__name__} mixes in {mixin.__name__} but is not mapped")
    return cast(Table, model.__table__)  # type: ignore[attr-defined]


def job_table_of(model: object) -> Table:
    return _mapped_table(model, JobMixin)


def result_table_of(model: object) -> Table:
    return _mapped_table(model, JobResultMixin)
