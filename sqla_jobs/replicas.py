"""Read replicas: how far a streaming standby is behind its primary.

The readers of sqla_jobs may read from a read replica (a hot standby that streams the
primary's WAL) instead of the primary: ``sqla-jobs status --replica-url`` and the dashboard
(``sqla-jobs dashboard --replica-url``, or ``create_app(..., replica=engine)``), whose
writes (retry, cancel, delete, pause) still go to the primary. What a replica shows is as
old as its replay: :func:`read_replica_lag` says how old, in the reader's own transaction
on the replica, by the database's clock, so that the figures and their lag are read
together. Given a server that is not in recovery, it says so (:attr:`ReplicaLag.in_recovery`
false): that URL names a primary, and there is no lag to show.

::

    with Session(replica_engine) as session:
        lag = read_replica_lag(session)
    print(lag)  # "caught up (replayed all it received, up to 0/3020B60)"

Public through :mod:`sqla_jobs.health` (``from sqla_jobs.health import read_replica_lag``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Final

from sqla_jobs._queries.admin import REPLICA_LAG
from sqla_jobs._queries.run import Executor

__all__ = ["ReplicaLag", "read_replica_lag"]

#: :attr:`ReplicaLag.state`'s values.
PRIMARY: Final = "primary"
NOT_STREAMING: Final = "not streaming"
PAUSED: Final = "paused"
CAUGHT_UP: Final = "caught up"
BEHIND: Final = "behind"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


@dataclass(frozen=True, slots=True)
class ReplicaLag:
    """A server's replication state, as :func:`read_replica_lag` read it at ``taken_at``
    (the server's clock).

    ``in_recovery``: the server is a standby (``pg_is_in_recovery()``); false for a
    primary, whose other fields are None (``streaming`` false). On a standby:
    ``streaming``, its WAL receiver streams from the primary now (false: it has none, so
    the primary is unreachable or the WAL comes from an archive; None: the role may not see
    it, grant it ``pg_read_all_stats``); ``receive_lsn`` and ``replay_lsn``, the WAL
    received and replayed; ``unreplayed_bytes``, received but not yet replayed;
    ``primary_bytes_ahead``, how far the primary's WAL, as it last reported it to the
    standby, is ahead of the replay (None when not known); ``replay_age_seconds``, the time
    since the last replayed transaction committed on the primary (None before the first);
    ``replay_paused``, ``pg_wal_replay_pause()`` paused it.

    A standby whose primary commits nothing has nothing to replay, and the age of its last
    replayed commit grows all the same: :attr:`caught_up` tells that case apart, and
    :attr:`lag_seconds` is then 0.
    """

    in_recovery: bool
    streaming: bool | None
    receive_lsn: str | None
    replay_lsn: str | None
    unreplayed_bytes: int | None
    primary_bytes_ahead: int | None
    replay_age_seconds: float | None
    replay_paused: bool | None
    taken_at: datetime

    @property
    def caught_up(self) -> bool:
        """A standby that has replayed all the WAL it received and all the primary last
        reported (as far as it can see), while streaming and not paused."""
        return (
            self.in_recovery
            and self.streaming is not False
            and not self.replay_paused
            and self.unreplayed_bytes == 0
            and not self.primary_bytes_ahead
        )

    @property
    def lag_seconds(self) -> float | None:
        """How far behind the primary the standby's data is, in seconds: 0 when
        :attr:`caught_up`, else the age of the last replayed commit (an upper bound: the
        primary may have committed nothing for a while before the WAL not yet replayed).
        None for a primary, and before the first replayed transaction."""
        if not self.in_recovery:
            return None
        return 0.0 if self.caught_up else self.replay_age_seconds

    @property
    def state(self) -> str:
        """``"primary"`` (not a standby), ``"not streaming"``, ``"paused"``, ``"caught up"``
        or ``"behind"``: for a badge's colour or an alert."""
        if not self.in_recovery:
            return PRIMARY
        if self.streaming is False:
            return NOT_STREAMING
        if self.replay_paused:
            return PAUSED
        return CAUGHT_UP if self.caught_up else BEHIND

    def __str__(self) -> str:
        """One line for a person: ``caught up (...)``, ``2.3s behind (...)``, ``not a
        replica: ...``."""
        if not self.in_recovery:
            return (
                "not a replica: the server is not in recovery (pg_is_in_recovery() is "
                "false), it is a primary"
            )
        if self.caught_up:
            return f"caught up (replayed all it received, up to {self.replay_lsn})"
        details = []
        if self.unreplayed_bytes:
            details.append(f"{self.unreplayed_bytes:,} bytes received, not yet replayed")
        if self.primary_bytes_ahead:
            details.append(f"{self.primary_bytes_ahead:,} bytes behind the primary")
        said = f" ({'; '.join(details)})" if details else ""
        age = self.replay_age_seconds
        if self.streaming is False:
            last = "" if age is None else f"; its last replayed commit is {_age(age)} old"
            return f"not streaming from the primary (no WAL receiver){last}{said}"
        behind = "behind" if age is None else f"{_age(age)} behind"
        return f"{'replay paused, ' if self.replay_paused else ''}{behind}{said}"


def read_replica_lag(session: Executor) -> ReplicaLag:
    """How far the server ``session`` (a :class:`~sqlalchemy.orm.Session` or a
    :class:`~sqlalchemy.engine.Connection`) is connected to is behind its primary, in the
    caller's transaction: one statement (:func:`sqla_jobs._queries.replica_lag`), which
    reads the server's recovery state and ``pg_stat_wal_receiver``, no table, and takes no
    lock. Run it in the transaction that reads the figures it qualifies. On a primary it
    returns ``in_recovery=False`` (no error): the caller says so. Seeing the WAL receiver
    (``streaming``, ``primary_bytes_ahead``) needs ``pg_read_all_stats`` (or a superuser).
    """
    row = REPLICA_LAG.one(session, None, {})
    assert row is not None  # one row, always
    age = row.replay_age_seconds
    return ReplicaLag(
        in_recovery=row.in_recovery,
        streaming=row.streaming,
        receive_lsn=row.receive_lsn,
        replay_lsn=row.replay_lsn,
        unreplayed_bytes=row.unreplayed_bytes,
        primary_bytes_ahead=row.primary_bytes_ahead,
        replay_age_seconds=None if age is None else float(age),
        replay_paused=row.replay_paused,
        taken_at=row.taken_at,
    )
