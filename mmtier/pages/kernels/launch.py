"""What every Triton launch shares: the GPU's choices, and the interpreter's quirks.

**The GPU's choices.** A launch wrapper picks tile sizes, warps, stages and the dot's dtype by
where it runs: ``gpu_choices(device)`` is true on CUDA, and anywhere inside ``as_on_gpu()``.
Tests run the interpreter inside it, so the configuration a GPU compiles (not only the wider
tiles the interpreter is fastest with) is checked against the oracle on a CPU; the compile
check (``benchmarks/kernels/kernel_compile.py``) drives the launch code with meta tensors inside it and
compiles what it would launch for sm_80 / sm_90 / sm_100.

**The interpreter** (``TRITON_INTERPRET=1``: the kernels run in Python on the CPU, as in the
tests):

- it is not thread-safe: it keeps the running program's grid and semantic state process-wide,
  and two threads launching at once fail with ``InterpreterError`` (measured: 8 threads sharing
  a cache fail within seconds). ``launch_guard`` serializes its launches; compiled, it costs
  nothing;
- its bfloat16 arithmetic is not a GPU's: it keeps bfloat16 in ``uint16`` arrays, so its
  ``tl.dot`` multiplies bfloat16 tiles as their bit patterns, and it truncates float32 to
  bfloat16 where a GPU rounds to nearest even (``cvt.rn.bf16.f32``). ``launch_guard`` makes
  both a GPU's: bfloat16 dot operands are widened to float32 first (exact: bfloat16 products,
  float32 sums, as an MMA does), and the float32 -> bfloat16 cast rounds to nearest even. The
  kernels then compute the same bfloat16 values on the CPU as on a GPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch

_INTERPRETER_LOCK = threading.Lock()
_AS_ON_GPU: ContextVar[bool] = ContextVar("mmtier_as_on_gpu", default=False)
_PATCHED = False


def gpu_choices(device: torch.device) -> bool:
    """Whether a launch on ``device`` makes a compiled GPU launch's choices (tiles, warps,
    stages, the dot's dtype): on CUDA, and on any device inside ``as_on_gpu()``."""
    return device.type == "cuda" or _AS_ON_GPU.get()


@contextmanager
def as_on_gpu() -> Iterator[None]:
    """Launches in this context (this thread / task) make the GPU's choices on any device."""
    token = _AS_ON_GPU.set(True)
    try:
        yield
    finally:
        _AS_ON_GPU.reset(token)


def interpreting(device_type: str) -> bool:
    """Whether a launch on ``device_type`` runs in Triton's interpreter."""
    return device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def launch_guard(device_type: str) -> AbstractContextManager:
    """The context to launch a kernel in: the interpreter's lock (its bfloat16 dot
    and cast made a GPU's) for a CPU tensor under ``TRITON_INTERPRET=1``, else nothing."""
    if interpreting(device_type):
        _gpu_bf16()
        return _INTERPRETER_LOCK
    return nullcontext()


def _gpu_bf16() -> None:
    """Patch the interpreter's builder, once per process: bfloat16 dot operands widened to
    float32, float32 -> bfloat16 rounded to nearest even."""
    global _PATCHED
    if _PATCHED:
        return
    with _INTERPRETER_LOCK:
        if _PATCHED:
            return
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        builder = interpreter.InterpreterBuilder
        dot, cast = builder.create_dot, builder.cast_impl

        def widen(x):
            if x.dtype.scalar != tl.bfloat16:
                return x
            bits = x.data.astype(np.uint32) << np.uint32(16)   # bfloat16 is float32's top half
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

        def create_dot(self, a, b, d, *args, **kwargs):
            return dot(self, widen(a), widen(b), d, *args, **kwargs)

        def cast_impl(self, src, dst_type):
            if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
                return cast(self, src, dst_type)
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            quiet = (bits >> np.uint32(16)) | np.uint32(0x40)         # NaN stays NaN
            out = np.where(np.isnan(src.data), quiet, rounded).astype(np.uint16)
            return interpreter.TensorHandle(out, dst_type.scalar)

        builder.create_dot, builder.cast_impl = create_dot, cast_impl
        _PATCHED = True
