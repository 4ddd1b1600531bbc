"""Free memory of the GPU behind a torch device, for sizing the page arena.

NVML numbers GPUs physically (by PCI bus id); torch's ``cuda:i`` is the i-th device CUDA makes
visible, which ``CUDA_VISIBLE_DEVICES`` may remap (``"2,3"``: ``cuda:0`` is NVML's GPU 2) or name
by UUID. ``visible_gpu`` is that mapping as a pure function of the variable and NVML's device
list, so it is tested without a GPU; ``free_bytes`` asks NVML for the GPU it names, and falls back
to torch's ``mem_get_info``, which is per visible device already, where NVML cannot say.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CapacityError


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as NVML lists it: its NVML index and UUID (``GPU-...``)."""

    index: int
    uuid: str


def visible_gpu(cuda_index: int, visible: str | None, devices: Sequence[NvmlDevice]) -> NvmlDevice:
    """The physical GPU that CUDA calls device ``cuda_index`` under ``CUDA_VISIBLE_DEVICES =
    visible`` (``None``: unset, every GPU visible in NVML's order).

    Entries are NVML indices or UUIDs (a unique prefix, as CUDA accepts); as in CUDA, the list
    ends at the first entry that names no GPU. MIG instances (``MIG-...``) have memory of their
    own that the parent GPU's figure does not describe: refused (``CapacityError``), as is an index
    past the visible devices."""
    if cuda_index < 0:
        raise CapacityError(f"cuda:{cuda_index} is no device index")
    if visible is None:
        chosen = sorted(devices, key=lambda d: d.index)
    else:
        chosen = []
        for entry in (e.strip() for e in visible.split(",")):
            if entry.startswith("MIG-"):
                raise CapacityError(f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}): its memory is "
                                    "not its GPU's; set device_bytes")
            dev = _lookup(entry, devices)
            if dev is None or dev in chosen:
                break                    # CUDA stops at an invalid (or repeated) entry
            chosen.append(dev)
    if cuda_index >= len(chosen):
        raise CapacityError(f"cuda:{cuda_index} is not visible (CUDA_VISIBLE_DEVICES={visible!r}, "
                            f"{len(chosen)} visible of {len(devices)} GPUs)")
    return chosen[cuda_index]


def _lookup(entry: str, devices: Sequence[NvmlDevice]) -> NvmlDevice | None:
    if entry.isdigit():
        return next((d for d in devices if d.index == int(entry)), None)
    if entry.startswith("GPU-"):
        found = [d for d in devices if d.uuid.startswith(entry)]
        return found[0] if len(found) == 1 else None
    return None


def free_bytes(device: str) -> int:
    """Free memory of the GPU behind torch device ``device`` (``"cuda"`` / ``"cuda:i"``): NVML's
    figure for the physical GPU it maps to, else ``torch.cuda.mem_get_info``; ``CapacityError``
    when neither can say."""
    index = int(device.split(":")[1]) if ":" in device else 0
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            devices = [NvmlDevice(i, _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))))
                       for i in range(pynvml.nvmlDeviceGetCount())]
            gpu = visible_gpu(index, os.environ.get("CUDA_VISIBLE_DEVICES"), devices)
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML missing, failing, or unable to map: torch's own view
        import torch

        if not torch.cuda.is_available():
            raise CapacityError(f"cannot size the arena on {device}: {exc}") from exc
        return int(torch.cuda.mem_get_info(index)[0])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
