"""A high-availability PostgreSQL on this machine, for the failover drill (tests/failover.py).

:class:`Formation` runs Debian's pg_auto_failover (``pg_autoctl``, package
``postgresql-15-auto-failover``): a monitor, a primary and a synchronous standby, each a
PostgreSQL 15 on a loopback port with its keeper, all under one directory. It is installed
with apt-get when missing and the tests run as root (:func:`pg_autoctl_missing`), as the
PgBouncer tests install PgBouncer.

The monitor decides failovers; a node is "killed" as a machine dies: its keeper, its
PostgreSQL and every backend get SIGKILL at once (:meth:`Formation.kill`). The standby is then
promoted by the monitor, and clients that connect through :meth:`Formation.url` (both hosts,
``target_session_attrs=read-write``) find the new primary.

``fast=True`` (the default) shortens pg_auto_failover's timeouts so that a drill waits seconds,
not a minute (its defaults: a node is unhealthy after 20 s without answering the monitor, and
the monitor waits 30 s for the old primary to demote itself before it lets the standby take
writes). The keeper's own network-partition timeout is shortened with the demote timeout, so
that the rule the defaults keep still holds: an old primary that still runs but cannot reach
the monitor or the standby stops taking writes before the standby is allowed to. These are
the settings the docs' failover page names.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from debian_packages import install_debian_package
from sqlalchemy.engine import URL

from sqla_jobs._processes import ensure_os_user, free_port, is_root
from sqla_jobs.embedded import DEFAULT_OS_USER

#: Debian's package of pg_auto_failover for PostgreSQL 15, and the PostgreSQL it runs.
PACKAGE = "postgresql-15-auto-failover"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
#: The monitor's settings under ``fast`` (milliseconds), and the keepers' (seconds).
FAST_MONITOR = {
    "pgautofailover.health_check_period": 1000,
    "pgautofailover.health_check_retry_delay": 500,
    "pgautofailover.health_check_timeout": 1000,
    "pgautofailover.health_check_max_retries": 1,
    "pgautofailover.node_considered_unhealthy_timeout": 3000,
    "pgautofailover.primary_demote_timeout": 6000,
}
FAST_KEEPER = {"timeout.network_partition_timeout": "3"}


def pg_autoctl() -> str | None:
    """The ``pg_autoctl`` binary, or None when pg_auto_failover is not installed."""
    found = shutil.which("pg_autoctl")
    if found is None or not (PG_BIN / "pg_ctl").exists():
        return None
    return found


def pg_autoctl_missing() -> str | None:
    """Why pg_auto_failover cannot run here, or None (installed now if it was missing)."""
    reason = install_debian_package(PACKAGE, present=pg_autoctl() is not None)
    if reason is None and pg_autoctl() is None:
        reason = f"{PACKAGE} was installed, but pg_autoctl or {PG_BIN / 'pg_ctl'} is missing"
    return reason


#: False on the node that takes writes: not a standby, and not fenced by pg_auto_failover (a
#: standby being promoted is read-only until the monitor confirms the old primary is gone).
WRITABLE = "SELECT pg_is_in_recovery() OR current_setting('default_transaction_read_only')::boolean"


class FormationError(RuntimeError):
    """The formation did not come up, or not in time (its logs are named)."""


@dataclass
class Node:
    """A keeper and its PostgreSQL (or the monitor), started by :class:`Formation`."""

    name: str
    port: int
    directory: Path
    popen: subprocess.Popen[bytes] | None = None
    log_files: list[Path] = field(default_factory=list)

    @property
    def pgdata(self) -> Path:
        return self.directory / "data"

    def conninfo(self, dbname: str, user: str) -> str:
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={user} connect_timeout=2"


class Formation:
    """A monitor, a primary and a synchronous standby, in a new temporary directory (the
    servers' OS user must reach it, which a directory under a root-only one would not allow:
    pytest's ``tmp_path``, say). :meth:`stop` leaves it behind; :meth:`remove` deletes it."""

    def __init__(self, *, dbname: str = "drill", fast: bool = True) -> None:
        binary = pg_autoctl()
        if binary is None:
            raise FormationError(f"pg_autoctl is not installed ({PACKAGE})")
        self.binary = binary
        self.directory = Path(tempfile.mkdtemp(prefix="sqla_jobs_ha_"))
        self.dbname = dbname
        self.fast = fast
        self.user = DEFAULT_OS_USER if is_root() else _current_user()
        self.sockets = self.directory / "sockets"
        self.monitor = Node("monitor", free_port(), self.directory / "monitor")
        self.nodes = [Node(f"node{i}", free_port(), self.directory / f"node{i}") for i in (1, 2)]

    # -- running pg_autoctl ------------------------------------------------------------------

    def _env(self, node: Node) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "XDG_"))}
        env.update(
            PATH=f"{PG_BIN}{os.pathsep}{env.get('PATH', '')}",
            PG_CONFIG=str(PG_BIN / "pg_config"),
            # pg_autoctl keeps its configuration and state under XDG directories: one set
            # per node, so that several nodes (and several formations) never share them.
            XDG_CONFIG_HOME=str(node.directory / "config"),
            XDG_DATA_HOME=str(node.directory / "share"),
            XDG_RUNTIME_DIR=str(node.directory / "run"),
            HOME=str(node.directory),
            # The servers' sockets: not Debian's /var/run/postgresql, which only its own
            # postgres user may write to.
            PGHOST=str(self.sockets),
        )
        return env

    def _ids(self) -> dict[str, int]:
        if not is_root():
            return {}
        uid, gid = ensure_os_user(self.user)
        return {"user": uid, "group": gid}

    def _run(self, node: Node, *args: str, timeout: float = 120.0) -> str:
        result = subprocess.run(
            [self.binary, *args, "--pgdata", str(node.pgdata)],
            capture_output=True,
            text=True,
            env=self._env(node),
            cwd=node.directory,
            timeout=timeout,
            check=False,
            **self._ids(),  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-5:])
            raise FormationError(f"pg_autoctl {args[0]} {args[1] if len(args) > 1 else ''}: {tail}")
        return str(result.stdout)

    def _start(self, node: Node) -> None:
        """``pg_autoctl run`` for ``node``, in a process group of its own (see :meth:`kill`)."""
        log = node.directory / f"run-{len(node.log_files)}.log"
        node.log_files.append(log)
        with log.open("wb") as handle:
            node.popen = subprocess.Popen(  # type: ignore[call-overload]
                [self.binary, "run", "--pgdata", str(node.pgdata)],
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=self._env(node),
                cwd=node.directory,
                start_new_session=True,
                **self._ids(),
            )

    def _prepare(self, node: Node, *, initdb: bool) -> None:
        """The node's directories; and with ``initdb``, its data directory, made here rather
        than by pg_autoctl so that its sockets go to :attr:`sockets` (a standby's comes from
        its primary's base backup, with the same setting)."""
        for path in (self.sockets, *(node.directory / sub for sub in ("config", "share", "run"))):
            path.mkdir(parents=True, exist_ok=True)
        if is_root():
            uid, gid = ensure_os_user(self.user)
            for path in (self.directory, self.sockets, node.directory, *node.directory.rglob("*")):
                os.chown(path, uid, gid)
        os.chmod(node.directory / "run", 0o700)
        if initdb:
            command = [str(PG_BIN / "initdb"), "-D", str(node.pgdata), "--auth", "trust"]
            subprocess.run(
                [*command, "-U", self.user, "--no-sync"],
                capture_output=True,
                env=self._env(node),
                cwd=node.directory,
                check=True,
                **self._ids(),  # type: ignore[call-overload]
            )
            with (node.pgdata / "postgresql.conf").open("a") as conf:
                conf.write(f"unix_socket_directories = '{self.sockets}'\n")

    # -- the formation -----------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> None:
        """Create and run the monitor, the primary and the standby; return once the monitor
        reports them ``primary`` and ``secondary`` (synchronous replication on)."""
        monitor = self.monitor
        self._prepare(monitor, initdb=True)
        self._run(
            monitor,
            "create",
            "monitor",
            *_common(monitor),
        )
        self._start(monitor)
        self._wait(lambda: self._monitor_sql("SELECT 1") is not None, 30.0, "the monitor")
        if self.fast:
            for name, value in FAST_MONITOR.items():
                self._monitor_sql(f"ALTER SYSTEM SET {name} = {value}")
            self._monitor_sql("SELECT pg_reload_conf()")
        monitor_url = (
            f"postgres://autoctl_node@127.0.0.1:{monitor.port}/pg_auto_failover?sslmode=disable"
        )
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            self._prepare(node, initdb=node is self.nodes[0])
            self._run(
                node,
                "create",
                "postgres",
                *_common(node),
                "--name",
                node.name,
                "--dbname",
                self.dbname,
                "--monitor",
                monitor_url,
            )
            if self.fast:
                for key, setting in FAST_KEEPER.items():
                    self._run(node, "config", "set", key, setting)
            self._start(node)
            wanted = {"node1": "single"} if node is self.nodes[0] else {}
            self._wait_states(wanted or {"node1": "primary", "node2": "secondary"}, deadline)

    def _wait_states(self, wanted: dict[str, str], deadline: float) -> None:
        """Wait until each named node reports its wanted state. A standby's base backup waits
        for a checkpoint of the primary (a spread one: minutes): it is asked for at once."""
        while True:
            states = self.states()
            if all(states.get(name, ("", ""))[0] == state for name, state in wanted.items()):
                return
            if any(reported in ("wait_standby", "catchingup") for reported, _ in states.values()):
                primary = self.writable()
                if primary is not None:
                    with contextlib.suppress(psycopg.Error):
                        self._sql(primary, "CHECKPOINT")
            if time.monotonic() > deadline:
                raise FormationError(f"nodes not {wanted} in time: {states}; logs: {self.logs()}")
            time.sleep(0.5)

    def _wait(self, condition: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise FormationError(f"{what} not ready in {timeout:g} s; logs: {self.logs()}")
            time.sleep(0.2)

    def logs(self) -> list[str]:
        return [str(log) for node in (self.monitor, *self.nodes) for log in node.log_files]

    def _sql(
        self, node: Node, statement: str, dbname: str | None = None
    ) -> list[tuple[object, ...]]:
        with psycopg.connect(
            node.conninfo(dbname or self.dbname, self.user), autocommit=True
        ) as connection:
            cursor = connection.execute(statement)
            return cursor.fetchall() if cursor.description else []

    def _monitor_sql(self, statement: str) -> list[tuple[object, ...]] | None:
        try:
            return self._sql(self.monitor, statement, "pg_auto_failover")
        except psycopg.Error:
            return None

    def states(self) -> dict[str, tuple[str, str]]:
        """Each node's (reported state, assigned state), as the monitor has them ({} while the
        monitor does not answer)."""
        rows = self._monitor_sql(
            "SELECT nodename, reportedstate, goalstate FROM pgautofailover.node"
        )
        return {str(name): (str(rep), str(goal)) for name, rep, goal in rows or []}

    def writable(self) -> Node | None:
        """The node that takes writes now, or None."""
        for node in self.nodes:
            with contextlib.suppress(psycopg.Error):
                rows = self._sql(node, WRITABLE)
                if rows and rows[0][0] is False:
                    return node
        return None

    def url(self, *, connect_timeout: int = 2) -> str:
        """The SQLAlchemy URL of the formation's database: both hosts, and libpq told to take
        the one that accepts writes."""
        return URL.create(
            "postgresql+psycopg",
            username=self.user,
            database=self.dbname,
            query={
                "host": [f"127.0.0.1:{node.port}" for node in self.nodes],
                "target_session_attrs": "read-write",
                "connect_timeout": str(connect_timeout),
            },
        ).render_as_string(hide_password=False)

    def kill(self, node: Node) -> None:
        """SIGKILL everything of ``node`` at once (its keeper, its PostgreSQL, the backends),
        as if its machine died; return once its PostgreSQL is gone."""
        if node.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.popen.pid, signal.SIGKILL)
        for pid in _processes_of(node.pgdata):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.popen.wait(10)
        # Returns once its postmaster is gone: nothing commits there after this.
        deadline = time.monotonic() + 10
        while any(True for _ in _processes_of(node.pgdata)) and time.monotonic() < deadline:
            time.sleep(0.01)

    def restart(self, node: Node) -> None:
        """Run a killed node's keeper again: it rejoins the formation as a standby."""
        self._start(node)

    def stop(self) -> None:
        """Stop everything (SIGKILL: the data is for reading after, not for running again)."""
        for node in (*self.nodes, self.monitor):
            self.kill(node)

    def remove(self) -> None:
        """Delete the directory (after :meth:`stop`)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def _common(node: Node) -> list[str]:
    return [
        "--pgctl",
        str(PG_BIN / "pg_ctl"),
        "--pgport",
        str(node.port),
        "--hostname",
        "127.0.0.1",
        "--listen",
        "127.0.0.1",
        "--auth",
        "trust",
        "--no-ssl",
    ]


def _current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _processes_of(pgdata: Path) -> Iterator[int]:
    """Processes whose command line names ``pgdata`` (a postmaster that left the group)."""
    needle = str(pgdata).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    yield int(entry.name)
