"""The first step of every lock-held operation, in one place.

A lock-held operation (``claim(..., hold=True)``, ``acquire_leases(..., hold=True)``) commits
its first step on a connection of its own (the attempt counted, the lease granted), so that
it stands even if the caller's transaction rolls back or its process dies, and then locks
the rows in the caller's transaction, until that transaction ends. The rule that makes this
sound lives here: the caller's transaction must be READ COMMITTED, since only a statement
that starts after the first step committed is sure to see it (under REPEATABLE READ or
SERIALIZABLE a snapshot taken earlier would not, and the row would be left running, or
granted, without its lock).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from sqla_jobs._queries.admin import TRANSACTION_ISOLATION
from sqla_jobs.errors import ConfigurationError

__all__ = ["first_step_engine"]


def first_step_engine(
    session: Session | Connection, model: type[Any], *, call: str, step: str
) -> Engine:
    """The engine on which a lock-held operation commits its first step, after checking the
    rule above on the caller's transaction (one query); raises
    :class:`~sqla_jobs.errors.ConfigurationError` naming ``call`` (``"claim(hold=True)"``)
    and ``step`` (``"the attempt"``) otherwise, before anything is written."""
    row = TRANSACTION_ISOLATION.one(session, None, {})
    level = None if row is None else row.current_setting
    if level != "read committed":
        raise ConfigurationError(
            f"{call} needs a READ COMMITTED transaction, not {level!s}: {step} is committed "
            "on another connection, which an earlier snapshot would not see; begin the "
            "transaction with isolation_level='READ COMMITTED'"
        )
    if isinstance(session, Connection):
        return session.engine
    bind = session.get_bind(model)
    return bind.engine if isinstance(bind, Connection) else bind
