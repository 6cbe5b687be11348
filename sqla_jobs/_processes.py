"""Operating-system helpers that the embedded PostgreSQL (:mod:`sqla_jobs.embedded`) and the
PgBouncer it can stand behind (:mod:`sqla_jobs.pgbouncer`) share: a free port, a one-line
rendering of a tool's output, whether we run as root, an OS user to run a server as.
Private to the package."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile

from sqla_jobs.errors import EmbeddedPostgresError

__all__ = ["ensure_os_user", "free_port", "is_root", "one_line"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def one_line(text: str) -> str:
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def ensure_os_user(name: str) -> tuple[int, int]:
    """Return the uid and gid of OS user ``name``, creating it (as root) when missing.

    Processes that start servers at once (test workers, say) take turns, under an exclusive
    lock of a file beside the temporary files: two ``useradd`` runs at once have been seen to
    leave one of them holding a uid that the other's write of ``/etc/passwd`` took away."""
    import fcntl  # POSIX only
    import pwd

    lock_path = os.path.join(tempfile.gettempdir(), "sqla_jobs_useradd.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            useradd = shutil.which("useradd") or "/usr/sbin/useradd"
            result = subprocess.run(
                [
                    useradd,
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--shell",
                    "/bin/false",
                    name,
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            try:
                entry = pwd.getpwnam(name)
            except KeyError:
                raise EmbeddedPostgresError(
                    f"PostgreSQL cannot run as root and creating the OS user {name!r} failed: "
                    f"{one_line(result.stderr) or f'useradd exited {result.returncode}'}"
                ) from None
    return entry.pw_uid, entry.pw_gid
