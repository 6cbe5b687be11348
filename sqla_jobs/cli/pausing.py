"""``sqla-jobs pause`` and ``sqla-jobs resume``: one queue (``sqla-jobs status`` lists the
paused ones)."""

from __future__ import annotations

import argparse
import sys

from sqla_jobs import queue
from sqla_jobs.cli.database import command_session
from sqla_jobs.cli.loading import load_model


def cmd_pause(args: argparse.Namespace) -> int:
    model = load_model(args)
    with command_session(args) as session:
        pause = queue.pause_queue(session, model, args.queue, reason=args.reason)
    since = pause.paused_at.isoformat(timespec="seconds")
    sys.stdout.write(
        f"queue {pause.queue} is paused (since {since}): no worker starts its jobs until "
        f"sqla-jobs resume {pause.queue}\n"
    )
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    model = load_model(args)
    with command_session(args) as session:
        resumed = queue.resume_queue(session, model, args.queue)
    if resumed:
        sys.stdout.write(f"queue {args.queue} is resumed\n")
    else:
        sys.stdout.write(f"queue {args.queue} was not paused\n")
    return 0
