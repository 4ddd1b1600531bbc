"""vLLM's hybrid memory allocator (``SupportsHMA``) for models whose attention layers are of
several kinds: full attention and sliding-window attention (Gemma 2 / 3, Mistral-style
interleaving, gpt-oss).

With the hybrid allocator on, vLLM gives each kind of layer a KV cache group of its own, each
with its own block table: a sliding-window group frees the blocks that fall out of its window
and holds the *null block* (id 0) in their place. mmtier's groups stay what they are (a range
of the prompt, every layer's K and V); what differs is where each layer's positions live:

- **Saves** read each layer's positions through its own group's table. Text chunks are kept
  within the smallest window (``chunk_blocks_within``), so a chunk prefilled over two steps is
  whole when saved; a range a sliding layer has already let go (a media item longer than the
  window, prefilled over several steps) is not saved: a later miss, never a page with the null
  block's bytes.
- **Loads** write each layer only at positions its group holds: a sliding layer gets the last
  window of the hit, as vLLM's own prefix cache gives it, and nothing is written into the null
  block.
- **Loads run asynchronously** (vLLM's ``WAITING_FOR_REMOTE_KVS``): with several groups vLLM
  cannot map a failed block back to its request (block ids are per group) and accepts failures
  only as whole requests (``failed_recving``), which vLLM then recomputes. ``AsyncLoads`` reads
  a request's groups on the connector's reader thread, writes them into vLLM's tensors, and
  reports the request done or failed; a request that finishes while its load still writes
  keeps its blocks until the load is over (``finished_sending``).

Recurrent layers (Mamba, Gated DeltaNet in Qwen3-Next / Qwen3.5) keep a state per request, not
KV per position; mmtier does not store such states yet, and a model with them is refused at
start-up with that reason (vLLM without the connector serves it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, MMTierError
from . import vllm_copy

log = logging.getLogger(__name__)
NULL_BLOCK = 0          # vLLM's BlockPool hands out block 0 as the null block, never to a request


@dataclass(frozen=True)
class KVGroups:
    """The KV cache groups of a hybrid engine: which group each attention layer is in, and
    each group's sliding window (``None``: full attention)."""

    layer_group: dict[str, int]
    windows: tuple[int | None, ...]

    @property
    def count(self) -> int:
        return len(self.windows)

    def describe(self) -> str:
        kinds = ["full" if w is None else f"sliding {w}" for w in self.windows]
        return ", ".join(f"group {i}: {k}" for i, k in enumerate(kinds))


