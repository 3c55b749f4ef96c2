"""Which process is this, and has another one ended: told from /proc, on this host only.

A process is named by its host, its PID namespace, its PID and its start time (clock ticks
since boot, field 22 of /proc/<pid>/stat). The start time is what tells a live process from
a new one the kernel has given a dead process's PID to. Used by the output store (may a
_tmp/<writer>/ folder go?) and by the run record (was a RUNNING MLflow run abandoned?).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessIdentity:
    host: str | None
    pid_namespace: str | None  # the /proc/self/ns/pid link, e.g. "pid:[4026531836]"; None without /proc
    pid: int
    start_time: str | None  # clock ticks since boot; None where it is not known (no /proc)

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process (read again after a fork: the child is another process)."""
        pid = os.getpid()
        if pid not in _current:
            stat = process_stat(pid)
            _current[pid] = cls(socket.gethostname(), pid_namespace(), pid, stat[1] if stat else None)
        return _current[pid]


_current: dict[int, ProcessIdentity] = {}


def is_gone(identity: ProcessIdentity) -> bool | None:
    """True when the process ran here (this host, this PID namespace) and has ended: no such
    PID, a zombie, or its PID now held by a process that started at another time; False
    while it runs (or where nothing here can say it has ended); None when it ran on another
    host or in another PID namespace, where this machine cannot tell.

    A start time of None is not compared: whatever holds that PID counts as the process.
    """
    here = ProcessIdentity.current()
    if (identity.host, identity.pid_namespace) != (here.host, here.pid_namespace):
        return None
    stat = process_stat(identity.pid)
    if stat is not None:
        state, started = stat
        return state in ("Z", "X") or identity.start_time not in (None, started)
    if os.path.isdir("/proc/self"):
        return True  # /proc works here and has no such process
    try:
        os.kill(identity.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, owned by someone else
    return False


def process_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) from /proc, or None where there is no such
    process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def pid_namespace() -> str | None:
    """This process's PID namespace, as /proc/self/ns/pid names it; None without /proc."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
