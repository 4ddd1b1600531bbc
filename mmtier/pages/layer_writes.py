"""Writes that arrive one layer at a time (an engine's decoder runs layer by layer).

``TieredKVCache.reserve`` adds ``n`` tokens to a sequence (pages allocated, the run pinned to the
device) and returns a ``Reservation``; ``write_layer`` fills one layer of those tokens straight
from the engine's tensor (``k, v [n, num_kv_heads, head_dim]``), so no second copy of all layers
is ever kept. The reservation unpins the run once every layer is written, or when its sequence
is released first (a step that failed part-way: its pages go back with the sequence's).
Attention at layer ``l`` reads the tokens whose layer ``l`` is written: an engine writes layer
``l`` before it attends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.groups import ModalityGroup
from ..errors import ShapeError
from .kernels import uses_triton, write_kv
from .kernels.torch_write import LayerRows, layer_rows, write_layer_rows
from .payload import check_payload
from .pool import PagePool


@dataclass(eq=False)
class Reservation:
    """``n`` tokens of a sequence's run, their page slots, and the layers written so far."""

    group: ModalityGroup
    pool: PagePool
    page_ids: torch.Tensor          # int32 [n] on the pool's device
    offsets: torch.Tensor           # int32 [n] on the pool's device
    num_tokens: int
    written: set[int] = field(default_factory=set)
    open: bool = True
    rows: LayerRows | None = None   # the torch path's row map, built at the first layer written

    @property
    def complete(self) -> bool:
        return len(self.written) == self.pool.spec.num_layers


def write_one_layer(res: Reservation, layer: int, k: torch.Tensor, v: torch.Tensor, backend: str) -> None:
    """Validate ``k, v [n, num_kv_heads, head_dim]`` for ``layer`` and write them into the slots."""
    spec = res.pool.spec
    if not res.open:
        raise ShapeError("this reservation is finished (every layer written, or its sequence released)")
    if not 0 <= layer < spec.num_layers:
        raise ShapeError(f"layer {layer} out of range for {spec.name!r} ({spec.num_layers} layers)")
    if layer in res.written:
        raise ShapeError(f"layer {layer} of this reservation is already written")
    want = (res.num_tokens, spec.num_kv_heads, spec.head_dim)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            raise ShapeError(f"{spec.name}: {name} must be {list(want)}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        check_payload(spec, t)
    dev = res.pool.device
    if not uses_triton(backend, dev):
        if res.rows is None:
            res.rows = layer_rows(res.pool.view, res.page_ids, res.offsets)
        if res.rows is not None:
            write_layer_rows(res.rows, layer, k.to(dev), v.to(dev))
            res.written.add(layer)
            return
    write_kv(res.pool.view[:, layer:layer + 1], k.unsqueeze(0).to(dev), v.unsqueeze(0).to(dev),
             res.page_ids, res.offsets, backend=backend)
    res.written.add(layer)
