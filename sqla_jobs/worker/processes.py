"""Handlers in child processes: the pool that runs the tasks registered with
``process=True``.

A process task's attempt takes the same path as any other (:mod:`sqla_jobs.worker.runner`:
admitted, started, hooks around it, settled once by
:meth:`State.settle <sqla_jobs.worker.state.State.settle>`), except that its handler thread
does not call the function: :meth:`ProcessPool.call` sends the job to an idle child of the
pool and waits for its reply. So a process handler still holds a handler thread (the
worker's ``concurrency`` bounds what runs at once), and the pool's size (the worker's
``processes`` setting) bounds how many run in processes.

The children are started with the ``spawn`` method (a fresh interpreter, never a fork of
the threaded worker), each with a pipe of its own. A child finds a task's function by its
module and qualified name (importing the module, as the parent has: the parent's
``sys.path`` is the child's), builds a :class:`~sqla_jobs.JobContext` of its own (no
session: lease mode only; ``ctx.columns`` is not available; ``ctx.cancelled`` stays false,
because a child is stopped by a kill), calls the function and sends back what it returned or
raised (pickled; an exception that cannot be pickled comes back as a
:class:`ProcessHandlerError` carrying its text; the child's traceback is kept as the
exception's cause, so the job's ``last_error`` shows it). ``ctx.report_progress`` works: the
child sends its latest report at most every :data:`PROGRESS_EVERY` seconds and with its
reply, and the worker stores it as a thread handler's.

Stopping a child: when its attempt runs past its time limit (:meth:`State.time_out
<sqla_jobs.worker.state.State.time_out>` has failed the attempt at the limit already), when
its job's cancel is requested, and when the worker stops after its grace, the child is
killed (SIGKILL): its handler thread sees the pipe end, raises
:class:`~sqla_jobs.errors.JobTimeoutError` (or :class:`~sqla_jobs.errors.JobCancelledError`)
at once and frees its slot, and a new child replaces the killed one. A child that dies by
itself mid-job (a crash, ``os._exit``, the kernel's OOM killer) fails that attempt only, with
a :class:`ProcessHandlerError` naming its exit code or signal; the worker goes on with a new
child. Children ignore SIGINT and SIGTERM (the worker stops them; a process group's signal
must not end their jobs before the grace), and exit when the worker's process is gone.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from sqla_jobs.context import JobContext, Snooze
from sqla_jobs.errors import (
    ConfigurationError,
    JobCancelledError,
    JobTimeoutError,
    ProcessHandlerError,
)
from sqla_jobs.queue import ClaimedJob
from sqla_jobs.registry import Registry, Task

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from sqla_jobs.worker.state import Attempt

__all__ = ["PROGRESS_EVERY", "ProcessPool", "check_process_tasks"]

logger = logging.getLogger("sqla_jobs.worker")

#: The most often (seconds) a child sends its handler's progress while it runs.
PROGRESS_EVERY: Final = 0.5
#: How often (seconds) a child looks whether the worker's process is still there.
_ORPHAN_CHECK_EVERY: Final = 1.0
#: How long (seconds) the pool waits for a killed child to be gone.
_EXIT_WAIT: Final = 2.0


class _ChildTraceback(Exception):
    """The child process's traceback of the exception a process handler raised: set as that
    exception's cause, so that its formatted traceback (the job's ``last_error``) shows it."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


def task_location(task: Task[Any]) -> tuple[str, str]:
    """Where a child finds ``task``'s function: its module and qualified name."""
    function = task.function
    return function.__module__, function.__qualname__


