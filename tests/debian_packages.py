"""Debian packages the tests install when they are missing and the tests run as root
(PgBouncer, pg_auto_failover), as the machines CI runs on allow."""

from __future__ import annotations

import os
import shutil
import subprocess

from sqla_jobs._processes import is_root

__all__ = ["install_debian_package"]


def install_debian_package(*packages: str, present: bool) -> str | None:
    """Install Debian's ``packages`` unless ``present``; return why they cannot be had, or
    None.

    Only root installs; apt-get waits for dpkg's lock (test processes may install at once),
    and runs ``apt-get update`` once if the first try fails (no package lists yet)."""
    if present:
        return None
    named = " ".join(packages)
    if not is_root():
        return f"{named} is not installed, and only root may install it (apt-get install {named})"
    apt = shutil.which("apt-get")
    if apt is None:
        return f"{named} is not installed, and there is no apt-get to install it with"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock_wait = ["-o", "DPkg::Lock::Timeout=300"]
    install = [apt, "install", "-y", "--no-install-recommends", *lock_wait, *packages]
    result = subprocess.run(install, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        subprocess.run([apt, "update"], capture_output=True, env=env, check=False)
        result = subprocess.run(install, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        return f"{named} is not installed and apt-get install {named} failed: {tail}"
    return None
