"""The log events of the worker runtime: a stable ``action`` for each, and what it means.

Every record the worker, its listener and the command line log carries ``action`` in its
``extra``, and ``job_id`` (with ``task``, ``queue``, ``attempt``) when it is about one job.
sqla_jobs never configures logging; the ``sqla-jobs`` command does, for itself.

================================ ======== ==========================================================
action                           level    meaning
================================ ======== ==========================================================
worker_started                   INFO     the worker runs (queues, concurrency, name in ``extra``)
queue_without_tasks              WARNING  a queue the worker claims from has no task in its registry
wakeup_trigger_missing           WARNING  the job table has no NOTIFY trigger: new jobs wait for a
                                          poll
behind_pooler                    INFO     the engine goes through a connection pooler (PgBouncer):
                                          no session state; ``listen`` says whether LISTEN goes to
                                          the listen engine, or new jobs are found by polling only
prepared_behind_pooler           WARNING  behind a pooler, psycopg prepares statements: the engine
                                          needs ``connect_args={"prepare_threshold": None}``
worker_stopping                  INFO     a signal or ``stop()`` asked it to stop; no more claims
signals_not_handled              WARNING  ``Worker.run()`` runs off the main thread, where signal
                                          handlers cannot be installed: SIGTERM/SIGINT do not stop
                                          it
worker_stopped                   INFO     it stopped; ``released`` jobs were given back unfinished
job_claimed                      DEBUG    a batch was claimed (``count``)
job_started                      DEBUG    a handler started
job_succeeded                    DEBUG    its completion committed
job_failed                       WARNING  the handler raised; the job is pending again at ``run_at``
job_dead                         ERROR    the handler raised on the last attempt (or must not retry)
unknown_task                     ERROR    no handler is registered for the job's task: made dead,
                                          kept
unreadable_row                   ERROR    the job's ``args`` cannot be decoded in Python (a row
                                          another program wrote, nested past json's recursion
                                          limit): made dead with the reason; counted in
                                          ``health().unreadable_jobs``
trace_span_failed                WARNING  the attempt's trace span could not be started: it runs
                                          untraced
handler_thread_error             ERROR    a handler thread met an error outside the handler (a
                                          defect): the attempt is failed, the thread goes on
job_cancel_requested             INFO     the job's row holds a cancel request: its running handler
                                          is told
job_timed_out                    WARNING  the attempt ran past its time limit: its handler is told
                                          (a coroutine cancelled); a lease-mode attempt is failed
                                          now (``job_failed`` or ``job_dead`` follow when written)
job_snoozed                      INFO     the handler asked to run again later (``Snooze``): the job
                                          is pending at ``run_at``, no attempt spent
hook_failed                      ERROR    a hook around the handler raised: logged, ignored (the
                                          job's outcome is the handler's)
attempts_exhausted               ERROR    a claim found the job's last attempt dead with its worker
                                          (its lease ran out): made dead without running again.
                                          Logged by whoever claimed, :func:`sqla_jobs.claim`
                                          included
table_vacuumed                   INFO     :func:`sqla_jobs.vacuum` vacuumed the job table
                                          (``dead_rows``, ``seconds``); logged by whoever called it
lease_lost                       WARNING  the attempt lost its job (lease ran out and it was taken
                                          over); its outcome was dropped and changed nothing
jobs_released                    INFO     jobs given back unfinished (``count``, ``job_ids``,
                                          ``reason``): at shutdown, after a database error under a
                                          lock-mode job, or because a lease ran out before the
                                          handler could start
outcome_unknown                  WARNING  a lock-mode commit failed mid-way: the job either
                                          succeeded, or is given back (the release is fenced)
outcome_refused                  ERROR    the database refused an attempt's outcome (a result a
                                          constraint rejects, ...): the job is failed with that
                                          error instead
outcome_dropped                  ERROR    not even that failure could be written: the outcome is
                                          given up and the job runs again when its lease ends
outcomes_unwritten               ERROR    at exit, outcomes the database did not take (it was down):
                                          those jobs run again when their leases end
database_error                   WARNING  a database call failed; retried with backoff (``delay``,
                                          ``operation``)
database_reconnect               DEBUG    a kept connection was gone (a server restart); replaced at
                                          once
database_recovered               INFO     the database answers again after errors
listener_connected               INFO     LISTEN is (again) in place; a catch-up claim follows
listener_error                   WARNING  the LISTEN connection failed; reconnecting at once if it
                                          was up, else with backoff (``delay``)
fetch_loop_stuck                 ERROR    the fetch loop has not gone round for ``seconds``
worker_unhealthy                 ERROR    something else is stuck (``problems``): a claimed job
                                          waits for a handler thread, or an outcome waits to be
                                          written
health_file_error                WARNING  the health file could not be written
metrics_serving                  INFO     the worker serves Prometheus metrics (``host``, ``port``)
schedule_started                 INFO     a periodic task's schedule row was created at the current
                                          slot (``task``, ``slot``), which does not run; the next
                                          one will
slot_enqueued                    INFO     this worker won a periodic task's slot and enqueued its
                                          job (``task``, ``slot``, ``job_id``)
slot_skipped                     WARNING  a won slot was found later than its schedule's
                                          ``max_delay``: recorded, not run (``task``, ``slot``)
schedule_reset                   WARNING  a periodic task's last slot was recorded by a database
                                          clock that was ahead: the schedule resumes from the
                                          current slot, not run (``task``, ``recorded_slot``,
                                          ``slot``)
history_partition_failed         WARNING  a day partition of the history could not be made: left for
                                          the next run (``partition``)
history_partitions_not_permitted WARNING  the worker's role may not make history partitions: it only
                                          moves finished jobs until restarted
thread_crashed                   CRITICAL a runtime thread died of a bug; it is restarted
================================ ======== ==========================================================
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_MESSAGE_CHARS", "describe"]

MAX_MESSAGE_CHARS: Final = 300


def describe(exc: BaseException) -> str:
    """An exception as one short line, for a log message or the command line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    return text
