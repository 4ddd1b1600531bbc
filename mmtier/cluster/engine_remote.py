"""``RemoteParts``: groups an embedded pool's sequences attend where they live.

The ``"remote"`` plan of ``client_placement.transfer_plan``: a group held by another pool and too large
for this one (or very large, and cheaper to attend in place for the calls the turn has left)
is not copied. Attached to a local sequence, it gets a *proxy* reference at its holder (one
proxy sequence per holder, so the holder pins it while attached) and a place in the sequence's
positions; the local sequence keeps only the local segments (its own positions skip the remote
tokens; the first local tokens after a remote group start a segment of their own) and the prefix
chain of everything, remote groups included.

Attention over such a sequence sends one ``attend`` per holder (``q`` and the query positions
go, ``(out, lse)`` comes back), computes the local segments meanwhile, each at its absolute
position (shifted by the remote tokens attached before it), and merges the partial states
exactly by log-sum-exp. A sequence with no remote group never reaches this code: its attention
is the local cache's, with no Ray call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.kernels import merge_attention_states
from ..cache import TieredKVCache
from ..content import ContentKey
from ..core.segments import SequenceHandle
from ..errors import ShapeError, UnknownKeyError
from .client_sequence_state import ClusterSequence
from .pool import Part


@dataclass(frozen=True)
class RemoteGroup:
    """A group of a local sequence attended at ``holder``."""

    holder: str
    key: ContentKey
    start: int            # its first position in the sequence
    local_at: int         # the local sequence's length when it was attached
    proxy_start: int      # its first position in the holder's proxy sequence
    num_tokens: int


@dataclass
class _Split:
    groups: list[RemoteGroup] = field(default_factory=list)
    proxies: dict[str, SequenceHandle] = field(default_factory=dict)


class RemoteParts:
    """The remote groups of an embedded pool's sequences (see the module doc)."""

    def __init__(self, cache: TieredKVCache, transport):
        self.cache = cache
        self.transport = transport
        self._seqs: dict[int, _Split] = {}

    def has(self, seq: SequenceHandle) -> bool:
        return seq.id in self._seqs

    def attach(self, seq: SequenceHandle, key: ContentKey, holder: str) -> None:
        """Reference ``key`` at ``holder`` at the sequence's next position (one call)."""
        self.cache.check_attach(seq, key)   # ForeignKeyError, PrefixMismatchError, UnknownKeyError
        table = self.cache.sequence(seq)
        split = self._seqs.get(seq.id) or _Split()
        proxy, proxy_start, n, _evicted = self.transport.attach(
            holder, split.proxies.get(holder), seq.tenant, key.to_wire())
        split.proxies[holder] = proxy
        self._seqs[seq.id] = split
        local_at = table.length
        split.groups.append(RemoteGroup(holder, key, local_at + self._remote_tokens(split), local_at,
                                        proxy_start, n))
        self.cache.chain_elsewhere(seq, key)            # the same identity as a local attach

    def boundary(self, seq: SequenceHandle) -> bool:
        """Whether the sequence's next local tokens must start a segment of their own (a remote
        group was attached last: the local run before it must not grow across it)."""
        return self.tail_modality(seq) is not None

    def tail_modality(self, seq: SequenceHandle) -> str | None:
        """The modality of the sequence's last part when that part is a remote group."""
        split = self._seqs.get(seq.id)
        if split is None or not split.groups:
            return None
        last = split.groups[-1]
        return last.key.modality if last.local_at == self.cache.sequence(seq).length else None

    def sequence(self, seq: SequenceHandle) -> ClusterSequence:
        split = self._seqs[seq.id]
        table = self.cache.sequence(seq)
        attached = tuple(s.group.key for s in table.segments if s.group.key is not None)
        return ClusterSequence(seq, table.length + self._remote_tokens(split), None,
                               attached + tuple(g.key for g in split.groups))

    def attention_state(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *, groups=None,
                        causal: bool = True, scale: float | None = None,
                        q_positions: torch.Tensor | None = None, modalities=None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over the local segments and the remote groups, merged exactly
        (``groups`` / ``modalities`` restrict both, as in ``TieredKVCache.attention_state``)."""
        self.cache.planner.check_q(q)
        split = self._seqs[seq.id]
        table = self.cache.sequence(seq)
        wanted = None if groups is None else set(groups)
        if wanted is not None:
            held = {s.group.key for s in table.segments} | {g.key for g in split.groups}
            missing = wanted - held
            if missing:
                raise UnknownKeyError(f"groups not attached to sequence {seq.id}: {sorted(map(str, missing))}")
        mods = None if modalities is None else set(modalities)
        for m in mods or ():
            self.cache.cfg.spec(m)                     # UnknownModalityError for a bad name
        n_q = q.shape[0]
        if q_positions is None:
            length = table.length + self._remote_tokens(split)
            if causal and n_q > length:
                raise ShapeError(f"{n_q} queries but the sequence holds {length} tokens")
            first = max(0, length - n_q)
            q_positions = torch.arange(first, first + n_q, dtype=torch.int64)
        q_pos = q_positions.to(torch.int64).cpu()
        q_cpu = q.detach().cpu()
        sent = []                                      # the holders work while this pool does
        for holder, parts in self._remote_parts(split, wanted, mods).items():
            sent.append((holder, self.transport.attend(holder, parts, layer, q_cpu, q_pos, causal, scale)))
        states = []
        local = self._local_parts(seq, table, split, wanted, mods)
        if local:
            states.append(self.cache.attention_state_parts(local, layer, q, q_pos, causal=causal, scale=scale))
        for holder, ref in sent:
            out, lse = self.transport.attended(ref, holder)
            states.append((out.to(q.device), lse.to(q.device)))
        if not states:
            return (torch.zeros(q.shape, dtype=q.dtype, device=q.device),
                    torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))
        if len(states) == 1:
            return states[0]
        out, lse = merge_attention_states([s[0] for s in states], [s[1] for s in states],
                                          backend="torch", out_dtype=torch.float32)
        return out.to(q.dtype), lse

    def release(self, seq: SequenceHandle) -> None:
        """Drop the sequence's proxies (one call per holder, not waited for)."""
        split = self._seqs.pop(seq.id, None)
        if split is None:
            return
        for holder, proxy in split.proxies.items():
            self.transport.release(holder, [proxy])

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _remote_tokens(split: _Split) -> int:
        return sum(g.num_tokens for g in split.groups)

    @staticmethod
    def _remote_parts(split: _Split, wanted: set[ContentKey] | None, mods: set[str] | None
                      ) -> dict[str, list[Part]]:
        out: dict[str, list[Part]] = {}
        for g in split.groups:
            if (wanted is None or g.key in wanted) and (mods is None or g.key.modality in mods):
                out.setdefault(g.holder, []).append(
                    Part(split.proxies[g.holder], g.start - g.proxy_start, (g.key.to_wire(),), g.proxy_start))
        return out

    @staticmethod
    def _local_parts(seq: SequenceHandle, table, split: _Split, wanted: set[ContentKey] | None,
                     mods: set[str] | None) -> list:
        """One part per local segment, at its absolute position: its local start shifted by the
        tokens of the remote groups attached before it."""
        parts = []
        for s in table.segments:
            key = s.group.key
            if (wanted is not None and key not in wanted) or (mods is not None and s.group.modality not in mods):
                continue
            shift = sum(g.num_tokens for g in split.groups if g.local_at <= s.start)
            parts.append((seq, None if wanted is None else [key], shift, s.start))
        return parts
