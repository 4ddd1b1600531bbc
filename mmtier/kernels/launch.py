"""Launching Triton kernels from several threads.

Compiled launches are thread-safe. Triton's interpreter (``TRITON_INTERPRET=1``: the kernels run
in Python on the CPU, as in the tests) is not: it keeps the running program's grid and semantic
state process-wide, and two threads launching at once fail with ``InterpreterError`` (measured:
8 threads sharing a cache fail within seconds). Under the interpreter ``launch_guard`` serializes
launches; compiled, it costs nothing.
"""

from __future__ import annotations

import os
import threading
from contextlib import AbstractContextManager, nullcontext

_INTERPRETER_LOCK = threading.Lock()


def launch_guard(device_type: str) -> AbstractContextManager:
    """The context to launch a kernel in: the interpreter's lock for a CPU tensor under
    ``TRITON_INTERPRET=1``, else nothing."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        return _INTERPRETER_LOCK
    return nullcontext()