def _resolve(module: str, qualname: str) -> Callable[[JobContext], Any]:
    """The function at ``module.qualname``: the function itself, or the :class:`Task` the
    ``@registry.task`` decorator bound to its name."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if isinstance(found, Task):
        found = found.function
    if not callable(found):
        raise TypeError(f"{module}.{qualname} is {found!r}, not a function")
    return found  # type: ignore[no-any-return]


def check_process_tasks(registry: Registry) -> list[Task[Any]]:
    """The registry's process tasks, each checked: its function is found where a child
    looks for it (``module.qualname``, as a function or as the task); else
    :class:`~sqla_jobs.errors.ConfigurationError`, before the worker runs any SQL."""
    tasks = [task for task in registry if task.process]
    for task in tasks:
        module, qualname = task_location(task)
        try:
            found = _resolve(module, qualname)
        except Exception as exc:
            raise ConfigurationError(
                f"process task {task.name!r}: a child process finds its function as "
                f"{module}.{qualname}, which cannot be imported ({type(exc).__name__}: {exc}); "
                "define it at the top level of an importable module"
            ) from None
        if found is not task.function:
            raise ConfigurationError(
                f"process task {task.name!r}: {module}.{qualname} is not its function (the "
                "name is bound to something else); a child process finds the function by "
                "its module and name"
            )
    return tasks


# -- the worker's side ---------------------------------------------------------------------


@dataclass(eq=False)
class _Child:
    process: BaseProcess
    connection: Connection
    # Under the pool's lock: the attempt it runs (None: idle), and whether it was killed
    # (it is never given another job then).
    running: tuple[int, int] | None = None
    killed: bool = False
    gone: bool = False


@dataclass(eq=False)
class ProcessPool:
    """Up to ``size`` child processes running process handlers, started on demand (or by
    :meth:`start`), one job each at a time; see the module docstring."""

    size: int
    prefix: str
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _idle: list[_Child] = field(default_factory=list)
    _busy: dict[tuple[int, int], _Child] = field(default_factory=dict)
    _count: int = 0  # children started and not discarded (idle, busy or being started)
    _closed: bool = False
    _started: int = 0  # children started so far (names them)
    _locations: dict[str, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)
        self._context = multiprocessing.get_context("spawn")

    def start(self) -> None:
        """Start the children not started yet (they import in the background)."""
        while True:
            with self._lock:
                if self._closed or self._count >= self.size:
                    return
                self._count += 1
            self._add(self._spawn())

    def _spawn(self) -> _Child:
        # Outside the lock (a few milliseconds: a fork and exec); the count was taken.
        try:
            mine, theirs = self._context.Pipe(duplex=True)
            with self._lock:
                self._started += 1
                number = self._started
            process = self._context.Process(
                target=_child_main,
                args=(theirs, os.getpid()),
                name=f"{self.prefix}-process-{number}",
                daemon=True,
            )
            process.start()
        except BaseException:
            with self._lock:
                self._count -= 1
                self._changed.notify_all()
            raise
        theirs.close()  # the child's end: its death ends the pipe for us
        return _Child(process, mine)

    def _add(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                self._changed.notify()
                return
        self._end(child)

    def stop(self, attempt: Attempt) -> None:
        """Kill the child running ``attempt`` (past its time limit, or its cancel was
        requested); its handler thread raises at once. Wakes a thread waiting for a child
        for it, which then does not start it. Nothing if none runs it."""
        with self._lock:
            child = self._busy.get(attempt.key)
            self._changed.notify_all()
            if child is None or child.killed:
                return
            child.killed = True
            process = child.process
        _kill(process)

    def close(self) -> None:
        """Kill every child (the handler threads of busy ones raise)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy.values())
            for child in busy:
                child.killed = True
            self._changed.notify_all()
        for child in busy:
            _kill(child.process)
        for child in idle:
            self._end(child)

    # -- one job ---------------------------------------------------------------------------

    def call(self, attempt: Attempt, task: Task[Any], worker: str) -> Any:
        """Run ``attempt``'s handler in a child: return what it returned, raise what it
        raised, or raise why it could not end so (see the module docstring)."""
        location = self._locations.get(task.name)
        if location is None:
            location = self._locations[task.name] = task_location(task)
        try:
            message = pickle.dumps((location, attempt.job, worker), pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ProcessHandlerError(
                f"job {attempt.job.id} cannot be sent to a child process: {exc}"
            ) from None
        child = self._take(attempt)
        with contextlib.suppress(OSError):  # it died while idle: _reply reads its end
            child.connection.send_bytes(message)
        return self._reply(child, attempt)

    def _take(self, attempt: Attempt) -> _Child:
        """An idle child (started if the pool is not full), now running ``attempt``."""
        spawn = False
        with self._lock:
            while True:
                _stopped(attempt, self._closed)  # raises once it should not start
                if self._idle:
                    child = self._idle.pop()
                    break
                if self._count < self.size:
                    self._count += 1
                    spawn = True
                    break
                self._changed.wait()
        if spawn:
            child = self._spawn()
        with self._lock:
            if not self._closed and not attempt.timed_out and not attempt.cancel_requested:
                child.running = attempt.key
                self._busy[attempt.key] = child
                return child
            closed = self._closed
        self._add(child)  # told to stop meanwhile: the child was not used
        _stopped(attempt, closed)
        raise AssertionError("unreachable")  # pragma: no cover

    def _reply(self, child: _Child, attempt: Attempt) -> Any:
        connection, sentinel = child.connection, child.process.sentinel
        while True:
            ready = multiprocessing.connection.wait([connection, sentinel])
            if connection not in ready:
                break  # ended without a word
            try:
                data = connection.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                kind, value, extra, progress = pickle.loads(data)
            except Exception as exc:
                self._done(child, attempt)
                raise ProcessHandlerError(
                    f"the reply of the child process running job {attempt.job.id} cannot be "
                    f"read: {type(exc).__name__}: {exc}"
                ) from None
            if progress is not None:
                attempt.progress = progress
            if kind == "progress":
                continue
            self._done(child, attempt)
            if kind == "ok":
                return value
            if kind == "snooze":
                if extra:
                    raise Snooze(value)
                return Snooze(value)
            raise value from _ChildTraceback(extra)
        raise self._ended(child, attempt)

    def _done(self, child: _Child, attempt: Attempt) -> None:
        """``child`` replied: idle again, unless it was killed meanwhile."""
        with self._lock:
            self._busy.pop(attempt.key, None)
            child.running = None
            if not (child.killed or self._closed):
                self._idle.append(child)
                self._changed.notify()
                return
        self._replace(child)

    def _ended(self, child: _Child, attempt: Attempt) -> BaseException:
        """``child`` ended mid-job: replaced, and the error its attempt ends with."""
        with self._lock:
            self._busy.pop(attempt.key, None)
            killed, closed = child.killed, self._closed
        self._replace(child)
        job = attempt.job
        exitcode = child.process.exitcode
        if attempt.timed_out:
            return JobTimeoutError(
                f"job {job.id} attempt {job.attempt} ran past its time limit of "
                f"{attempt.time_limit:g} seconds; its child process was killed"
            )
        if attempt.cancel_requested:
            return JobCancelledError(
                f"job {job.id} was cancelled while it ran; its child process was killed"
            )
        if killed or closed:
            return ProcessHandlerError(
                f"the worker stopped while job {job.id} attempt {job.attempt} ran; its child "
                "process was killed"
            )
        return ProcessHandlerError(
            f"the child process running job {job.id} attempt {job.attempt} died "
            f"({_how(exitcode)}); only this attempt fails, a new process takes its place"
        )

    def _replace(self, child: _Child) -> None:
        """End ``child`` for good and, unless the pool is closed, start one in its place
        (which keeps its place in the count)."""
        self._end(child)
        with self._lock:
            if self._closed:
                self._count -= 1
                self._changed.notify_all()
                return
        try:
            replacement = self._spawn()  # gives the place back if it fails
        except Exception:
            logger.exception(
                "could not start a child process for process handlers; the next process "
                "job tries again",
                extra={"action": "process_start_failed"},
            )
            return
        self._add(replacement)

    def _end(self, child: _Child) -> None:
        with self._lock:
            if child.gone:
                return
            child.gone = True
        _kill(child.process)
        child.connection.close()
        child.process.join(_EXIT_WAIT)


def _stopped(attempt: Attempt, closed: bool) -> None:
    job = attempt.job
    if attempt.timed_out:
        raise JobTimeoutError(
            f"job {job.id} attempt {job.attempt} ran past its time limit of "
            f"{attempt.time_limit:g} seconds before a child process was free"
        )
    if attempt.cancel_requested:
        raise JobCancelledError(f"job {job.id} was cancelled before a child process was free")
    if closed:
        raise ProcessHandlerError(f"the worker stopped before job {job.id} reached a process")


def _kill(process: BaseProcess) -> None:
    with contextlib.suppress(OSError, ValueError):  # gone already, or closed
        process.kill()


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "its exit status unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exit code {exitcode}"


# -- the child's side -------------------------------------------------------------------------


class _ChildFlag:
    """A child's :class:`~sqla_jobs.context.CancelFlag`: never cancelled (a child is stopped
    by a kill); the progress its handler reports goes to the worker, at most every
    :data:`PROGRESS_EVERY` seconds (the latest one goes with the reply)."""

    cancel_requested = False
    timed_out = False

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._progress: dict[str, Any] | None = None
        self.progress_at = 0.0
        self.sent_at = 0.0
        self.unsent = False

    @property
    def progress(self) -> dict[str, Any] | None:
        return self._progress

    @progress.setter
    def progress(self, report: dict[str, Any] | None) -> None:
        self._progress = report
        self.unsent = True
        now = time.monotonic()
        if now - self.sent_at >= PROGRESS_EVERY:
            self.sent_at = now
            self.unsent = False
            self._connection.send(("progress", None, None, report))


def _no_columns(job: ClaimedJob, session: object, read: object = None) -> Any:
    raise ConfigurationError(
        f"task {job.task!r} runs in a child process, which has no database connection: "
        "ctx.columns is not available there (nor ctx.dependency_results() or "
        "ctx.add_steps()); pass what the handler needs in the job's args"
    )


def _child_main(connection: Connection, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    functions: dict[tuple[str, str], Callable[[JobContext], Any]] = {}
    while True:
        try:
            data = connection.recv_bytes()
        except (EOFError, OSError):
            return  # the worker closed the pipe: exit
        reply = _run(connection, data, functions)
        try:
            connection.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as exc:
            kind, value = reply[0], reply[1]
            what = "result" if kind == "ok" else repr(value)
            error = ProcessHandlerError(
                f"the handler's {what} cannot be sent from its child process: {exc}"
            )
            connection.send(("error", error, reply[2] or "", reply[3]))


def _orphan_watch(parent: int) -> None:
    while True:
        time.sleep(_ORPHAN_CHECK_EVERY)
        if os.getppid() != parent:
            os._exit(1)


def _run(
    connection: Connection,
    data: bytes,
    functions: dict[tuple[str, str], Callable[[JobContext], Any]],
) -> tuple[str, Any, Any, dict[str, Any] | None]:
    flag = _ChildFlag(connection)
    try:
        location, job, worker = pickle.loads(data)
        function = functions.get(location)
        if function is None:
            try:
                function = functions[location] = _resolve(*location)
            except Exception as exc:
                module, qualname = location
                raise ProcessHandlerError(
                    f"the child process cannot find the function {module}.{qualname}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        ctx = JobContext(job, worker, _cancel=flag, _loader=_no_columns)
        result = function(ctx)
        if isinstance(result, Snooze):
            return ("snooze", result.delay, False, flag.progress)
        if hasattr(result, "__await__"):
            close = getattr(result, "close", None)
            if close is not None:
                close()
            raise TypeError("a process handler must return a value, not an awaitable")
        return ("ok", result, None, flag.progress)
    except Snooze as snooze:
        return ("snooze", snooze.delay, True, flag.progress)
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))
        return ("error", _sendable(exc), text, flag.progress)


def _sendable(exc: BaseException) -> BaseException:
    """``exc``, or a :class:`ProcessHandlerError` with its text when it does not survive a
    pickle round trip (an exception whose constructor takes other arguments than its
    ``args``, one that holds an unpicklable value)."""
    try:
        pickle.loads(pickle.dumps(exc, pickle.HIGHEST_PROTOCOL))
    except Exception as why:
        return ProcessHandlerError(
            f"{type(exc).__module__}.{type(exc).__qualname__}: {exc} (the exception cannot "
            f"be sent from the child process as it is: {type(why).__name__}: {why})"
        )
    return exc
