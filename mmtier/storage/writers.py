"""Which process wrote a file, and whether it still runs: what lets several processes share
one disk-tier directory (two engine processes of one node, an engine restarted beside another).

A writer is named ``"<pid>:<start>"``, ``start`` being the process's start time in clock ticks
since boot (``/proc/<pid>/stat`` field 22), so a pid reused by another process never passes for
the writer. Where ``/proc`` is missing, the start is ``"?"`` and only the pid is checked.
"""

from __future__ import annotations

import os
import re

_TMP = re.compile(r"\.(\d+)-[0-9a-f]+\.tmp$")


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return "?"
    # the command name (field 2) may hold spaces and parentheses: fields after the last ')'
    return stat.rsplit(")", 1)[-1].split()[19]


def this_writer() -> str:
    """This process's writer name (computed on each call: a forked child is another writer)."""
    pid = os.getpid()
    return f"{pid}:{_start_time(pid)}"


def alive(writer: str | None) -> bool:
    """Whether the process named ``writer`` still runs (``False`` for a malformed name)."""
    if not writer or ":" not in writer:
        return False
    pid_s, start = writer.split(":", 1)
    if not pid_s.isdigit():
        return False
    pid = int(pid_s)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # exists, another user's
        pass
    return start == "?" or _start_time(pid) in (start, "?")


def tmp_name(final: str, token: str) -> str:
    """The name a write in flight has: the final name, the writer's pid and a unique token."""
    return f"{final}.{os.getpid()}-{token}.tmp"


def tmp_owner(name: str) -> int | None:
    """The pid that is writing the ``.tmp`` file ``name``, ``None`` for a name in no such form."""
    m = _TMP.search(name)
    return int(m.group(1)) if m else None


def tmp_in_flight(name: str) -> bool:
    """Whether ``name`` is another running process's write in flight (leave it alone)."""
    pid = tmp_owner(name)
    if pid is None or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
