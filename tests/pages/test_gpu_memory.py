"""The arena is sized from the GPU behind the torch device, not NVML's GPU of the same index:
``visible_gpu`` maps ``cuda:i`` under ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs, prefixes, an
invalid entry ending the list) to NVML's device. No GPU here: NVML's side is a stand-in module
with four GPUs of different free memory (the real pynvml runs where there is a GPU:
``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

import sys
import types

import pytest

from mmtier import CacheConfig, ModalitySpec
from mmtier.errors import CapacityError
from mmtier.pages.gpu_memory import NvmlDevice, visible_gpu
from mmtier.pages.pool import resolve_arena_bytes

GPUS = [NvmlDevice(i, f"GPU-{i}{i}aa{i}-0000-1111-2222-33334444555{i}") for i in range(4)]
FREE = [10 << 30, 20 << 30, 30 << 30, 40 << 30]


def test_unset_means_every_gpu_in_nvml_order():
    assert [visible_gpu(i, None, GPUS).index for i in range(4)] == [0, 1, 2, 3]
    with pytest.raises(CapacityError):
        visible_gpu(4, None, GPUS)


def test_indices_are_remapped():
    assert visible_gpu(0, "2,3", GPUS) == GPUS[2]
    assert visible_gpu(1, "2,3", GPUS) == GPUS[3]
    assert visible_gpu(0, " 3 , 1", GPUS) == GPUS[3]
    with pytest.raises(CapacityError):
        visible_gpu(2, "2,3", GPUS)          # only two are visible


def test_uuids_and_unique_prefixes():
    assert visible_gpu(0, GPUS[1].uuid, GPUS) == GPUS[1]
    assert visible_gpu(1, f"{GPUS[3].uuid},{GPUS[0].uuid[:8]}", GPUS) == GPUS[0]
    with pytest.raises(CapacityError):       # "GPU-" alone is the prefix of every GPU: invalid
        visible_gpu(0, "GPU-", GPUS)


def test_the_list_ends_at_an_invalid_entry():
    assert visible_gpu(0, "1,7,2", GPUS) == GPUS[1]
    with pytest.raises(CapacityError):
        visible_gpu(1, "1,7,2", GPUS)
    with pytest.raises(CapacityError):
        visible_gpu(0, "", GPUS)             # set and empty: no GPU visible
    with pytest.raises(CapacityError):
        visible_gpu(0, "MIG-1234", GPUS)     # a MIG slice's memory is not its GPU's


class _Handle:
    def __init__(self, dev: NvmlDevice):
        self.dev = dev


def _fake_nvml() -> types.ModuleType:
    """NVML's calls the sizing makes, over ``GPUS`` (a stand-in: no GPU on this machine)."""
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(GPUS)
    m.nvmlDeviceGetHandleByIndex = lambda i: _Handle(GPUS[i])
    m.nvmlDeviceGetUUID = lambda h: h.dev.uuid.encode()
    m.nvmlDeviceGetHandleByUUID = lambda u: _Handle(next(d for d in GPUS if d.uuid == (u.decode() if isinstance(u, bytes) else u)))
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(free=FREE[h.dev.index], total=FREE[h.dev.index] * 2)
    return m


@pytest.mark.parametrize("visible, device, gpu", [("2,3", "cuda:1", 3), ("3", "cuda:0", 3), (None, "cuda:2", 2),
                                                  (GPUS[1].uuid, "cuda", 1)])
def test_arena_sized_from_the_visible_gpu(monkeypatch, visible, device, gpu):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml())
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = CacheConfig(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32",
                      modalities={"text": ModalitySpec(page_size=16)}, device=device, device_fraction=0.5)
    assert resolve_arena_bytes(cfg) == FREE[gpu] // 2
