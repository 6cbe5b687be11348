"""The registry of the rate-limit proof's worker processes (tests/test_rate_limits.py)."""

from __future__ import annotations

from models import EmailJob

from sqla_jobs import JobContext, RateLimit, Registry

#: The proof's limit: starts per second in the queue "rated".
LIMIT = 50

registry = Registry(EmailJob, rate_limits={"rated": RateLimit(LIMIT)})


@registry.task(queue="rated")
def tick(ctx: JobContext) -> None:
    """A no-op: the rate of starts is the claims', not the handlers'."""
