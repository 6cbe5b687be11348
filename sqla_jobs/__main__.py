"""``python -m sqla_jobs``: the ``sqla-jobs`` command."""

from sqla_jobs.cli import main

raise SystemExit(main())
