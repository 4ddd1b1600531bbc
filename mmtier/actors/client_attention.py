"""Attention through a ``ClusterCache``: one ``attend`` per actor holding parts of the sequence,
the partial states merged exactly by log-sum-exp, and the fail-over of parts whose holder died.
A part of ``ClusterCache`` (this class is one of its bases), kept in its own file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import torch

from ..content import ContentKey
from ..errors import HolderLostError, ShapeError, UnknownKeyError
from ..kernels import merge_attention_states
from ..table import SequenceHandle
from . import placement
from .client_state import _Seq


class AttentionOps:
    """Attention over a sequence's parts, wherever they live, over ``ClusterCache``'s own state
    (its per-sequence state, holders and registry handle)."""

    async def attention_async(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                              groups: Iterable[ContentKey] | None = None, causal: bool = True,
                              scale: float | None = None) -> torch.Tensor:
        out, _ = await self.attention_state_async(seq, layer, q, groups=groups, causal=causal, scale=scale)
        return out

    async def attention_state_async(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                                    groups: Iterable[ContentKey] | None = None, causal: bool = True,
                                    scale: float | None = None, q_positions: torch.Tensor | None = None,
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over every part of the sequence, wherever it lives, merged exactly."""
        st = self._seq(seq)
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ShapeError("q must be [n_q, num_q_heads, head_dim]")
        q = q.detach().cpu()
        wanted = None if groups is None else set(groups)
        if wanted is not None:
            for k in wanted:
                self.keys.verify(k)
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
        for _attempt in range(2):
            plan = self._plan(st, wanted)
            try:
                states = await asyncio.gather(*(
                    self._call(self._actor(h).attend.remote(parts, layer, q, q_pos, causal, scale), h)
                    for h, parts in plan.items()))
            except HolderLostError:
                await self._fail_over(st)       # raises when nothing can replace the lost part
                continue
            remote = [h for h in plan if h != st.home]
            for h in remote:
                self.metrics.remote(self._info[h].kind if h in self._info else "pool")
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

    def _plan(self, st: _Seq, wanted: set[ContentKey] | None) -> dict[str, list]:
        return placement.plan(st, wanted)

    async def _fail_over(self, st: _Seq) -> None:
        """Re-home remote parts whose holder died onto another holder; the home itself has no
        replacement (its private KV lived only there)."""
        if st.home is not None and st.home not in self._actors:
            with self._state_lock:
                self._seqs.pop(st.handle.id, None)
            # The sequence is gone with its home: release what it holds elsewhere (its proxies
            # on other pools, its registry references), best effort, so nothing is orphaned.
            calls = [(h, self._actors[h].release.remote([p])) for h, p in st.proxies.items()
                     if h in self._actors]
            await asyncio.gather(*(self._call(r, h) for h, r in calls), return_exceptions=True)
            st.proxies.clear()
            if st.attached:
                self._registry.ref.remote([k.hex for k in st.attached], -1)
                st.attached.clear()
            raise HolderLostError(f"sequence {st.handle.id}: its home pool {st.home} is gone; recompute it")
        lost = [r for r in st.remotes if r.holder not in self._actors]
        for r in lost:
            loc = (await self._lookup([r.key]))[0]
            holders = [h for h, _ in (loc.holders if loc else ()) if h in self._actors]
            if not holders:
                raise HolderLostError(f"{r.key!r} was held only by {r.holder}, which is gone; recompute it")
            holder = self._nearest(holders, st.home)
            st.proxies.pop(r.holder, None)
            local_start = None
            if self._info[holder].kind == "pool":
                local_start = st.proxy_starts.get((holder, r.key.digest))
                if local_start is None:
                    handle, local_start, _n, _ev = await self._call(self._actor(holder).attach.remote(
                        st.proxies.get(holder), st.handle.tenant, r.key.to_wire()), holder)
                    st.proxies[holder] = handle
                    st.proxy_starts[(holder, r.key.digest)] = local_start
            r.holder, r.local_start = holder, local_start
