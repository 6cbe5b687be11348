"""Eight processes contend for ten seats under random SIGKILLs, pauses and expiries: no seat is
ever held by two holders at once, and none is lost (tests/lease_proof.py explains the log and
why it is sound).

The suite runs a 15-second form (longer on a busy machine: lease_proof.run goes on, up to
twelve times the duration, until it has seen enough of every kind of event). The full form,
a minute, by hand::

    SQLA_JOBS_LEASE_PROOF_SECONDS=60 python3 -m nox -s tests -- tests/test_lease_proof.py -s

(``SQLA_JOBS_LEASE_PROOF_SEED`` repeats a run's random choices; ``-s`` prints the report.)
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict

import lease_proof
import pytest
from conftest import FreshDatabase

SECONDS = float(os.environ.get("SQLA_JOBS_LEASE_PROOF_SECONDS", "15"))


@pytest.mark.slow
def test_no_seat_is_held_by_two_holders_at_once_and_none_is_lost(
    fresh_database: FreshDatabase,
) -> None:
    seed = int(os.environ.get("SQLA_JOBS_LEASE_PROOF_SEED", random.randrange(2**32)))
    url = fresh_database("sqla_jobs_lease_proof")
    lease_proof.setup(url)

    run = lease_proof.run(url, SECONDS, seed)
    lease_proof.wait_for_expiry(url)
    report = lease_proof.check(url)

    print(f"seed {seed}: {asdict(run)}\n{asdict(report)}")
    assert run.failures == []
    assert report.problems == []
    # The run did what it is meant to: holders were killed, leases were renewed, released
    # and taken over after expiries, zombies were refused by the fence, lock-held grants
    # happened (lease_proof.run goes on past its duration until it has seen that).
    assert run.kills >= lease_proof.MINIMUMS["kills"]
    assert report.grants >= lease_proof.MINIMUMS["grant"]
    assert report.renewals > 0
    assert report.releases > 0
    assert report.takeovers > 0
    assert report.lost > 0
    assert report.hold_grants > 0
