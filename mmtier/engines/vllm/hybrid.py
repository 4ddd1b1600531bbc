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
KV per position. With vLLM's prefix caching on, vLLM runs them in its ``align`` mode: prefill
steps end on block boundaries and the state after position ``e`` (a multiple of the block size)
lies in the layer's block ``e // block_size - 1`` of that group's table. vLLM's allocator puts
as many layers in each group as the smallest kind has (Qwen3-Next's 3 linear : 1 full makes
three recurrent groups and one attention group), so there may be several recurrent groups, each
with its own table. mmtier keeps the state of all recurrent layers together (``StateCopy``; one
embedding pool per state tensor, keyed by the group that ends at ``e``: ``KeyMaker.state``),
each layer's rows read from, and written to, its own group's block; saved where a step ends on a
group's end, and a hit ends only where a state is held: the KV of every attention layer up to
``e`` and the state at ``e`` restore the request exactly. Other modes are refused with the
setting to change (``kv_groups``).

Generated tokens (decode saves, ``scheduler._decode_saves``) take the same paths: a decode
group's layers are read through their own groups' tables when the step after its last block
starts (within the window: vLLM frees a sliding block once it is a whole window behind the next
token), and its state with it. In mode ``align`` vLLM keeps the state after ``e`` tokens in
block ``e // block_size - 1`` from the step that ends at ``e`` until the step after the next is
scheduled, then frees it: a chunk flushed in the first of those steps reads it there; a
request that finishes or is preempted later saves its last part with the worker's copy of the
state taken where a decode step last ended on a block boundary (``state_marks``), or without a
state (its hit then stops before it).
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

from ...errors import ConfigError, MMTierError
from . import copy as vllm_copy

log = logging.getLogger(__name__)
NULL_BLOCK = 0          # vLLM's BlockPool hands out block 0 as the null block, never to a request


@dataclass(frozen=True)
class StateCopy:
    """The recurrent state after positions ``[0, end)`` of a request, the state after ``key``'s
    group: ``blocks`` holds vLLM's state block of each recurrent KV cache group
    (``KVGroups.state_groups`` order; ``-1``: vLLM gave none, the load fails)."""

    req_id: str
    key: Any
    end: int
    blocks: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """Every recurrent group has its block."""
        return bool(self.blocks) and min(self.blocks) >= 0


@dataclass(frozen=True)
class KVGroups:
    """The KV cache groups of a hybrid engine: which group each attention layer is in, each
    group's sliding window (``None``: full attention or a recurrent group), the recurrent
    groups, and their layers (group by group) with each one's place in ``state_groups``."""

    layer_group: dict[str, int]
    windows: tuple[int | None, ...]
    state_layers: tuple[str, ...] = ()
    state_groups: tuple[int, ...] = ()
    state_layer_group: tuple[int, ...] = ()      # per state layer: its index in state_groups

    @property
    def count(self) -> int:
        return len(self.windows)

    def describe(self) -> str:
        kinds = ["recurrent" if i in self.state_groups else "full" if w is None else f"sliding {w}"
                 for i, w in enumerate(self.windows)]
        return ", ".join(f"group {i}: {k}" for i, k in enumerate(kinds))

    def layer_blocks(self, op: StateCopy) -> list[int]:
        """vLLM's block of each state layer (``state_layers`` order) for ``op``."""
        return [op.blocks[g] for g in self.state_layer_group]


def _refuse_state(spec: Any, layers: int, mode: Any, prefix_caching: bool | None) -> ConfigError:
    """Why a recurrent group in ``mode`` cannot be served, with the setting that fixes it."""
    what = (f"this model's recurrent layers ({type(spec).__name__}, {layers} in this KV cache group) run in "
            f"vLLM's mamba_cache_mode {mode!r}")
    if prefix_caching is not True and mode in (None, "none"):
        return ConfigError(f"{what}: a request's state moves between blocks as it runs, so mmtier cannot find "
                           "it by position; turn vLLM's prefix caching on (enable_prefix_caching=True: vLLM "
                           "then runs them in mamba_cache_mode 'align', the state after each block in a block "
                           "of its own), or serve the model without the connector",
                           ("kv_connector", "enable_prefix_caching"))
    return ConfigError(f"{what}, prefix caching on; mmtier's connector reads states laid out by mode 'align' "
                       "(the state after each block in a block of its own): set mamba_cache_mode='align' "
                       "(--mamba-cache-mode align), or serve the model without the connector",
                       ("kv_connector", "mamba_cache_mode"))


