"""Database URLs: the psycopg 3 form SQLAlchemy takes, and the libpq form psycopg takes."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from sqla_jobs.urls import asyncpg_url, libpq_url, psycopg_url


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://app:s3cret@db:5433/app", "postgresql+psycopg://app:s3cret@db:5433/app"),
        ("postgres://app@db/app", "postgresql+psycopg://app@db/app"),
        ("postgresql+psycopg://app@db/app", "postgresql+psycopg://app@db/app"),
        ("postgresql+psycopg2://app@db/app", "postgresql+psycopg2://app@db/app"),
        ("mysql://app@db/app", "mysql://app@db/app"),
    ],
)
def test_psycopg_url_names_the_driver_of_a_plain_url(given: str, expected: str) -> None:
    assert psycopg_url(given).render_as_string(hide_password=False) == expected
    assert psycopg_url(make_url(given)) == psycopg_url(given)


def test_libpq_url_is_the_reverse() -> None:
    url = "postgresql+psycopg://app:s3cret@db:5433/app?sslmode=require"
    assert libpq_url(url) == "postgresql://app:s3cret@db:5433/app?sslmode=require"
    assert libpq_url(make_url(url)) == libpq_url(url)
    assert psycopg_url(libpq_url(url)) == make_url(url)


def test_asyncpg_url_names_the_asyncpg_driver() -> None:
    for given in (
        "postgresql://app:s3cret@db:5433/app",
        "postgresql+psycopg://app:s3cret@db:5433/app",
    ):
        url = asyncpg_url(given)
        assert url.render_as_string(hide_password=False) == (
            "postgresql+asyncpg://app:s3cret@db:5433/app"
        )


def test_text_that_is_not_a_url() -> None:
    with pytest.raises(ArgumentError):
        psycopg_url("not a url")
