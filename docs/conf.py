"""Sphinx configuration of the sqla_jobs documentation: ``nox -s docs`` builds it with warnings
as errors (``sphinx-build -W --keep-going -n``): a broken link, reference or toctree entry
fails the build.

Pages are Markdown (MyST), like the README they came from, so that tests/test_docs.py runs
their code blocks the way tests/test_readme.py runs the README's. The API reference comes
from the docstrings (autodoc), which are reStructuredText with Sphinx roles already.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "sqla_jobs"
author = "The sqla_jobs developers"
copyright = "2026, The sqla_jobs developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    # Our own (docs/_ext/sqla_jobs_docs.py): the CLI reference generated from the command's
    # parser, the columns of each mixin, and the benchmark charts drawn from a bench run's JSON.
    "sqla_jobs_docs",
]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]

html_theme = "furo"
html_title = "sqla_jobs"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

# Nitpicky (-n): every cross-reference must resolve. References into SQLAlchemy, psycopg,
# Alembic, Starlette and the standard library cannot without intersphinx (which fetches
# inventories from the web at build time; the build must work offline), so they are
# ignored here by module, and only those.
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(sqlalchemy|psycopg|alembic|starlette|asyncpg|opentelemetry|prometheus_client)(\..*)?",
    ),
    (r"py:.*", r"(collections\.abc|typing|datetime|logging|threading|asyncio|enum|types)\..*"),
]