def kv_groups(kv_cache_config: Any, prefix_caching: bool | None = None) -> KVGroups | None:
    """The groups of ``kv_cache_config`` where there are several (vLLM's hybrid allocator on);
    ``None`` for one group (every layer shares one block table: the connector's plain path).
    Recurrent groups (Mamba, linear attention) in any number are state groups where vLLM runs
    them in mode ``align``; another mode, recurrent groups whose states differ in shape, or a
    group of another kind raise ``ConfigError`` naming the group's kind and the setting
    (``prefix_caching``: vLLM's ``enable_prefix_caching``, ``None`` where not known)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return None
    layer_group, windows, state_layers, state_groups, state_layer_group = {}, [], [], [], []
    first_state = None
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if hasattr(spec, "shapes") and hasattr(spec, "dtypes"):        # Mamba / linear attention
            mode = getattr(spec, "mamba_cache_mode", None)
            if mode != "align":
                raise _refuse_state(spec, len(group.layer_names), mode, prefix_caching)
            shape = (type(spec).__name__, tuple(map(tuple, spec.shapes)), tuple(map(str, spec.dtypes)))
            if first_state is None:
                first_state = shape
            elif shape != first_state:      # one pool per state tensor holds every layer's rows
                raise ConfigError(f"this model's recurrent KV cache groups hold states of different shapes "
                                  f"({first_state} and {shape}): mmtier's connector keeps one shape per state "
                                  "tensor; serve the model without the connector", ("kv_connector", "model"))
            state_layers += list(group.layer_names)
            state_layer_group += [len(state_groups)] * len(group.layer_names)
            state_groups.append(index)
            windows.append(None)
            continue
        if not (hasattr(spec, "head_size") and hasattr(spec, "num_kv_heads")):
            raise ConfigError(f"a KV cache group of {type(spec).__name__} ({len(group.layer_names)} layers) "
                              "is neither attention nor a recurrent state: mmtier's connector does not "
                              "serve it", ("kv_connector", "model"))
        windows.append(getattr(spec, "sliding_window", None))
        for name in group.layer_names:
            layer_group[name] = index
    return KVGroups(layer_group, tuple(windows), tuple(state_layers), tuple(state_groups),
                    tuple(state_layer_group))


def state_rows(views: list[tuple[torch.Tensor, ...]], blocks: list[int], index: int) -> torch.Tensor:
    """State tensor ``index`` of every recurrent layer, each at its own group's block
    (``blocks[i]`` for ``views[i]``), as ``[layers * rows, width]`` (a copy: vLLM's block is
    written again later)."""
    return torch.cat([layer[index][b].reshape(-1, layer[index].shape[-1]) for layer, b in zip(views, blocks)])


def put_state_rows(views: list[tuple[torch.Tensor, ...]], blocks: list[int], index: int,
                   rows: torch.Tensor) -> None:
    """The inverse of ``state_rows``: ``rows`` into every recurrent layer's block ``blocks[i]``."""
    per_layer = rows.shape[0] // len(views)
    for i, (layer, b) in enumerate(zip(views, blocks)):
        dst = layer[index][b]
        dst.copy_(rows[i * per_layer:(i + 1) * per_layer].reshape(dst.shape).to(dst.device))


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
                 head_dim: int, read_state: Callable[[Any, int], torch.Tensor] | None = None,
                 groups: KVGroups | None = None):
        self._reader, self._read, self._head_dim, self._groups = reader, read, head_dim, groups
        self._read_state = read_state             # (state op's key, state index) -> rows
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}        # request -> groups still loading
        self._failed: set[str] = set()            # requests with a group that did not load
        self._done: set[str] = set()              # loaded (or failed), not yet reported
        self._ever: set[str] = set()              # requests that had a load (their blocks wait for it)
        self._finishing: set[str] = set()         # finished by vLLM, their load not over yet
        self._released: set[str] = set()          # finished and load over: blocks may go

    def submit(self, ops: list, layers: list[tuple[torch.Tensor, int]], key_of: Callable[[Any], Any],
               states: list[StateCopy] = (), views: list[tuple[torch.Tensor, ...]] = ()) -> None:
        """Load every op (``meta.GroupCopy`` with ``group_slots``) into ``layers``
        (``(tensor, group)`` in the cache's layer order), and every state into ``views`` (the
        recurrent layers' state tensors)."""
        with self._lock:
            for op in [*ops, *states]:
                self._pending[op.req_id] = self._pending.get(op.req_id, 0) + 1
                self._ever.add(op.req_id)
        for op in ops:
            self._reader.submit(self._load, op, layers, key_of(op.key))
        for op in states:
            self._reader.submit(self._load_state, op, views)

    def _load_state(self, op: StateCopy, views: list[tuple[torch.Tensor, ...]]) -> None:
        ok = True
        try:
            if not op.whole or not views or self._read_state is None or self._groups is None:
                raise MMTierError(f"no state block for the hit ending at {op.end}")
            rows = [self._read_state(op.key, i) for i in range(len(views[0]))]   # all read, then written
            blocks = self._groups.layer_blocks(op)
            with torch.inference_mode():
                for i, r in enumerate(rows):
                    put_state_rows(views, blocks, i, r)
        except (MMTierError, OSError, RuntimeError) as exc:
            log.warning("mmtier: load of the state after %r failed (%s); vLLM recomputes the request", op.key, exc)
            ok = False
        self._settle(op.req_id, ok)

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
        self._settle(op.req_id, ok)

    def _settle(self, req_id: str, ok: bool) -> None:
        with self._lock:
            if not ok:
                self._failed.add(req_id)
            self._pending[req_id] -= 1
            if self._pending[req_id] == 0:
                del self._pending[req_id]
                self._done.add(req_id)
                if req_id in self._finishing:
                    self._finishing.discard(req_id)
                    self._released.add(req_id)

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
