"""Committing an enqueue, with a clear answer when its outcome cannot be known.

A transaction's COMMIT can be in flight when the connection breaks: the primary crashed, a
failover moved the database, the network dropped. The server may have committed the
transaction or not, and the client cannot tell which. A producer that retries blindly may
enqueue twice; one that gives up may lose an order that did commit. :func:`commit` turns that
case, and only that case, into :class:`~sqla_jobs.CommitUnknownError`, so that it is handled
on purpose: retry the whole transaction with a unique key (``sqla_jobs.enqueue_unique(...,
key=...)``) and an idempotent write of the business rows, which makes the retry a no-op when
the first commit landed (docs: operations/failover).

Every other failure is raised unchanged, and means the transaction did not commit: an error
of a flush (the rows are checked before the COMMIT is sent), a connection lost before the
COMMIT (while flushing), an error the server returned for the COMMIT itself (a deferred
constraint, a serialization failure).
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sqla_jobs.errors import CommitUnknownError, ConfigurationError

__all__ = ["commit"]


def commit(session: Session) -> None:
    """Commit ``session``'s transaction (the business rows and the jobs added to it); raise
    :class:`~sqla_jobs.CommitUnknownError` when the connection was lost while the COMMIT was
    in flight, so that the transaction may or may not have committed.

    The session is flushed first, so that an error in the rows (a constraint, a bad value)
    comes from the flush and is raised as it is: that transaction certainly did not commit.
    Before it raises :class:`~sqla_jobs.CommitUnknownError`, it rolls the session back (which
    sends nothing: the connection is gone), so that the session can be used again; the
    error's ``__cause__`` is SQLAlchemy's :class:`~sqlalchemy.exc.DBAPIError`. A retry is
    safe when the transaction is idempotent::

        for _ in range(5):
            try:
                with Session(engine) as session:
                    session.execute(insert(Order).values(id=order_id).on_conflict_do_nothing())
                    sqla_jobs.enqueue_unique(
                        session, ship.job({"order": order_id}), key=f"ship:{order_id}",
                        statuses=list(JobStatus),
                    )
                    sqla_jobs.commit(session)
            except (sqla_jobs.CommitUnknownError, OperationalError):
                time.sleep(1)  # a failover, perhaps; the key makes the retry a no-op
            else:
                break

    docs: operations/failover.md.
    """
    if not isinstance(session, Session):
        raise ConfigurationError(
            f"commit() takes a sqlalchemy.orm.Session, not {type(session).__name__} "
            "(for an AsyncSession: sqla_jobs.aio.commit)"
        )
    session.flush()
    try:
        session.commit()
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        session.rollback()  # sends nothing: the connection is gone
        raise CommitUnknownError(
            "the connection was lost while COMMIT was in flight: the transaction may or may "
            f"not have committed ({type(exc.orig).__name__}: {str(exc.orig).strip()}). Retry "
            "it only if it is idempotent: enqueue with a unique key "
            "(sqla_jobs.enqueue_unique(..., key=...)) and write the business rows so that a "
            "second write changes nothing"
        ) from exc
