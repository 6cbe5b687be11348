"""sqla_jobs: a PostgreSQL job queue that lives in your own SQLAlchemy models.

Importing this package defines the mixins and functions below and nothing else: it starts
no thread, opens no connection, and does not import Alembic or the command line.
"""

from sqla_jobs.errors import (
    ConfigurationError,
    EmbeddedPostgresError,
    InvalidJobError,
    InvalidLeaseError,
    JobArgumentsError,
    JobCancelledError,
    JobNotFoundError,
    JobStateError,
    LeaseLostError,
    SqlaJobsError,
)
from sqla_jobs.leasing import (
    Lease,
    LeaseMixin,
    acquire_leases,
    lease_names,
    release_lease,
    release_leases,
    renew_lease,
    renew_leases,
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
    "InvalidLeaseError",
    "JobArgumentsError",
    "JobCancelledError",
    "JobContext",
    "JobMixin",
    "JobNotFoundError",
    "JobResultMixin",
    "JobStateError",
    "JobStatus",
    "Lease",
    "LeaseLostError",
    "LeaseMixin",
    "QueueStat",
    "Registry",
    "RetryPolicy",
    "SqlaJobsError",
    "Task",
    "Worker",
    "WorkerHealth",
    "acquire_leases",
    "cancel",
    "claim",
    "complete",
    "complete_many",
    "dead_jobs",
    "enqueue_many",
    "fail",
    "heartbeat",
    "lease_names",
    "lock",
    "names",
    "prune",
    "queue_stats",
    "release",
    "release_lease",
    "release_leases",
    "renew_lease",
    "renew_leases",
    "retry",
    "vacuum",
]

__version__ = "0.1.0"
