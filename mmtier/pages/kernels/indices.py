"""The kernels' int32 index arrays: their dtype, and host-built ones moved to a device in one
non-blocking copy (``upload_ints``). Attention's operand tables (``attention/kernels/layout.py``)
and the write kernels' page ids and slot offsets both are such arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INDEX_DTYPE = torch.int32
ALIGN_INTS = 4    # 16 bytes of int32


def upload_ints(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU int32 ``tensors`` on ``device``: the same tensors on the CPU; on a GPU, packed into
    one pinned buffer and copied in one non-blocking transfer (the host never waits; the
    caching host allocator keeps the buffer alive until the copy has run)."""
    if device.type == "cpu":
        return list(tensors)
    # each tensor starts 16-byte aligned in the buffer: Triton specializes kernels on pointer
    # alignment, so unaligned views would compile new variants as table sizes change
    starts, at = [], 0
    for t in tensors:
        starts.append(at)
        at += -(-t.numel() // ALIGN_INTS) * ALIGN_INTS
    flat = torch.zeros(at, dtype=INDEX_DTYPE, pin_memory=device.type == "cuda")
    for t, start in zip(tensors, starts):
        flat[start:start + t.numel()] = t.reshape(-1)
    on_dev = flat.to(device, non_blocking=True)
    return [on_dev[start:start + t.numel()].view(t.shape) for t, start in zip(tensors, starts)]
