"""``EngineSurface``: what an engine's model runner calls once per layer on a ``TieredKVCache``:
per-layer writes (``reserve`` / ``write_layer``, sealed into a shared group by ``seal``) and one
attention call for a batch of sequences (``attention_batch``, planned and run by
``attention.batch_planner.BatchPlanner``, which holds the step plans). Used by the transformers
adapter and the vLLM / SGLang connectors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from ..attention.batch_planner import BatchPlanner
from ..attention.planner import AttentionPlanner
from ..config import CacheConfig
from ..content import ContentKey, tenant_scope
from ..core.groups import Tier
from ..core.segments import SequenceHandle, naming
from ..errors import ForeignKeyError, ShapeError, UnknownKeyError, UnknownModalityError
from ..eviction import EvictionPolicy
from ..pages.layer_writes import Reservation, write_one_layer
from ..pages.payload import token_identity
from ..tiers.residency import Residency
from .group_index import GroupIndex
from .keys import CacheKeys
from .sequences import Sequences


class EngineSurface:
    """Per-layer writes and batched attention (see the module's docstring)."""

    def __init__(self, cfg: CacheConfig, keyer: CacheKeys, index: GroupIndex,
                 seqs: Sequences, residency: Residency, planner: AttentionPlanner,
                 policy: EvictionPolicy):
        self.cfg, self.keyer, self.index, self.lock = cfg, keyer, index, residency.lock
        self.seqs, self.residency, self.planner, self.policy = seqs, residency, planner, policy
        self.batches = BatchPlanner(seqs, residency, planner, policy)
        self.steps = self.batches.steps        # batch plans, reused by the other layers of a step

    def reserve(self, seq: SequenceHandle, modality: str, n: int, *,
                tokens: Sequence[int] | None = None, new_run: bool = False) -> Reservation:
        """``TieredKVCache.reserve`` (its contract is documented there)."""
        self.residency.check_open()
        spec = self.cfg.spec(modality)
        if spec.kind != "kv":
            raise UnknownModalityError(f"modality {modality!r} holds embeddings; use put_embedding")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ShapeError(f"reserve needs n > 0 tokens, got {n!r}")
        if tokens is not None and len(tokens) != n:
            raise ShapeError(f"{len(tokens)} token ids for {n} tokens")
        identity = token_identity(modality, None, None, tokens) if tokens is not None else \
            b"unique:" + os.urandom(16)
        with self.lock:
            self.residency.apply_copies()
            growth = self.seqs.grow(self.seqs.table(seq), modality, spec, n, new_run)
            group = self.seqs.commit_growth(growth, identity)
            group.pins += 1
            res = Reservation(group, growth.pool, growth.page_ids, growth.offsets, n)
            table = growth.table
            table.open_runs = [r for r in table.open_runs if r.open] + [res]
            return res

    def write_layer(self, res: Reservation, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``TieredKVCache.write_layer`` (its contract is documented there)."""
        self.residency.check_open()
        with self.lock:
            write_one_layer(res, layer, k, v, self.planner.backend())
            if res.complete:
                res.open = False
                res.group.pins -= 1

    def seal(self, seq: SequenceHandle, key: ContentKey, run: Reservation | None = None) -> bool:
        """``TieredKVCache.seal`` (its contract is documented there)."""
        self.keyer.check_key(key, "kv")
        with self.lock:
            table = self.seqs.table(seq)
            if key.scope != tenant_scope(self.keyer.salt(seq.tenant)):
                raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
            if run is None:
                group = table.tail.group if table.tail is not None else None
                which = "its last run"
            else:
                if not isinstance(run, Reservation):
                    raise ShapeError(f"run must be a Reservation of sequence {seq.id}, got {type(run).__name__}")
                group = run.group if any(s.group is run.group for s in table.segments) else None
                which = "the reserved run"
                if group is None:
                    raise UnknownKeyError(f"the reservation is not a run of sequence {seq.id}")
            if group is None or group.key is not None or group.modality != key.modality:
                raise UnknownKeyError(f"sequence {seq.id}: {which} is no private {key.modality} run to seal")
            if group.pins:
                raise ShapeError(f"sequence {seq.id}: {which} is still being written")
            index = next(i for i, s in enumerate(table.segments) if s.group is group)
            self.keyer.check_place(seq, table, key, table.segments[index].before)
            names = naming(key, table.segments[index].before)
            if names is not None:
                table.name_segment(index, names)       # what follows may chain it, held or not
            if key in self.index or group.tier != Tier.DEVICE:
                return False                      # held already, or moved down meanwhile
            self.index.name(key, group)
            return True

    def attention_batch(self, seqs: Sequence[SequenceHandle], layer: int, q: torch.Tensor,
                        q_indptr: torch.Tensor | Sequence[int], *,
                        groups: Sequence[Iterable[ContentKey] | None] | None = None,
                        causal: bool = True, scale: float | None = None) -> torch.Tensor:
        """``TieredKVCache.attention_batch`` (``BatchPlanner.attention_batch``)."""
        return self.batches.attention_batch(seqs, layer, q, q_indptr, groups=groups, causal=causal,
                                            scale=scale)

    def attention_batch_state(self, seqs: Sequence[SequenceHandle], layer: int, q: torch.Tensor,
                              q_indptr: torch.Tensor | Sequence[int], *,
                              groups: Sequence[Iterable[ContentKey] | None] | None = None,
                              causal: bool = True, scale: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``TieredKVCache.attention_batch_state`` (``BatchPlanner.attention_batch_state``)."""
        return self.batches.attention_batch_state(seqs, layer, q, q_indptr, groups=groups,
                                                  causal=causal, scale=scale)
