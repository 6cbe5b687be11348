"""Processes contend for seats under random kills, pauses and expiries; the log proves that no
seat was ever held by two holders at once and that none was lost.

Run by tests/test_lease_proof.py. The setup:

* ``SEATS`` seats; ``PROCESSES`` holder processes (:func:`holder_main`), each looping:
  acquire 1-3 seats (a random filter and order) for 0.3-1.2 s, renew them every third of
  that for a while, then release them, or simply stop renewing (an expiry), or stall past
  the expiry and then renew or release them (a zombie, which the fence must refuse when
  the seat was taken meanwhile). About one cycle in three is lock-held (``hold=True``):
  the seat is held by the holder's transaction, often past its ``duration``, and released
  in it (or, one time in five, left to expire after the commit).
* The parent SIGKILLs a random holder every 0.5-1.5 s (at whatever point it is: inside a
  transaction, between transactions) and starts a new one under a new name, and now and
  then SIGSTOPs one for 0.5-2 s (a holder that stops renewing without knowing it).

**The log, and why it is sound.** Every change a holder makes is logged in ``lease_log``
*in the transaction that makes it*: a grant in the acquiring transaction, a renewal in the
renewing one, a release in the releasing one. The log therefore holds exactly the changes
that committed: a holder killed before its commit leaves neither the change nor its log
row. Each row carries the seat, the grant's fence and two database times:

* ``at``: ``clock_timestamp()`` when the row was logged, after the change in the same
  transaction. For a grant it is the start of the window the holder claims: it acts on the
  seat only after its transaction commits, which is later.
* ``expires_at``: the seat's ``lease_expires_at`` after the change. The window of a grant
  ends at its release (``lease_expires_at`` is then the release's time) or, unreleased, at
  the latest ``lease_expires_at`` its grant and renewals committed.

A lock-held grant that its transaction keeps unreleased to the end logs ``held`` just
before the commit, with that time as its ``expires_at``: the row lock held it until then,
perhaps past its expiry. A renewal or release the fence refused is logged too (``lost``),
for the count of zombies refused; for a lock-held grant it is a failure in itself, since
the holder's transaction held the row lock all along.

One exception: a lock-held grant is committed by the library on a connection of its own
before the holder's transaction logs it, so a holder killed in between leaves a grant
without a log row: a gap in the seat's fences. Such a holder did nothing that committed
(its whole transaction rolled back), so the gap is a grant nobody used. Each lock-held
acquire is announced first in ``hold_intents`` (committed on its own), takes one seat at
most, and the check bounds the gaps by the announced acquires that logged no grant.

**The checks** (:func:`check`): per seat, the logged grants ordered by fence start no
earlier than every earlier grant's window ended (no two holders at once); fences only
grow and every renewal and release belongs to a logged grant; the gaps are within the
bound above; at the end, after every holder is killed and every lease has run out, each
seat's row agrees with its log (held by its last logged holder, or free if that one
released it, or further on by an unlogged lock-held grant) and one acquire takes all the
seats (none lost).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
import traceback
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from lease_models import LeaseBase, Seat, Show
from sqlalchemy.orm import Session

from sqla_jobs import Lease, acquire_leases, release_leases, renew_leases

SEATS = 10
PROCESSES = 8
SHOW = 1
HOLD_SHARE = 0.3

LOG = sa.table(
    "lease_log",
    sa.column("seat_id"),
    sa.column("fence"),
    sa.column("holder"),
    sa.column("kind"),
    sa.column("mode"),
    sa.column("at"),
    sa.column("expires_at"),
)
SCHEMA = """
CREATE TABLE lease_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    seat_id integer NOT NULL,
    fence bigint NOT NULL,
    holder text NOT NULL,
    kind text NOT NULL CHECK (kind IN ('grant', 'renew', 'release', 'held', 'lost')),
    mode text NOT NULL CHECK (mode IN ('lease', 'hold')),
    at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE TABLE hold_intents (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    holder text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def setup(url: str) -> None:
    """The seats (all free) and the log tables, in an empty database."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        LeaseBase.metadata.create_all(engine, tables=[Show.__table__, Seat.__table__])  # type: ignore[list-item]
        with engine.begin() as connection:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    connection.execute(sa.text(statement))
            connection.execute(sa.insert(Show), [{"id": SHOW}])
            connection.execute(
                sa.insert(Seat),
                [{"id": n, "show_id": SHOW, "number": n} for n in range(1, SEATS + 1)],
            )
    finally:
        engine.dispose()


# -- a holder -------------------------------------------------------------------------------


def _log(session: Session, leases: Sequence[Lease], kind: str, mode: str) -> None:
    """Log ``leases`` in the caller's transaction, each with the seat's lease_expires_at as
    it is now (after the change this transaction made, whose row lock it still holds); a
    ``held`` row (a lock-held grant its transaction keeps to the end) with the time now."""
    if not leases:
        return
    seat_ids = [lease.key for lease in leases]
    fences = [lease.fence for lease in leases]
    holders = [lease.holder for lease in leases]
    session.execute(
        sa.text(
            "INSERT INTO lease_log (seat_id, fence, holder, kind, mode, at, expires_at) "
            "SELECT s.id, g.fence, g.holder, :kind, :mode, clock_timestamp(), "
            "CASE WHEN :kind = 'held' THEN clock_timestamp() ELSE s.lease_expires_at END "
            "FROM unnest(CAST(:ids AS integer[]), CAST(:fences AS bigint[]), "
            "CAST(:holders AS text[])) AS g(id, fence, holder) JOIN seats s ON s.id = g.id"
        ),
        {"ids": seat_ids, "fences": fences, "holders": holders, "kind": kind, "mode": mode},
    )


def _renew(engine: sa.Engine, leases: list[Lease], duration: float, mode: str) -> list[Lease]:
    """Renew in a transaction of its own, logging the renewed and the lost; return the kept."""
    with Session(engine) as session, session.begin():
        lost = renew_leases(session, leases, duration=duration)
        kept = [lease for lease in leases if lease not in lost]
        _log(session, kept, "renew", mode)
        _log(session, lost, "lost", mode)
    return kept


def _release(engine: sa.Engine, leases: list[Lease], mode: str) -> None:
    with Session(engine) as session, session.begin():
        lost = release_leases(session, leases)
        _log(session, [lease for lease in leases if lease not in lost], "release", mode)
        _log(session, lost, "lost", mode)


def _filter(rng: random.Random) -> dict[str, Any]:
    where: list[Any] = [
        Seat.show_id == SHOW,
        Seat.id.in_(rng.sample(range(1, SEATS + 1), 5)),
        Seat.id % 2 == rng.randrange(2),
    ]
    order: list[Any] = [None, Seat.number, Seat.number.desc()]
    return {"where": rng.choice(where), "order_by": rng.choice(order)}


def _lease_cycle(engine: sa.Engine, rng: random.Random, name: str) -> None:
    duration = rng.uniform(0.3, 1.2)
    with Session(engine) as session, session.begin():
        leases = acquire_leases(
            session, Seat, holder=name, duration=duration, limit=rng.randint(1, 3), **_filter(rng)
        )
        _log(session, leases, "grant", "lease")
    if not leases:
        time.sleep(rng.uniform(0.02, 0.1))
        return
    hold_for = time.monotonic() + rng.uniform(0.1, 1.5)
    while leases and time.monotonic() < hold_for:
        # Now and then a renewal comes too late (a slow holder): the lease may be taken.
        late = rng.random() < 0.05
        time.sleep(duration * (rng.uniform(1.1, 1.6) if late else rng.uniform(0.2, 0.4)))
        leases = _renew(engine, leases, duration, "lease")
    plan = rng.random()
    if plan < 0.5:
        _release(engine, leases, "lease")
    elif plan < 0.75:
        # A zombie: it stalls past the expiry, wakes up and carries on as if nothing
        # happened, renewing or releasing; where the seat was taken, the fence refuses it.
        # Up to three times its duration: on a busy machine the others take an expired seat
        # slowly, and a zombie that always woke just past its expiry was seldom refused.
        time.sleep(duration * rng.uniform(1.0, 3.0))
        if rng.random() < 0.5:
            leases = _renew(engine, leases, duration, "lease")
        _release(engine, leases, "lease")
    # else: it just stops renewing; the leases expire and the next acquires take them.


def _hold_cycle(engine: sa.Engine, rng: random.Random, name: str) -> None:
    duration = rng.uniform(0.3, 1.0)
    with engine.begin() as connection:  # announced, committed on its own (see the docstring)
        connection.execute(sa.text("INSERT INTO hold_intents (holder) VALUES (:h)"), {"h": name})
    with Session(engine) as session, session.begin():
        leases = acquire_leases(
            session, Seat, holder=name, duration=duration, limit=1, hold=True, **_filter(rng)
        )
        _log(session, leases, "grant", "hold")
        if not leases:
            return
        time.sleep(duration * rng.uniform(0.3, 2.5))  # often past the duration: the lock holds
        if rng.random() < 0.3:
            lost = renew_leases(session, leases, duration=duration)
            _log(session, [lease for lease in leases if lease not in lost], "renew", "hold")
            _log(session, lost, "lost", "hold")
        if rng.random() < 0.8:
            lost = release_leases(session, leases)
            _log(session, [lease for lease in leases if lease not in lost], "release", "hold")
            _log(session, lost, "lost", "hold")
        else:
            # Committed unreleased, it goes on as an ordinary lease until it expires; until
            # the commit, the row lock held it, perhaps past its expiry: say so.
            _log(session, leases, "held", "hold")


def holder_main(url: str, name: str, seed: int, ready: Any) -> None:
    """One holder process: lease cycles until it is killed. Sets ``ready`` (an Event) when
    its imports are done and it starts."""
    rng = random.Random(seed)
    # A small pool: a new server process per transaction would cost more CPU than the rest
    # of the run (a lock-held acquire takes a second connection for its grant).
    engine = sa.create_engine(url, pool_size=2, max_overflow=1)
    ready.set()
    try:
        while True:
            if rng.random() < HOLD_SHARE:
                _hold_cycle(engine, rng, name)
            else:
                _lease_cycle(engine, rng, name)
    except BaseException:
        traceback.print_exc()
        raise


# -- the run --------------------------------------------------------------------------------


@dataclass
class Run:
    seconds: float
    kills: int = 0
    pauses: int = 0
    failures: list[str] = field(default_factory=list)


#: What a run must have seen before it stops (past its duration, up to CAP times it): on
#: a machine busy with other work a fixed duration may not be enough to exercise it all
#: (seen: 3 and 24 grants in 45 s at a load average of 15-19 on 2 cores).
CAP = 12
MINIMUMS = {"grant": 30, "renew": 1, "release": 1, "lost": 1, "hold grant": 2, "kills": 5}


def _progress(engine: sa.Engine, kills: int) -> dict[str, int]:
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text(
                "SELECT kind, count(*) FROM lease_log GROUP BY kind UNION ALL "
                "SELECT 'hold grant', count(*) FROM lease_log "
                "WHERE kind = 'grant' AND mode = 'hold'"
            )
        )
        # Not dict(rows): a Result has keys(), so dict() would take it for a mapping.
        counts: dict[str, int] = {row[0]: row[1] for row in rows}
    return {key: int(counts.get(key, kills if key == "kills" else 0)) for key in MINIMUMS}


def run(url: str, seconds: float, seed: int) -> Run:
    """Holders contend under kills and pauses for ``seconds``, or longer (up to :data:`CAP`
    times that) until the run has seen :data:`MINIMUMS`; then every holder is killed."""
    rng = random.Random(seed)
    monitor = sa.create_engine(url, poolclass=sa.NullPool)
    # Holders fork from a server that imported everything once: a new holder starts in
    # milliseconds, not the second or two of a spawned interpreter's imports.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["lease_proof"])
    result = Run(seconds)
    spawned = 0

    ready: dict[int, Any] = {}

    def start() -> multiprocessing.process.BaseProcess:
        nonlocal spawned
        spawned += 1
        event = context.Event()
        process = context.Process(
            target=holder_main,
            args=(url, f"holder-{spawned}", rng.randrange(2**32), event),
            daemon=True,
        )
        process.start()
        ready[id(process)] = event
        return process

    def working(process: multiprocessing.process.BaseProcess) -> bool:
        # Only a holder that has started working is killed or paused: a kill during its
        # imports (a second or two on a busy machine) would test nothing.
        return bool(ready[id(process)].is_set())

    holders = [start() for _ in range(PROCESSES)]
    began = time.monotonic()
    deadline = began + seconds
    cap = began + CAP * seconds
    next_kill = time.monotonic() + rng.uniform(1.0, 2.0)  # let the first ones start
    next_pause = time.monotonic() + rng.uniform(2.0, 4.0)
    paused: tuple[multiprocessing.process.BaseProcess, float] | None = None
    try:
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            if now >= deadline:
                seen = _progress(monitor, result.kills)
                if now >= cap or all(seen[key] >= least for key, least in MINIMUMS.items()):
                    break
                deadline = now + 1.0
            for index, process in enumerate(holders):
                if process.exitcode is not None:  # only SIGKILL may end a holder
                    result.failures.append(f"{process.name} exited with {process.exitcode}")
                    holders[index] = start()
            if paused is not None and now >= paused[1]:
                os.kill(paused[0].pid or 0, signal.SIGCONT)
                paused = None
            candidates = [
                index
                for index, process in enumerate(holders)
                if working(process) and (paused is None or process is not paused[0])
            ]
            if paused is None and now >= next_pause and candidates:
                victim = holders[rng.choice(candidates)]
                os.kill(victim.pid or 0, signal.SIGSTOP)
                paused = (victim, now + rng.uniform(0.5, 2.0))
                result.pauses += 1
                next_pause = now + rng.uniform(2.0, 4.0)
            elif now >= next_kill and candidates:
                index = rng.choice(candidates)
                holders[index].kill()
                holders[index].join(10)
                result.kills += 1
                holders[index] = start()
                next_kill = now + rng.uniform(0.5, 1.5)
    finally:
        for process in holders:
            if process.pid is not None:
                os.kill(process.pid, signal.SIGKILL)
        for process in holders:
            process.join(10)
        monitor.dispose()
    result.seconds = time.monotonic() - began
    return result


# -- the check ------------------------------------------------------------------------------


@dataclass
class Grant:
    seat: int
    fence: int
    holder: str
    mode: str
    start: datetime
    expires: list[datetime]
    released_at: datetime | None = None

    @property
    def end(self) -> datetime:
        """When the holder's claim on the seat ends, in database time."""
        return self.released_at if self.released_at is not None else max(self.expires)


@dataclass
class Report:
    grants: int = 0
    renewals: int = 0
    releases: int = 0
    lost: int = 0
    takeovers: int = 0
    held_past_expiry: int = 0
    hold_grants: int = 0
    hold_intents: int = 0
    gaps: int = 0
    problems: list[str] = field(default_factory=list)


def wait_for_expiry(url: str, timeout: float = 30.0) -> None:
    """Wait until every lease has run out by the database's clock."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        limit = time.monotonic() + timeout
        while time.monotonic() < limit:
            with engine.connect() as connection:
                left = connection.execute(
                    sa.text(
                        "SELECT count(*) FROM seats WHERE lease_holder IS NOT NULL "
                        "AND lease_expires_at > clock_timestamp()"
                    )
                ).scalar_one()
            if left == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"leases still running {timeout} s after the holders died")
    finally:
        engine.dispose()


def check(url: str) -> Report:
    """Check the log against itself and the seats' rows; then acquire every seat."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    report = Report()
    problems = report.problems
    try:
        with engine.connect() as connection:
            log = connection.execute(
                sa.text(
                    "SELECT seat_id, fence, holder, kind, mode, at, expires_at FROM lease_log "
                    "ORDER BY id"
                )
            ).all()
            seats = {
                row.id: row
                for row in connection.execute(
                    sa.text("SELECT id, lease_holder, lease_fence, lease_expires_at FROM seats")
                )
            }
            report.hold_intents = connection.execute(
                sa.text("SELECT count(*) FROM hold_intents")
            ).scalar_one()
    finally:
        engine.dispose()

    grants: dict[tuple[int, int], Grant] = {}
    for seat, fence, holder, kind, mode, at, expires_at in log:
        key = (seat, fence)
        if kind == "grant":
            if key in grants:
                problems.append(f"seat {seat} fence {fence} granted twice")
                continue
            grants[key] = Grant(seat, fence, holder, mode, at, [expires_at])
            report.grants += 1
            report.hold_grants += mode == "hold"
            continue
        if kind == "lost":
            report.lost += 1
            if mode == "hold":  # its transaction held the row lock: nobody could take it
                problems.append(f"seat {seat} fence {fence}: lost while {holder} held its lock")
            continue
        grant = grants.get(key)
        if grant is None or grant.holder != holder:
            problems.append(f"seat {seat} fence {fence}: a {kind} by {holder} of no logged grant")
            continue
        if grant.released_at is not None:
            problems.append(f"seat {seat} fence {fence}: a {kind} after its release")
        if kind in ("renew", "held"):
            grant.expires.append(expires_at)
            report.renewals += kind == "renew"
        else:
            grant.released_at = expires_at
            report.releases += 1
            report.held_past_expiry += expires_at > max(grant.expires)

    by_seat: dict[int, list[Grant]] = defaultdict(list)
    for grant in grants.values():
        by_seat[grant.seat].append(grant)
    for seat in range(1, SEATS + 1):
        history = sorted(by_seat[seat], key=lambda g: g.fence)
        previous: Grant | None = None
        last_fence = 0
        for grant in history:
            report.gaps += grant.fence - last_fence - 1
            last_fence = grant.fence
            if previous is not None:
                if grant.start < previous.end:
                    problems.append(
                        f"seat {seat}: {grant.holder} (fence {grant.fence}) from {grant.start} "
                        f"while {previous.holder} (fence {previous.fence}) held it until "
                        f"{previous.end}"
                    )
                if previous.released_at is None:
                    report.takeovers += 1
            previous = grant
        row = seats[seat]
        if row.lease_fence < last_fence:
            problems.append(f"seat {seat}: fence {row.lease_fence} behind the log's {last_fence}")
        elif row.lease_fence > last_fence:
            report.gaps += row.lease_fence - last_fence  # unlogged lock-held grants at the end
        elif previous is not None:
            expected = None if previous.released_at is not None else previous.holder
            if row.lease_holder != expected:
                problems.append(
                    f"seat {seat}: held by {row.lease_holder!r}, its log says {expected!r}"
                )
        elif row.lease_holder is not None:
            problems.append(f"seat {seat}: held by {row.lease_holder!r} with no grant ever")
    unlogged_holds = report.hold_intents - report.hold_grants
    if report.gaps > unlogged_holds:
        problems.append(
            f"{report.gaps} grants missing from the log, but only {unlogged_holds} lock-held "
            "acquires could have left one"
        )

    # None lost: with every lease run out, one acquire takes every seat.
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with Session(engine) as session, session.begin():
            final = acquire_leases(session, Seat, holder="final", duration=60, limit=SEATS + 5)
    finally:
        engine.dispose()
    if sorted(lease.key for lease in final) != list(range(1, SEATS + 1)):
        problems.append(f"the final acquire got seats {sorted(lease.key for lease in final)}")
    for lease in final:
        if lease.fence != seats[lease.key].lease_fence + 1:
            problems.append(f"seat {lease.key}: final fence {lease.fence} after {seats[lease.key]}")
    return report
