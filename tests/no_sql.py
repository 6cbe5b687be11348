"""A block that must not reach the database: bad input is refused before any SQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event


@contextmanager
def no_sql(engine: sa.Engine) -> Iterator[None]:
    """Fail if any SQL statement reaches the server inside the block."""
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert statements == []
