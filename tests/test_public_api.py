"""The public face, pinned: each public module and exactly the names it exports.

A name added to or dropped from a public module's ``__all__`` fails here until this list says
so too: the public face changes only on purpose, and the changelog says how. The public
modules are the ones the API reference documents (docs/reference/), and only those; the
rest of the package (the query layer ``sqla_jobs._queries``, the queue's and the worker's
internals) may change in any release.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"

PUBLIC: dict[str, list[str]] = {
    "sqla_jobs": [
        "ClaimSettings",
        "ClaimedJob",
        "ConfigurationError",
        "DeadJob",
        "EmbeddedPostgresError",
        "Enqueued",
        "FailOutcome",
        "FairShare",
        "Hooks",
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
        "JobTimeoutError",
        "Lease",
        "LeaseLostError",
        "LeaseMixin",
        "MaintenanceSettings",
        "ObservabilitySettings",
        "ProcessHandlerError",
        "QueuePause",
        "QueueStat",
        "RateLimit",
        "RateUsage",
        "Registry",
        "RetryPolicy",
        "Schedule",
        "ScheduleError",
        "ScheduleMixin",
        "SchemaVersionError",
        "SessionSettings",
        "Snooze",
        "SqlaJobsError",
        "Task",
        "TaskOptions",
        "TenantDepths",
        "TimingSettings",
        "UniqueJobError",
        "Worker",
        "WorkerHealth",
        "WorkerOptions",
        "acquire_leases",
        "cancel",
        "claim",
        "complete",
        "complete_many",
        "dead_jobs",
        "delete",
        "enqueue_debounced",
        "enqueue_many",
        "enqueue_unique",
        "enqueue_unique_many",
        "fail",
        "heartbeat",
        "lease_names",
        "lock",
        "names",
        "pause_queue",
        "paused_queues",
        "prune",
        "prune_rates",
        "queue_stats",
        "rate_usage",
        "release",
        "release_lease",
        "release_leases",
        "renew_lease",
        "renew_leases",
        "report_progress",
        "resume_queue",
        "retry",
        "snooze",
        "tenant_depths",
        "unique_key_of",
        "vacuum",
    ],
    "sqla_jobs.aio": [
        "acquire_leases",
        "cancel",
        "claim",
        "complete",
        "complete_many",
        "dead_jobs",
        "enqueue_debounced",
        "enqueue_many",
        "enqueue_unique",
        "enqueue_unique_many",
        "fail",
        "heartbeat",
        "lock",
        "pause_queue",
        "paused_queues",
        "prune",
        "prune_rates",
        "queue_stats",
        "rate_usage",
        "release",
        "release_lease",
        "release_leases",
        "renew_lease",
        "renew_leases",
        "report_progress",
        "resume_queue",
        "retry",
        "snooze",
        "tenant_depths",
    ],
    "sqla_jobs.dashboard": [
        "create_app",
    ],
    "sqla_jobs.embedded": [
        "DEFAULT_OS_USER",
        "EmbeddedPostgres",
    ],
    "sqla_jobs.errors": [
        "ConfigurationError",
        "EmbeddedPostgresError",
        "InvalidJobError",
        "InvalidLeaseError",
        "InvalidThresholdError",
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
    ],
    "sqla_jobs.events": [
        "MAX_MESSAGE_CHARS",
        "describe",
    ],
    "sqla_jobs.health": [
        "GaugeCache",
        "GaugeReading",
        "Gauges",
        "QueueGauges",
        "TableGauges",
        "Thresholds",
        "XminHolder",
        "read_gauges",
    ],
    "sqla_jobs.hooks": [
        "AfterHook",
        "BeforeHook",
        "ErrorHook",
        "Hooks",
    ],
    "sqla_jobs.integrations.sentry": [
        "sentry_hooks",
    ],
    "sqla_jobs.history": [
        "DEFAULT_DAYS_AHEAD",
        "DEFAULT_LOCK_TIMEOUT",
        "JobRecord",
        "MaintenanceReport",
        "Partition",
        "create_partitions",
        "drop_partitions",
        "has_history",
        "history_names",
        "history_table",
        "is_history_partition",
        "job_record",
        "list_partitions",
        "maintain",
        "move_finished",
    ],
    "sqla_jobs.leasing": [
        "Lease",
        "LeaseMixin",
        "LeaseNames",
        "MAX_ACQUIRE_LIMIT",
        "acquire_leases",
        "lease_names",
        "release_lease",
        "release_leases",
        "renew_lease",
        "renew_leases",
    ],
    "sqla_jobs.metrics": [
        "GaugeCollector",
        "LabelValues",
        "MetricsServer",
        "OTHER",
        "TOP_TENANTS",
        "WorkerMetrics",
    ],
    "sqla_jobs.migrations": [
        "LEASE_SCHEMA_VERSION",
        "SCHEMA_VERSION",
        "SCRIPT_LOCATION",
        "VERSION_LOCATION",
        "VERSION_TABLE",
        "add_cancel",
        "add_dead_index",
        "add_history",
        "add_job_control",
        "add_lease_columns",
        "add_ordering_keys",
        "add_trace_context",
        "add_unique_keys",
        "check_claim_indexes",
        "check_job_tables",
        "create_claim_index",
        "create_claim_indexes",
        "create_fair_index",
        "create_job_table",
        "create_lease_index",
        "create_notify_trigger",
        "create_pause_table",
        "create_rate_table",
        "create_result_table",
        "create_schedule_table",
        "downgrade",
        "downgrade_job_table_to_v1",
        "downgrade_job_table_to_v2",
        "downgrade_job_table_to_v3",
        "drop_cancel",
        "drop_claim_index",
        "drop_claim_indexes",
        "drop_dead_index",
        "drop_fair_index",
        "drop_history",
        "drop_job_control",
        "drop_job_table",
        "drop_lease_columns",
        "drop_lease_index",
        "drop_notify_trigger",
        "drop_ordering_keys",
        "drop_pause_table",
        "drop_rate_table",
        "drop_result_table",
        "drop_schedule_table",
        "drop_trace_context",
        "drop_unique_keys",
        "include_name",
        "upgrade",
        "upgrade_job_table_to_v2",
        "upgrade_job_table_to_v3",
        "upgrade_job_table_to_v4",
        "versions_path",
    ],
    "sqla_jobs.models": [
        "Base",
        "Job",
        "JobResult",
        "JobSchedule",
        "metadata",
    ],
    "sqla_jobs.periodic": [
        "Schedule",
        "enqueue_due",
        "slot_key",
    ],
    "sqla_jobs.testing": [
        "InlineRun",
        "assert_enqueued",
        "assert_not_enqueued",
        "enqueued",
        "run_inline",
    ],
    "sqla_jobs.tracing": [
        "AttemptSpan",
        "TracedJob",
        "attempt_span",
        "enqueue_context",
    ],
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_module_exports_exactly_its_pinned_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert sorted(exported) == PUBLIC[name]
    assert len(exported) == len(set(exported)), f"{name}.__all__ names something twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def test_the_reference_documents_exactly_the_public_modules() -> None:
    documented = {
        match.group(1)
        for page in REFERENCE.glob("*.md")
        for match in re.finditer(r"automodule::\s+(\S+)", page.read_text(encoding="utf-8"))
    }
    assert documented == set(PUBLIC)


@pytest.mark.parametrize(
    ("old", "home"),
    [
        ("sqla_jobs.statements", "sqla_jobs._queries"),
        ("sqla_jobs.history.statements", "sqla_jobs._queries.history"),
        ("sqla_jobs.leasing.statements", "sqla_jobs._queries.leases"),
        ("sqla_jobs.dashboard.statements", "sqla_jobs._queries.dashboard"),
    ],
)
def test_a_module_made_private_names_the_new_home(old: str, home: str) -> None:
    module = importlib.import_module(old)
    with pytest.raises(ImportError, match=f"{re.escape(old)} is private .* in {re.escape(home)},"):
        module.claim  # noqa: B018 (the attribute access is what fails)
