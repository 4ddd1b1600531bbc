"""``AttentionPlan``: what one attention call reads, captured under the cache's lock.

The cache plans a call under its lock (segments selected and checked, their groups pinned,
device operands compiled over the pool's view, host entries held and compiled over their slabs,
disk reads queued), computes it with the lock let go (``run``), and unpins under the lock
again. A pinned group is never freed, demoted, promoted or has its pages reused, and a held
host entry keeps its slots, so everything a plan captured stays valid until it is closed.
Nothing here touches the cache's bookkeeping: the plan is data plus the math over it.

A batch of sequences can be planned in one lock section the same way (one plan per sequence,
or one plan over their concatenated queries), then computed outside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..core.groups import ModalityGroup
from ..core.segments import Segment
from ..storage.host_slabs import HostEntry
from .kernels import merge_attention_states, paged_attention, upload_ints
from .kernels.layout import PagedKV
from .streaming import DiskStream

WAIT_S = 120.0
_INDPTRS: dict[int, torch.Tensor] = {}     # [0, n_q] int32 on the host, per n_q: read-only, shared


def _query_indptr(n_q: int) -> torch.Tensor:
    """The one-item query indptr ``[0, n_q]`` (made once per ``n_q``; the kernels only read it)."""
    t = _INDPTRS.get(n_q)
    if t is None:
        t = torch.tensor([0, n_q], dtype=torch.int32)
        if len(_INDPTRS) < 4096:
            _INDPTRS[n_q] = t
    return t


@dataclass(eq=False)
class AttentionPlan:
    segments: list[Segment]                    # every segment attended; their groups are pinned
    device_ops: list[PagedKV] | None           # None: no device part
    device: torch.device
    host_ops: list[PagedKV] = field(default_factory=list)
    held: list[HostEntry] = field(default_factory=list)      # host entries held for host_ops
    disk_segments: list[Segment] = field(default_factory=list)
    stream: DiskStream | None = None

    @property
    def groups(self) -> list[ModalityGroup]:
        return [s.group for s in self.segments]

    @property
    def lower(self) -> bool:
        """Whether some of it is computed over host or disk pages."""
        return bool(self.host_ops or self.disk_segments)

    @property
    def failed(self) -> list[ModalityGroup]:
        """Disk groups whose reads were missing or failed verification."""
        return list(self.stream.failed) if self.stream is not None else []

    def run(self, q: torch.Tensor, q_pos: torch.Tensor, *, causal: bool, scale: float | None,
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of ``q`` over the planned pages: the device part on ``backend``, the
        host part in place on the slabs, the disk part batch by batch as reads land; partial
        states merged exactly. Runs without the cache's lock."""
        states = []
        if self.device_ops is not None:
            dev = self.device
            # the query's index arrays: built on the host (planning reads them there) and uploaded
            # without a sync; caller-given positions already on the device stay there
            host_q_indptr = _query_indptr(q.shape[0])
            if q_pos.device.type == "cpu":
                q_indptr, q_pos_dev = upload_ints([host_q_indptr, q_pos], dev)
            else:
                q_indptr, = upload_ints([host_q_indptr], dev)
                q_pos_dev = q_pos.to(dev)
            states.append(paged_attention(
                q if q.device == dev else q.to(dev), q_indptr, q_pos_dev, self.device_ops, causal=causal, scale=scale,
                backend=backend, out_dtype=torch.float32, host_q_indptr=host_q_indptr))
        if self.lower:
            qc, pos = q.cpu(), q_pos.cpu()
            indptr = _query_indptr(q.shape[0])
            stream = self.stream
            if stream is not None:     # what has landed while the device part ran, before the host part
                states.extend(stream.states(self.disk_segments, qc, indptr, pos, causal, scale, WAIT_S, wait=False))
            if self.host_ops:
                states.append(paged_attention(qc, indptr, pos, self.host_ops, causal=causal, scale=scale,
                                              backend="torch", out_dtype=torch.float32))
            if stream is not None:
                states.extend(stream.states(self.disk_segments, qc, indptr, pos, causal, scale, WAIT_S))
        if len(states) == 1:
            out, lse = states[0]
        else:   # on the device of the device part when there is one (it comes first); the lower
            dev = states[0][0].device      # parts' small states go up to it
            merge_backend = backend if self.device_ops is not None else "torch"
            out, lse = merge_attention_states([o.to(dev) for o, _ in states], [x.to(dev) for _, x in states],
                                              backend=merge_backend, out_dtype=torch.float32)
        if out.device != q.device or out.dtype != q.dtype:
            out = out.to(device=q.device, dtype=q.dtype)
        return out, (lse if lse.device == q.device else lse.to(q.device))

    def close(self, release_held: Callable[[list[HostEntry]], None]) -> None:
        """Give back what the plan holds (host entries, the stream's buffers); idempotent."""
        held, self.held = self.held, []
        if held:
            release_held(held)
        if self.stream is not None:
            self.stream.close()
