"""mmtier's C helpers, built with the system C compiler on first use and loaded with ctypes.

A helper is one C file beside this one (no Python API, plain functions over addresses; the
headers beside it are shared). It is compiled once per source text (headers included), compiler
and machine into a cache directory
(``MMTIER_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/mmtier/native``, else ``~/.cache/mmtier/native``)
and reused by every later process. Where no compiler is found, the build fails, or
``MMTIER_NATIVE=0`` is set, ``library`` returns ``None`` and callers take their torch path:
the helpers make copies faster, never different.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    return os.environ.get("MMTIER_NATIVE", "1") != "0"


def cache_dir() -> Path:
    if os.environ.get("MMTIER_NATIVE_CACHE"):
        return Path(os.environ["MMTIER_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmtier" / "native"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def library(name: str) -> ctypes.CDLL | None:
    """The loaded helper ``name`` (``name.c`` beside this file), building it when needed; ``None``
    where native helpers are off or cannot be built here (logged once)."""
    if not enabled():
        return None
    lib = _loaded.get(name, _loaded)        # loaded before: no lock (a copy's hot path asks)
    if lib is not _loaded:
        return lib
    with _lock:
        if name in _loaded:
            return _loaded[name]
        _loaded[name] = lib = _build_and_load(name)
        return lib


def _build_and_load(name: str) -> ctypes.CDLL | None:
    source = _HERE / f"{name}.c"
    cc = _compiler()
    if cc is None:
        log.info("mmtier native %s: no C compiler found; using the torch path", name)
        return None
    text = b"".join([source.read_bytes(), *(h.read_bytes() for h in sorted(_HERE.glob("*.h")))])
    tag = hashlib.sha256(b"\0".join([text, cc.encode(), " ".join(FLAGS).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    target = cache_dir() / f"lib{name}-{tag}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], check=True, timeout=120,
                               capture_output=True)
                os.replace(tmp, target)       # atomic: a concurrent builder's file is as good
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("mmtier native %s: build or load failed (%s %s); using the torch path",
                    name, exc, detail.decode(errors="replace")[-500:])
        return None
