"""Files as a benchmark handles them, with nothing but the standard library (so LMCache's own
environment can import it too): drop their page cache, damage them for the reliability probes."""

from __future__ import annotations

import os
from collections.abc import Sequence


def drop_cache(paths: Sequence[str | os.PathLike]) -> str:
    """Drop the page cache: all of it as root (``/proc/sys/vm/drop_caches``), else
    ``posix_fadvise(DONTNEED)`` of each file after an fsync. Returns which was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def damage(path: str | os.PathLike, how: str) -> None:
    """``flip``: invert the byte in the middle of the file; ``truncate``: cut it to half."""
    size = os.path.getsize(path)
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))
    elif how == "truncate":
        os.truncate(path, size // 2)
    else:
        raise ValueError(f"unknown damage {how!r}")
