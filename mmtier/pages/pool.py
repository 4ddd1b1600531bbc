"""Pages on a device: one arena allocated once, carved into one ``PagePool`` per modality spec.

Mechanism only: a pool allocates, frees and counts references, and knows nothing of modalities
or policies. A pool's view is page-major, ``[num_pages, *spec.page_shape]``, so one page is one
contiguous chunk that one copy spills or ships. Allocation and free are O(1) per page (a stack
of free ids); batched forms move many ids at once.
"""

from __future__ import annotations

import torch

from ..config import CacheConfig, ModalitySpec
from ..errors import CapacityError, ConfigError, MMTierError
from .gpu_memory import free_bytes

_ALIGN = 256


class PagePool:
    """Fixed pages of one spec over a slice of an arena; free stack plus reference counts."""

    def __init__(self, spec: ModalitySpec, storage: torch.Tensor):
        """``storage``: a flat uint8 tensor whose length is a multiple of ``spec.page_bytes``."""
        self.spec = spec
        self.num_pages = storage.numel() // spec.page_bytes
        flat = storage[: self.num_pages * spec.page_bytes]
        self.view = flat.view(spec.torch_dtype).view(self.num_pages, *spec.page_shape)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._refs: list[int] = [0] * self.num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def device(self) -> torch.device:
        return self.view.device

    def allocate(self, n: int) -> list[int]:
        """``n`` pages with reference count 1, or ``CapacityError`` (nothing taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise CapacityError(
                f"{self.spec.name} pool: {n} pages wanted, {len(self._free)} of {self.num_pages} free")
        if n == 0:
            return []
        ids = self._free[-n:]
        del self._free[-n:]
        ids.reverse()
        refs = self._refs
        for i in ids:
            refs[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        refs = self._refs
        if ids and (min(ids) < 0 or max(ids) >= self.num_pages):
            raise MMTierError(f"{self.spec.name} pool: page id out of range")
        if any(refs[i] <= 0 for i in ids):
            raise MMTierError(f"{self.spec.name} pool: incref of a free page")
        for i in ids:
            refs[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero go back to the free stack.

        Validated before anything changes: a double free raises and frees nothing."""
        refs = self._refs
        if ids and (min(ids) < 0 or max(ids) >= self.num_pages):
            raise MMTierError(f"{self.spec.name} pool: page id out of range")
        if any(refs[i] <= 0 for i in ids) or (len(ids) > 1 and len(set(ids)) != len(ids)):
            raise MMTierError(f"{self.spec.name} pool: double free or free of a free page")
        released = []
        for i in reversed(ids):
            refs[i] -= 1
            if refs[i] == 0:
                released.append(i)
        self._free.extend(released)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def page_bytes_used(self) -> int:
        return self.num_used * self.spec.page_bytes


class DeviceArena:
    """One allocation on a device, carved into one pool per modality."""

    def __init__(self, cfg: CacheConfig, arena_bytes: int | None = None):
        self.device = torch.device(cfg.device)
        nbytes = arena_bytes if arena_bytes is not None else resolve_arena_bytes(cfg)
        plan = cfg.pool_bytes(nbytes)
        sizes = {}
        offset = 0
        for name, spec in cfg.modalities.items():
            start = -(-offset // _ALIGN) * _ALIGN          # alignment comes out of the budget
            room = max(0, min(plan[name] - (start - offset), nbytes - start))
            pages = room // spec.page_bytes
            if pages == 0:
                # refused here, before anything is allocated: a pool of no pages builds and then
                # fails in the middle of a request with a CapacityError
                raise ConfigError(
                    f"device_bytes: the {name!r} pool gets {room} of the arena's {nbytes} bytes, "
                    f"less than one page ({spec.page_bytes} bytes: {spec.page_size} tokens); "
                    f"raise device_bytes or modalities.{name}.share", ("device_bytes", f"modalities.{name}"))
            sizes[name] = (start, pages * spec.page_bytes)
            offset = start + pages * spec.page_bytes
        self.nbytes = offset
        self.storage = torch.empty(max(offset, 1), dtype=torch.uint8, device=self.device)
        self.pools: dict[str, PagePool] = {
            name: PagePool(cfg.modalities[name], self.storage[start:start + length])
            for name, (start, length) in sizes.items()
        }

    def __getitem__(self, modality: str) -> PagePool:
        return self.pools[modality]


def resolve_arena_bytes(cfg: CacheConfig) -> int:
    """``device_bytes`` when set, else the configured fraction of the free memory of the GPU
    behind ``cfg.device`` (``gpu_memory.free_bytes``: the physical GPU it maps to under
    ``CUDA_VISIBLE_DEVICES``)."""
    if cfg.device_bytes is not None:
        return cfg.device_bytes
    return int(free_bytes(cfg.device) * cfg.device_fraction)
