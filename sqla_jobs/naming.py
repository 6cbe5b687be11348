"""The names of every schema object that belongs to a job or result table, derived from the
table's name: a leaf that the mixins (:mod:`sqla_jobs.schema`), the DDL
(:mod:`sqla_jobs.ddl`) and the migration helpers all build on, so that a model and its
migration always agree. Public as :func:`sqla_jobs.names` (and ``sqla_jobs.schema.names``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["TableNames", "identifier", "names"]

# PostgreSQL truncates identifiers past 63 bytes; long table names get a hashed suffix instead
# so two long names never collide after truncation.
_MAX_IDENTIFIER = 63


@dataclass(frozen=True)
class TableNames:
    """The names of every schema object that belongs to one job or result table.

    ``pending_index`` and ``running_index`` are the claim's indexes (schema version 2);
    ``claim_index`` names the single claim index of schema version 1, which the version-2
    upgrade drops; ``dead_index`` indexes the dead jobs (schema version 3), so that health
    checks count them without reading the history. ``keyed_pending_index`` and
    ``key_index`` are the keyed claim's indexes (schema version 3, ordering keys).
    """

    table: str
    pending_index: str
    running_index: str
    dead_index: str
    unique_index: str
    keyed_pending_index: str
    key_index: str
    claim_index: str
    status_check: str
    priority_check: str
    attempts_check: str
    notify_function: str
    notify_trigger: str
    channel: str


def identifier(table: str, suffix: str) -> str:
    """``<table>_<suffix>``, or, past PostgreSQL's 63 bytes, the table's name cut short with a
    hash of the whole name before the suffix (two long names never collide)."""
    name = f"{table}_{suffix}"
    if len(name.encode()) <= _MAX_IDENTIFIER:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    keep = _MAX_IDENTIFIER - len(suffix) - len(digest) - 2
    return f"{table.encode()[:keep].decode(errors='ignore')}_{digest}_{suffix}"


def names(table: str) -> TableNames:
    """Derive every index, constraint, trigger and channel name from a table name.

    The one naming function that the mixins and the migration helpers share.
    """
    return TableNames(
        table=table,
        pending_index=identifier(table, "pending_idx"),
        running_index=identifier(table, "running_idx"),
        dead_index=identifier(table, "dead_idx"),
        unique_index=identifier(table, "unique_idx"),
        keyed_pending_index=identifier(table, "keyed_pending_idx"),
        key_index=identifier(table, "key_idx"),
        claim_index=identifier(table, "claim_idx"),
        status_check=identifier(table, "status_ck"),
        priority_check=identifier(table, "priority_ck"),
        attempts_check=identifier(table, "attempts_ck"),
        notify_function=identifier(table, "notify_fn"),
        notify_trigger=identifier(table, "notify_tg"),
        channel=identifier(table, "jobs"),
    )
