"""``sqla-jobs pause`` and ``sqla-jobs resume``: one queue (``sqla-jobs status`` lists the
paused ones)."""

from __future__ import annotations

import argparse
import sys

from sqlalchemy.orm import Session

from sqla_jobs import queue
from sqla_jobs.cli.database import database_url, make_engine
from sqla_jobs.cli.loading import load_model


def cmd_pause(args: argparse.Namespace) -> int:
    model = load_model(args)
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    try:
        with Session(engine) as session, session.begin():
            pause = queue.pause_queue(session, model, args.queue, reason=args.reason)
    finally:
        engine.dispose()
    since = pause.paused_at.isoformat(timespec="seconds")
    sys.stdout.write(
        f"queue {pause.queue} is paused (since {since}): no worker starts its jobs until "
        f"sqla-jobs resume {pause.queue}\n"
    )
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    model = load_model(args)
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    try:
        with Session(engine) as session, session.begin():
            resumed = queue.resume_queue(session, model, args.queue)
    finally:
        engine.dispose()
    if resumed:
        sys.stdout.write(f"queue {args.queue} is resumed\n")
    else:
        sys.stdout.write(f"queue {args.queue} was not paused\n")
    return 0
