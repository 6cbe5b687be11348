"""Integrations with other services, each an optional extra:
:mod:`sqla_jobs.integrations.sentry`."""
