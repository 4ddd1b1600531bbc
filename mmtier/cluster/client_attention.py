"""``ClusterAttention``: attention through a ``ClusterCache``: one ``attend`` per actor holding
parts of the sequence, the partial states merged exactly by log-sum-exp, and the fail-over of
parts whose holder died."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable

import torch

from ..attention.kernels import merge_attention_states
from ..content import ContentKey
from ..core.segments import SequenceHandle
from ..errors import HolderLostError, ShapeError, UnknownKeyError
from . import client_placement as placement
from .client_attach import Attacher
from .client_holders import Holders
from .client_keys import ClusterKeys
from .client_sequence_state import SequenceState
from .client_sequences import SequenceBook
from .metrics import ClientMetrics


class ClusterAttention:
    def __init__(self, book: SequenceBook, keys: ClusterKeys, holders: Holders, attacher: Attacher,
                 metrics: ClientMetrics, counters: Counter[str]):
        self.book = book
        self.keys = keys
        self.holders = holders
        self.attacher = attacher              # re-homes a remote part onto another holder
        self.metrics = metrics
        self.counters = counters

    async def state(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                    groups: Iterable[ContentKey] | None = None, causal: bool = True,
                    scale: float | None = None, q_positions: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over every part of the sequence, wherever it lives, merged exactly."""
        st = self.book.get(seq)
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ShapeError("q must be [n_q, num_q_heads, head_dim]")
        q = q.detach().cpu()
        wanted = None if groups is None else set(groups)
        if wanted is not None:
            for k in wanted:
                self.keys.maker.verify(k)
            missing = wanted - set(st.attached)
            if missing:
                raise UnknownKeyError(f"groups not attached to sequence {seq.id}: {sorted(map(str, missing))}")
        n_q = q.shape[0]
        if q_positions is None:
            if causal and n_q > st.length:
                raise ShapeError(f"{n_q} queries but the sequence holds {st.length} tokens")
            first = max(0, st.length - n_q)
            q_pos = torch.arange(first, first + n_q, dtype=torch.int64)
        else:
            q_pos = q_positions.to(torch.int64).cpu()
        h = self.holders
        for _attempt in range(2):
            plan = placement.plan(st, wanted)
            try:
                states = await asyncio.gather(*(
                    h.call(h.actor(name).attend.remote(parts, layer, q, q_pos, causal, scale), name)
                    for name, parts in plan.items()))
            except HolderLostError:
                await self._fail_over(st)       # raises when nothing can replace the lost part
                continue
            remote = [name for name in plan if name != st.home]
            for name in remote:
                self.metrics.remote(h.kind(name))
            self.counters["remote_attentions"] += len(remote)
            if not states:
                return (torch.zeros(q.shape, dtype=q.dtype),
                        torch.full(q.shape[:2], float("-inf"), dtype=torch.float32))
            if len(states) == 1:
                out, lse = states[0]
            else:
                out, lse = merge_attention_states([s[0] for s in states], [s[1] for s in states],
                                                  backend="torch", out_dtype=torch.float32)
            return out.to(q.dtype), lse
        raise HolderLostError(f"sequence {seq.id}: its holders kept failing")

    async def _fail_over(self, st: SequenceState) -> None:
        """Re-home remote parts whose holder died onto another holder; the home itself has no
        replacement (its private KV lived only there)."""
        h = self.holders
        if st.home is not None and st.home not in h.actors:
            self.book.forget(st)
            # The sequence is gone with its home: release what it holds elsewhere (its proxies
            # on other pools, its registry references), best effort, so nothing is orphaned.
            calls = [(name, h.actors[name].release.remote([p])) for name, p in st.proxies.items()
                     if name in h.actors]
            await asyncio.gather(*(h.call(r, name) for name, r in calls), return_exceptions=True)
            st.proxies.clear()
            self.book.unref_attached(st)
            raise HolderLostError(f"sequence {st.handle.id}: its home pool {st.home} is gone; recompute it")
        dead = [r for r in st.remotes if r.holder not in h.actors]
        locs = await h.lookup([r.key for r in dead]) if dead else []
        alive = [h.alive(name for name, _ in (loc.holders if loc else ())) for loc in locs]
        lost = [r for r, holders in zip(dead, alive, strict=True) if not holders]
        if lost:                   # every group the step needs that no live holder has, named
            raise HolderLostError(
                f"sequence {st.handle.id}: {len(lost)} group(s) were held only by "
                f"{', '.join(sorted({r.holder for r in lost}))}, which is gone: "
                f"{', '.join(r.key.hex for r in lost)}; recompute them", tuple(r.key.hex for r in lost))
        for r, holders in zip(dead, alive, strict=True):
            holder = self.attacher.nearest(holders, st.home)
            st.proxies.pop(r.holder, None)
            local_start = None
            if h.kind(holder) == "pool":
                local_start = await self.attacher.proxy_start(st, r.key, holder)
            r.holder, r.local_start = holder, local_start
