"""What the scheduler side of mmtier's vLLM connector (``scheduler``) tells its worker side
(``worker``) each step: ``MMTierConnectorMetadata``, vLLM's connector metadata, lists the
groups to load (a request's hit), to save (groups whose positions the step completes) and to
flush (groups of generated tokens whose KV earlier steps wrote), each a ``GroupCopy`` (a
group's positions and the slots of vLLM's blocks they live in), and, for models with recurrent
layers, the states to load and save (``hybrid.StateCopy``). vLLM sends it to
the worker's process as it is (pickled where the worker runs in a process of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...content import ContentKey
from . import hybrid as vllm_hybrid


@dataclass(frozen=True)
class GroupCopy:
    """One group's positions ``[lo, hi)`` (within the group ``[start, end)``) and their slots."""

    req_id: str
    key: ContentKey
    start: int
    end: int
    lo: int
    hi: int
    slots: torch.Tensor          # int64 [hi - lo]
    block_ids: tuple[int, ...]   # the vLLM blocks these slots live in
    # hybrid engines (vllm_hybrid): [kv cache groups, hi - lo] slots per group, -1 where a
    # group holds no block (a sliding window let it go); None with one group
    group_slots: torch.Tensor | None = None
    decode: bool = False         # positions a request generated (saved as ``flushes``)


@dataclass
class MMTierConnectorMetadata(KVConnectorMetadata):
    loads: list[GroupCopy] = field(default_factory=list)
    saves: list[GroupCopy] = field(default_factory=list)
    # models with recurrent layers (vllm_hybrid): states to load with a hit, to save this step
    state_loads: list[vllm_hybrid.StateCopy] = field(default_factory=list)
    state_saves: list[vllm_hybrid.StateCopy] = field(default_factory=list)
    # groups whose KV earlier steps wrote (generated tokens' blocks as they fill, a finished or
    # preempted request's last ones): saved at the step's start, off the forward; ``flush_wait``:
    # some of their blocks go to other requests this step, so they are read before it writes any
    flushes: list[GroupCopy] = field(default_factory=list)
    flush_wait: bool = False
    # recurrent layers: the states after some of ``flushes`` (read as the step starts; with no
    # ``blocks``, the worker's copy of that request's state at that end, from ``state_marks``),
    # and states where a decode step ended on a block boundary, copied for a later finish
    flush_states: list[vllm_hybrid.StateCopy] = field(default_factory=list)
    state_marks: list[vllm_hybrid.StateCopy] = field(default_factory=list)
