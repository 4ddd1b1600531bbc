"""An independent replay of a prefix-hash trace: one group per block, the cache's policy classes.

The eviction benchmark (``eviction.py`` over ``policyreplay.py``) imports a trace into chain
groups, sizes byte pools and scores tokens; this module replays the published JSONL form
directly, with none of that code, as an outside check of it: every hash id is one group of one
page (``block_tokens`` tokens a page, so a partial last block takes a page too); the device tier
holds ``capacity`` blocks (``capacity_for``: a fraction of the distinct blocks of the requests
replayed); each request looks up its blocks in order (a found block counts a hit on the group,
as ``contains`` does), stores the missing ones (room made by ``policy.victims``, whole groups,
all or nothing: a block that cannot get a page is not stored, nor are the blocks after it),
attaches them (``refs``,
``on_access``) and releases them at the end (``on_release``). Its scores: the prefix-block hit
ratio (blocks of the longest cached prefix of each request over all its blocks) and the
recompute avoided (those blocks' tokens over all tokens: one modality, so seconds are tokens).

``tests/benchmarks/test_eviction_replay.py`` replays a trace both ways (this and ``policyreplay`` with
512-token pages and the same capacity) and checks they agree request by request.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mmtier.config import CacheConfig, ModalitySpec
from mmtier.content import ContentKey
from mmtier.core.groups import ModalityGroup, Tier
from mmtier.eviction import make_policy

KeyOf = Callable[[int], ContentKey]


@dataclass
class BlockScore:
    policy: str
    capacity: int
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    uncached: int = 0
    per_request: list[int] = field(default_factory=list)      # prefix-hit blocks of each request

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def avoided_fraction(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0


def read_records(path: str | Path, limit: int | None = None) -> list[dict]:
    out = []
    opened = gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8")
    with opened as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit is not None and len(out) == limit:
                    break
    return out


def capacity_for(records: Iterable[dict], fraction: float) -> int:
    """``fraction`` of the distinct blocks of ``records`` (at least one)."""
    return max(1, int(fraction * len({h for r in records for h in r["hash_ids"]})))


def stand_in_key(hash_id: int) -> ContentKey:
    digest = hashlib.sha256(b"block" + hash_id.to_bytes(8, "little", signed=True)).digest()
    return ContentKey(digest, "text", "prefix", bytes(16), bytes(32))


def block_replay(records: list[dict], policy: str, capacity: int, block_tokens: int = 512,
                 key_of: KeyOf = stand_in_key) -> BlockScore:
    """Replay ``records`` through a fresh ``policy`` over ``capacity`` one-block pages."""
    cfg = CacheConfig(model="block-replay", num_layers=1, num_kv_heads=1, head_dim=1,
                      dtype="float32", device="cpu", device_bytes=(capacity + 1) * block_tokens * 8,
                      host_bytes=0, disk_dir=None, eviction_policy=policy,
                      modalities={"text": ModalitySpec(page_size=block_tokens)})
    spec = cfg.modalities["text"]
    pol = make_policy(cfg)
    score = BlockScore(policy, capacity)
    cached: dict[int, ModalityGroup] = {}          # hash id -> group
    hash_of: dict[int, int] = {}                   # gid -> hash id
    used = 0                                       # pages in use
    gid = 0
    for rec in records:
        held: list[ModalityGroup] = []
        prefix, got = True, 0
        prev: ModalityGroup | None = None
        score.blocks += len(rec["hash_ids"])
        score.tokens += rec["input_length"]
        for pos, h in enumerate(rec["hash_ids"]):
            tokens = min(block_tokens, rec["input_length"] - pos * block_tokens)
            g = cached.get(h)
            if g is not None:
                g.hits += 1
                if prefix:
                    got += 1
                    score.hit_tokens += tokens
            else:
                prefix = False
                if used == capacity:
                    chosen, pages = [], 0
                    for v in pol.victims(Tier.DEVICE, spec.page_bytes, "text"):
                        if pages >= 1:
                            break
                        chosen.append(v)
                        pages += 1
                    for v in chosen:                # none when nothing could go
                        del cached[hash_of.pop(v.gid)]
                        used -= 1
                        score.evictions += 1
                        pol.on_remove(v)
                if used < capacity:
                    gid += 1
                    g = ModalityGroup(gid, key_of(h), spec, tokens, parent=prev, last_access=0.0)
                    cached[h], hash_of[gid] = g, h
                    used += 1
                    pol.on_insert(g)
                else:
                    score.uncached += 1
                    break                           # and the rest of the request's blocks
            g.refs += 1
            held.append(g)
            pol.on_access(g)
            prev = g
        for g in held:
            g.refs -= 1
            if g.refs == 0 and cached.get(hash_of.get(g.gid, -1)) is g:
                pol.on_release(g)
        score.hit_blocks += got
        score.per_request.append(got)
    return score
