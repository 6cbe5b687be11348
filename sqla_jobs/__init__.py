"""sqla_jobs: a PostgreSQL job queue that lives in your own SQLAlchemy models.

Importing this package defines the mixins and functions below and nothing else: it starts
no thread, opens no connection, and does not import Alembic or the command line.
"""

from sqla_jobs.errors import (
    ConfigurationError,
    EmbeddedPostgresError,
    InvalidJobError,
    JobArgumentsError,
    JobNotFoundError,
    JobStateError,
    LeaseLostError,
    SqlaJobsError,
)
from sqla_jobs.policy import RetryPolicy
from sqla_jobs.queue import (
    ClaimedJob,
    DeadJob,
    FailOutcome,
    QueueStat,
    cancel,
    claim,
    complete,
    complete_many,
    dead_jobs,
    enqueue_many,
    fail,
    heartbeat,
    lock,
    prune,
    queue_stats,
    release,
    retry,
    vacuum,
)
from sqla_jobs.registry import JobContext, Registry, Task
from sqla_jobs.schema import JobMixin, JobResultMixin, JobStatus, names
from sqla_jobs.worker import Worker, WorkerHealth

__all__ = [
    "ClaimedJob",
    "ConfigurationError",
    "DeadJob",
    "EmbeddedPostgresError",
    "FailOutcome",
    "InvalidJobError",
    "JobArgumentsError",
    "JobContext",
    "JobMixin",
    "JobNotFoundError",
    "JobResultMixin",
    "JobStateError",
    "JobStatus",
    "LeaseLostError",
    "QueueStat",
    "Registry",
    "RetryPolicy",
    "SqlaJobsError",
    "Task",
    "Worker",
    "WorkerHealth",
    "cancel",
    "claim",
    "complete",
    "complete_many",
    "dead_jobs",
    "enqueue_many",
    "fail",
    "heartbeat",
    "lock",
    "names",
    "prune",
    "queue_stats",
    "release",
    "retry",
    "vacuum",
]

__version__ = "0.1.0"
