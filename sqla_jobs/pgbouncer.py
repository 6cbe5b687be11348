"""A throwaway PgBouncer in front of a PostgreSQL server, for tests and benchmarks.

The binary is the operating system's (Debian's ``pgbouncer`` package: ``apt-get install
pgbouncer``), looked for on the ``PATH`` and in ``/usr/sbin``. It runs here with
:mod:`subprocess`, with our settings:

* transaction pooling (``pool_mode`` may be changed);
* it listens on TCP ``127.0.0.1`` only, on a free port of its own, with no unix socket;
* it does not authenticate clients (``auth_type = trust``; its auth file lists the user
  names it accepts), and logs in to the server as the user, with the password, of the
  server URL it was given;
* every database name goes through to the server's database of that name (a ``*`` entry),
  so databases created after it started are reachable as well.

PgBouncer refuses to run as root: when this process is root, it runs as the unprivileged OS
user of the embedded server (:data:`sqla_jobs.embedded.DEFAULT_OS_USER`). A failure to
set it up raises :class:`~sqla_jobs.errors.EmbeddedPostgresError`, as the throwaway server
does.

Usage::

    with PgBouncer(server_url) as bouncer:
        engine = create_engine(bouncer.url("app"), connect_args={"prepare_threshold": None})
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from sqlalchemy.engine import make_url

from sqla_jobs._processes import ensure_os_user, free_port, is_root, one_line
from sqla_jobs.embedded import DEFAULT_OS_USER
from sqla_jobs.errors import EmbeddedPostgresError

__all__ = ["PgBouncer", "find_binary"]

_SEARCH_PATH = ("/usr/sbin", "/usr/local/sbin")
_LOG_TAIL_LINES = 8


def find_binary() -> str | None:
    """The path of the ``pgbouncer`` binary, or None when it is not installed."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SEARCH_PATH])
    return shutil.which("pgbouncer", path=path)


def _value(text: str) -> str:
    """A value for PgBouncer's connection strings, quoted when it has to be."""
    if text and not any(c in text for c in " '\\=\t"):
        return text
    return "'" + text.replace("'", "''") + "'"


class PgBouncer:
    """A PgBouncer process in front of the server of ``server_url``; see the module.

    ``settings`` are more ``[pgbouncer]`` settings (``{"server_round_robin": 1}``).

    :meth:`start` writes its configuration and runs it; :meth:`stop` shuts it down and
    deletes its directory (also at the exit of the Python process); :meth:`url` gives the
    SQLAlchemy URL of a database through it.
    """

    def __init__(
        self,
        server_url: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 20,
        max_client_conn: int = 1000,
        settings: Mapping[str, str | int] | None = None,
        binary: str | None = None,
        os_user: str = DEFAULT_OS_USER,
        startup_timeout: float = 30.0,
    ) -> None:
        self.server = make_url(server_url)
        self.user = self.server.username or "postgres"
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.settings = dict(settings or {})
        self.binary = binary
        self.os_user = os_user
        self.startup_timeout = startup_timeout
        self.port = 0
        self.base_dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._atexit_registered = False

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3) of ``database`` through this PgBouncer."""
        if not self.port:
            raise EmbeddedPostgresError("PgBouncer has no port yet: call start() first")
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        """Write the configuration and run PgBouncer; wait until it accepts connections."""
        if self.running:
            return
        binary = self.binary or find_binary()
        if binary is None:
            raise EmbeddedPostgresError(
                "PgBouncer is not installed: no pgbouncer binary on the PATH or in /usr/sbin "
                "(on Debian: apt-get install pgbouncer)"
            )
        ids = ensure_os_user(self.os_user) if is_root() else None
        self.base_dir = Path(tempfile.mkdtemp(prefix="sqla_jobs_pgbouncer_"))
        self._register_atexit()
        if ids is not None:
            os.chown(self.base_dir, *ids)
        for attempt in range(3):
            self.port = free_port()
            self._write_files(ids)
            try:
                self._launch(binary, ids)
                return
            except EmbeddedPostgresError:
                if attempt == 2 or "address already in use" not in self._log_tail(40).lower():
                    raise

    def stop(self) -> None:
        """Shut PgBouncer down (its clients are disconnected) and delete its directory."""
        process, self._process = self._process, None
        try:
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)  # immediate shutdown
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        finally:
            if self.base_dir is not None:
                shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = None
            if self._atexit_registered:
                atexit.unregister(self.stop)
                self._atexit_registered = False

    def __enter__(self) -> PgBouncer:
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
        return f"<PgBouncer {state} port={self.port} pool_mode={self.pool_mode}>"

    # -- internals ------------------------------------------------------------------------

    def _write_files(self, ids: tuple[int, int] | None) -> None:
        assert self.base_dir is not None
        server = {
            "host": self.server.host or "127.0.0.1",
            "port": str(self.server.port or 5432),
            "user": self.user,
        }
        if self.server.password:
            server["password"] = str(self.server.password)
        target = " ".join(f"{key}={_value(value)}" for key, value in server.items())
        users = dict.fromkeys([self.user, "postgres"])
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.base_dir / "userlist.txt"),
            "admin_users": self.user,
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.pool_size),
            "max_client_conn": str(self.max_client_conn),
            # A server that refuses a login (no such database) is tried again after 1 s,
            # not the default 15 s.
            "server_login_retry": "1",
            "logfile": str(self.base_dir / "pgbouncer.log"),
            **{key: str(value) for key, value in self.settings.items()},
        }
        ini = ["; Written by sqla_jobs.pgbouncer.", "[databases]", f"* = {target}", "[pgbouncer]"]
        ini += [f"{key} = {value}" for key, value in settings.items()]
        files = {
            "pgbouncer.ini": "\n".join(ini) + "\n",
            "userlist.txt": "".join(f'"{user}" ""\n' for user in users),
        }
        for name, text in files.items():
            path = self.base_dir / name
            path.write_text(text)
            if ids is not None:
                os.chown(path, *ids)

    def _log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        log = None if self.base_dir is None else self.base_dir / "pgbouncer.log"
        if log is None or not log.exists():
            return "(no PgBouncer log)"
        text = log.read_text(errors="replace").splitlines()[-lines:]
        return one_line("\n".join(text)) or "(empty PgBouncer log)"

    def _launch(self, binary: str, ids: tuple[int, int] | None) -> None:
        assert self.base_dir is not None
        try:
            process = subprocess.Popen(
                [binary, str(self.base_dir / "pgbouncer.ini")],
                cwd=self.base_dir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # it logs to its logfile as well
                start_new_session=True,  # a terminal's Ctrl-C must not reach it
                user=None if ids is None else ids[0],
                group=None if ids is None else ids[1],
                extra_groups=None if ids is None else [],
            )
        except OSError as exc:
            raise EmbeddedPostgresError(f"could not run pgbouncer: {exc}") from exc
        self._process = process
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = process.poll()
            if code is not None:
                self._process = None
                raise EmbeddedPostgresError(
                    f"PgBouncer exited with code {code} while starting on port {self.port}: "
                    f"{self._log_tail()}"
                )
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise EmbeddedPostgresError(
                    f"PgBouncer did not accept connections within {self.startup_timeout:g}s "
                    f"on port {self.port}: {tail}"
                )
            time.sleep(0.02)

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
