"""The page-write kernels, and what attention's kernels share with them.

``write_kv`` scatters new tokens' K/V into their pages: ``backend="auto"`` runs Triton
(``triton_write``) on CUDA tensors and the torch path (``torch_write``: index copies) on CPU
tensors; ``"triton"`` forces Triton (on CPU tensors only under ``TRITON_INTERPRET=1``);
``"torch"`` forces the torch path. Triton is imported lazily: importing this package needs
neither triton nor a GPU (and never imports Ray).

Shared with the attention kernels (``mmtier.attention.kernels``, a layer above, which import
them from here): the choice of backend (``BACKENDS``, ``triton_available``, ``uses_triton``),
what every Triton launch shares (``launch``: a GPU's choices, the interpreter's guard) and the
int32 index arrays (``indices``: ``INDEX_DTYPE``, ``upload_ints``).
"""

from __future__ import annotations

import torch

from ...errors import ConfigError, DTypeError
from .indices import INDEX_DTYPE, upload_ints
from .torch_write import write_kv_torch

BACKENDS = ("auto", "triton", "torch")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

__all__ = ["BACKENDS", "INDEX_DTYPE", "triton_available", "upload_ints", "uses_triton", "write_kv"]


def triton_available() -> bool:
    """Whether ``import triton`` works in this process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def uses_triton(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs the Triton kernels for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}", fields=("backend",))
    if backend == "torch":
        return False
    if backend == "auto" and device.type != "cuda":
        return False
    if not triton_available():
        if backend == "triton":
            raise ConfigError("backend 'triton' needs the triton package", fields=("backend",))
        return False
    return True


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor,
             offsets: torch.Tensor, *, backend: str = "auto") -> None:
    """Scatter ``k, v [num_layers, n, Hkv, D]`` into the page-major pool view ``kv``: token
    ``i`` to page ``page_ids[i]``, slot ``offsets[i]``, in every layer. In place. The int32
    indices may be on ``kv``'s device or on the CPU (built on the host: the Triton path checks
    them there and uploads them without a device sync)."""
    if uses_triton(backend, kv.device):
        from .triton_write import write_kv_triton

        if kv.dtype in FP8_DTYPES and k.dtype == v.dtype == kv.dtype:   # fp8 into fp8: a copy of bytes
            kv, k, v = kv.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        elif kv.dtype in FP8_DTYPES:
            raise DTypeError(f"fp8 pages take fp8 K/V of their own format ({kv.dtype}), got {k.dtype} / {v.dtype}")
        write_kv_triton(kv, k, v, page_ids, offsets)
        return
    write_kv_torch(kv, k, v, page_ids.to(kv.device), offsets.to(kv.device))
