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


#: The per-key proof's limit: starts per second of each ordering key in the queue "keyed".
KEY_LIMIT = 5
#: How many keys the per-key proof spreads its jobs over.
KEYS = 100

keyed_registry = Registry(
    EmailJob, ordering_keys=True, rate_limits={"keyed": RateLimit(KEY_LIMIT, per_key=True)}
)


@keyed_registry.task(queue="keyed")
def keyed_tick(ctx: JobContext) -> None:
    """A no-op, in a queue limited per ordering key."""