def kv_groups(kv_cache_config: Any) -> KVGroups | None:
    """The groups of ``kv_cache_config`` where there are several (vLLM's hybrid allocator on);
    ``None`` for one group (every layer shares one block table: the connector's plain path).
    A group of recurrent state (Mamba, linear attention) raises ``ConfigError``."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return None
    layer_group, windows = {}, []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if not (hasattr(spec, "head_size") and hasattr(spec, "num_kv_heads")):
            raise ConfigError(
                f"this model has layers that keep a recurrent state, not KV per position "
                f"({type(spec).__name__} for {len(group.layer_names)} layers, e.g. Qwen3-Next's Gated "
                "DeltaNet or Mamba): mmtier's connector stores attention KV only and does not store "
                "such states yet; serve the model without the connector (vLLM's own prefix cache "
                "keeps them)", ("kv_connector", "model"))
        windows.append(getattr(spec, "sliding_window", None))
        for name in group.layer_names:
            layer_group[name] = index
    return KVGroups(layer_group, tuple(windows))


def chunk_blocks_within(groups: KVGroups, block_size: int, chunk_blocks: int) -> int:
    """The text chunk (in vLLM blocks) no longer than the smallest sliding window: a chunk that
    spans a chunked-prefill step is then saved before its sliding layers let any of it go."""
    windows = [w for w in groups.windows if w]
    if not windows:
        return chunk_blocks
    return max(1, min(chunk_blocks, min(windows) // block_size))


def group_slots(tables: list[list[int]], lo: int, hi: int, block_size: int) -> torch.Tensor:
    """``[groups, hi - lo]`` vLLM slot ids of positions ``[lo, hi)`` in each group's block
    table; ``-1`` where the group holds the null block (a sliding window let it go) or no
    block at all."""
    pos = np.arange(lo, hi, dtype=np.int64)
    idx, off = pos // block_size, pos % block_size
    out = np.full((len(tables), hi - lo), -1, dtype=np.int64)
    for g, table in enumerate(tables):
        blocks = np.append(np.asarray(table, dtype=np.int64), NULL_BLOCK)    # past the table: none
        b = blocks[np.minimum(idx, len(blocks) - 1)]
        out[g] = np.where(b != NULL_BLOCK, b * block_size + off, -1)
    return torch.from_numpy(out)


class AsyncLoads:
    """Requests' loads on the reader thread, written into vLLM's tensors layer by layer at the
    positions each layer's group holds, and reported through ``finished`` (vLLM's
    ``get_finished`` / ``failed_recving``)."""

    def __init__(self, reader: Executor, read: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
                 head_dim: int):
        self._reader, self._read, self._head_dim = reader, read, head_dim
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}        # request -> groups still loading
        self._failed: set[str] = set()            # requests with a group that did not load
        self._done: set[str] = set()              # loaded (or failed), not yet reported
        self._ever: set[str] = set()              # requests that had a load (their blocks wait for it)
        self._finishing: set[str] = set()         # finished by vLLM, their load not over yet
        self._released: set[str] = set()          # finished and load over: blocks may go

    def submit(self, ops: list, layers: list[tuple[torch.Tensor, int]], key_of: Callable[[Any], Any]) -> None:
        """Load every op (``vllm.GroupCopy`` with ``group_slots``) into ``layers``
        (``(tensor, group)`` in the cache's layer order)."""
        with self._lock:
            for op in ops:
                self._pending[op.req_id] = self._pending.get(op.req_id, 0) + 1
                self._ever.add(op.req_id)
        for op in ops:
            self._reader.submit(self._load, op, layers, key_of(op.key))

    def _load(self, op, layers: list[tuple[torch.Tensor, int]], key) -> None:
        ok = True
        try:
            k, v = self._read(key)
            a, b = op.lo - op.start, op.hi - op.start
            with torch.inference_mode():              # vLLM's KV tensors are inference tensors
                for layer, (tensor, group) in enumerate(layers):
                    slots = op.group_slots[group]
                    keep = slots >= 0
                    if not bool(keep.any()):
                        continue
                    vllm_copy.scatter(tensor, slots[keep].to(tensor.device), self._head_dim,
                                      k[layer, a:b][keep].to(tensor.device), v[layer, a:b][keep].to(tensor.device))
        except (MMTierError, OSError, RuntimeError) as exc:
            log.warning("mmtier: load of %r failed (%s); vLLM recomputes the request", op.key, exc)
            ok = False
        with self._lock:
            if not ok:
                self._failed.add(op.req_id)
            self._pending[op.req_id] -= 1
            if self._pending[op.req_id] == 0:
                del self._pending[op.req_id]
                self._done.add(op.req_id)
                if op.req_id in self._finishing:
                    self._finishing.discard(op.req_id)
                    self._released.add(op.req_id)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(released, loaded, failed)`` since the last call: requests vLLM finished whose
        blocks may now be freed, requests whose load is over (failed ones included), and those
        of them that failed."""
        with self._lock:
            for req in finished_req_ids & self._ever:
                self._ever.discard(req)
                if req in self._pending:
                    self._finishing.add(req)
                else:
                    self._released.add(req)
            released, self._released = self._released, set()
            done, self._done = self._done, set()
            failed = self._failed & done
            self._failed -= done
        return released, done, failed

    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending)
