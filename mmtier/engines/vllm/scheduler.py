"""The scheduler side of mmtier's vLLM connector (``connector.MMTierConnector`` forwards vLLM's
scheduler calls here): what a request holds in the cache and which groups each step loads and
saves.

A request's prompt becomes chained groups (``plan``); the hit is the leading run of held
groups in whole blocks, looked up in one pass (through the lookup channel where the worker runs
in a process of its own); where the run stops inside a text chunk, the part of it an earlier
prompt stored (a conversation's last turn ended there) is looked up too and the prompt planned
again with a cut there (``_fork``). With ``mmtier_cluster``, the groups not held here are looked
up (and pulled, or located for the worker to pull) once per request, off vLLM's thread
(``get_num_new_matched_tokens`` answers ``None`` until then). ``build_connector_meta`` lists,
per step, the groups to load (the hit) and to save (groups whose positions this step
completes): the metadata of ``meta`` that the worker side (``worker``) acts on. Its
state is per request (``_ReqState``), and the counts of what it told vLLM it would load.

Generated tokens (``setup.save_decode``, on by default): as a request's KV fills past its
prompt, its prompt and generated tokens are planned again as one sequence, cut where its prompt's
full blocks end (``_decode_saves``): the groups of its prompt are the same, and the groups after
them are those a next turn repeating the conversation looks up (the part of a chunk up to where
the answer's whole blocks end is found by ``_fork``, as a prompt's part is). Each whole chunk is
flushed as its last block's KV is written; the last part when the request finishes, is aborted
or is preempted (vLLM frees its blocks then: the worker reads them at the next step's start,
before any is written, ``MMTierConnectorMetadata.flush_wait``). Only positions whose KV is
written are saved: vLLM computes a sampled token's KV in the next step. Hybrid models: each
layer through its own KV cache group's table, recurrent states with the groups
(``_decode_state``, ``_mark_state``; see ``hybrid``).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...content import ContentKey
from ...errors import ShapeError
from . import hybrid as vllm_hybrid
from . import pd as vllm_pd
from .meta import GroupCopy, MMTierConnectorMetadata
from .plan import MAX_FORKS, RequestPlan, Segment, slots_for
from .setup import ConnectorSetup

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.v1.request import Request

# steps a lookup waits for a finished request's last groups, still being flushed, that it would
# hit (``_awaits_flush``): the flush is sent at the next step and stored by the one after
FLUSH_WAIT_STEPS = 3


@dataclass
class _ReqState:
    plan: RequestPlan
    computed: int = 0              # vLLM's locally computed tokens when the hit was asked
    hit: int = 0
    load: bool = False
    block_ids: list[list[int]] = field(default_factory=list)   # vLLM's block table per KV cache group
    saved: int = 0                 # segments [0, saved) are held or queued for saving
    cuts: tuple[int, ...] = ()     # where the plan forks off to an earlier prompt's part (_fork)
    pull: Future | None = None     # the cluster pull of the groups it lacked (once per request)
    request: Request | None = None  # vLLM's request (its token ids grow as it generates)
    done: int = 0                  # positions whose KV vLLM wrote by the end of its latest step
    start: int = 0                 # positions computed when its latest step was scheduled
    decode: bool = True            # its generated tokens are still planned (_decode_saves)
    flush_waits: int = 0           # steps its lookup waited for a flush it would hit
    handoff: vllm_pd.PendingHandoff | None = None   # P/D: the groups its prefill engine named


class MMTierConnectorScheduler:
    """See the module docstring; ``setup``: what it shares with the worker side."""

    def __init__(self, setup: ConnectorSetup):
        self.setup = setup
        self.cache, self.link, self.split, self.block_size = setup.cache, setup.link, setup.split, setup.block_size
        self.hybrid, self.scheme, self.states = setup.hybrid, setup.scheme, setup.states
        self._channel = setup.channel
        self._reqs: dict[str, _ReqState] = {}
        # tokens the scheduler told vLLM it would load, and tokens it then asked the worker to
        # load (equal unless a hit went unloaded); loads for requests resumed after preemption
        self.counts = {"hit_tokens": 0, "load_tokens": 0, "resumed_loads": 0}
        self._async_ops: list[GroupCopy] = []     # hybrid: loads issued at allocation, sent next
        self._async_states: list[vllm_hybrid.StateCopy] = []
        self._async_reqs: set[str] = set()        # hybrid: requests with a load (their blocks wait)
        self.save_decode = setup.save_decode
        self._flushes: list[GroupCopy] = []       # finished requests' last groups, sent next step
        self._flush_states: list[vllm_hybrid.StateCopy] = []   # recurrent states of decode groups
        self._step = 0                            # build_connector_meta calls so far
        self._flushed_at: dict[ContentKey, int] = {}   # flushed group -> the step it was sent in
        # P/D (``pd``): a consumer never saves prompts; a producer names what it saved
        self.role, self.pd_wait_s, self.load_policy = setup.role, setup.pd_wait_s, setup.load_policy
        self.counts.update(pd_waits=0, pd_timeouts=0, pd_handoffs=0)

    def plan(self, request: Request) -> _ReqState:
        """The request's state, its prompt planned on first sight."""
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _ReqState(self.scheme.plan(self.cache, request),
                                                               request=request)
            state.handoff = vllm_pd.PendingHandoff.from_params(getattr(request, "kv_transfer_params", None),
                                                               self.pd_wait_s)
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        state = self.plan(request)
        keys = [s.key for s in state.plan.segments]
        held = self._held(keys)
        if not all(held):          # an earlier prompt ended inside the chunk that missed
            held = self._fork(request, state, held)
            keys = [s.key for s in state.plan.segments]
        if state.handoff is not None and not state.handoff.settled:
            waiting = self._await_handoff(request, state, keys, held)
            if waiting is not None:
                return waiting
            held = self._held(keys)
        if not all(held) and state.flush_waits < FLUSH_WAIT_STEPS and self._awaits_flush(request, state, held):
            state.flush_waits += 1
            return None, False                         # asked again once the flush is stored
        if self.link is not None and not all(held):
            if state.pull is None:                     # one lookup (and its pulls) per request
                ask = self.link.locate_async if self.split else self.link.pull_async
                state.pull = ask(keys[held.index(False):])
            if not state.pull.done():
                return None, False                     # vLLM asks again at a later step
            if self.split:                             # held by the cluster: the worker pulls them
                n = held.index(False) + (state.pull.result() if state.pull.exception() is None else 0)
                held = [i < n for i in range(len(keys))]
            else:
                held = self._lookup(keys)              # what was pulled is local now
        state.computed, state.hit = num_computed_tokens, state.plan.hit_tokens(held, self.block_size)
        if self.states:                                # a hit ends where a state is held
            state.hit = self._state_hit(state, held, request.num_tokens)
        state.saved = next((i for i, ok in enumerate(held) if not ok), len(held))
        if self.role == "kv_consumer":                 # a decode engine saves no prompt
            state.saved = len(held)
        n = max(0, state.hit - num_computed_tokens)
        return n, self.hybrid is not None and n > 0     # hybrid: loaded while the request waits

    def _await_handoff(self, request: Request, state: _ReqState, keys: list[ContentKey],
                       held: list[bool]) -> tuple[int | None, bool] | None:
        """A decode request's wait for the groups its prefill engine named (``pd``): what to
        answer vLLM while it waits (``(None, False)``: ask again), or ``None`` once they are
        held here or in the cluster (the normal path then loads them), or the wait is over.
        Past the wait, ``"recompute"`` goes on with what is held; ``"fail"`` claims the named
        tokens (their load fails and vLLM fails the request)."""
        handoff = state.handoff
        want = handoff.wanted([k.hex for k in keys])
        have = next((i for i, ok in enumerate(held[:want]) if not ok), want)
        if have < want and self.link is not None:
            if state.pull is None:                     # asked again until the groups are visible
                ask = self.link.locate_async if self.split else self.link.pull_async
                state.pull = ask(keys[have:])
            if not state.pull.done():
                return None, False
            found = state.pull.result() if state.pull.exception() is None else 0
            if self.split:
                have = min(want, have + found)
            else:
                have = next((i for i, ok in enumerate(self._lookup(keys)[:want]) if not ok), want)
            if have < want:
                state.pull = None                      # not visible yet: a fresh lookup next time
        if have >= want:
            handoff.settled = True
            if self.split:                             # the normal path locates from where it starts
                state.pull = None
            self.counts["pd_handoffs"] += 1
            return None
        if not handoff.expired():
            self.counts["pd_waits"] += 1
            return None, False
        handoff.settled = handoff.timed_out = True
        self.counts["pd_timeouts"] += 1
        end = state.plan.segments[want - 1].end if want else 0
        log.warning("mmtier: request %s: %d of the %d groups its prefill engine saved ([0, %d)) are not visible "
                    "after %.1f s; policy %r", request.request_id, have, want, end, self.pd_wait_s,
                    self.load_policy)
        if self.load_policy != "fail":
            return None
        # claim the named tokens: their load fails and vLLM fails the request ("fail")
        state.computed = num = request.num_computed_tokens
        state.hit = state.plan.hit_tokens([i < want for i in range(len(keys))], self.block_size)
        state.saved = len(keys)
        return max(0, state.hit - num), self.hybrid is not None and state.hit > num

    def _state_hit(self, state: _ReqState, held: list[bool], num_tokens: int) -> int:
        """The longest hit whose end holds a state: the end of a held group on a block
        boundary, short of the last token, whose states the cache holds."""
        segs = state.plan.segments
        run = next((i for i, ok in enumerate(held) if not ok), len(held))
        for i in range(run - 1, -1, -1):
            end = segs[i].end
            if end % self.block_size or end > num_tokens - 1:
                continue
            keys = [self.cache.state_key(segs[i].key, m) for m in self.states]
            if self._channel is not None and self._channel.asks:
                if self._channel.leading_held(keys) == len(keys):
                    return end
            elif all(self.cache.contains(k) for k in keys):
                return end
        return 0

    def _state_at(self, req_id: str, state: _ReqState, end: int) -> vllm_hybrid.StateCopy | None:
        """The state after ``[0, end)``: the group ending there and vLLM's state block of it in
        each recurrent group's own table."""
        seg = next((s for s in state.plan.segments if s.end == end), None)
        if seg is None:
            return None
        index, blocks = end // self.block_size - 1, []
        for g in self.hybrid.state_groups:
            table = state.block_ids[g] if g < len(state.block_ids) else []
            ok = 0 <= index < len(table) and table[index] != vllm_hybrid.NULL_BLOCK
            blocks.append(table[index] if ok else -1)
        return vllm_hybrid.StateCopy(req_id, seg.key, end, tuple(blocks))

    def _held(self, keys: list[ContentKey]) -> list[bool]:
        """Which of ``keys`` are held, as a leading run: the worker's cache through the lookup
        channel where it runs in another process, else this process's."""
        if self._channel is not None and self._channel.asks:
            n = self._channel.leading_held(keys)
            return [i < n for i in range(len(keys))]
        return self._lookup(keys)

    def _first_held(self, keys: list[ContentKey]) -> int | None:
        """The index of the first of ``keys`` held, each looked up in order until one is (one
        round trip where the worker runs in another process); ``None`` when none is."""
        if self._channel is not None and self._channel.asks:
            return self._channel.first_held(keys)
        return next((i for i, key in enumerate(keys) if self.cache.contains(key)), None)

    def _fork(self, request: Request, state: _ReqState, held: list[bool]) -> list[bool]:
        """Where the leading run stops inside a text chunk, the longest part of it an earlier
        prompt stored (its full blocks ended there: a conversation's last turn): the request
        is planned again with a cut there and looked up again (``plan``). Two lookups per
        fork (the chunk's parts at once, then the new plan), and a few forks per request."""
        if state.plan.prompt_len > len(request.prompt_token_ids or ()):
            return held                # planned past its prompt (resumed): forks are the prompt's
        for _ in range(MAX_FORKS):
            n = held.index(False) if False in held else len(held)
            forks = self.scheme.forks(self.cache, request, state.plan, n)
            i = self._first_held([key for _, key in forks]) if forks else None
            if i is None:
                break
            state.cuts = tuple(sorted({*state.cuts, forks[i][0]}))
            state.plan = self.scheme.plan(self.cache, request, state.cuts)
            held = self._held([seg.key for seg in state.plan.segments])
            if all(held):
                break
        return held

    def _awaits_flush(self, request: Request, state: _ReqState, held: list[bool]) -> bool:
        """Whether the group this request misses first, or a part of its chunk an earlier
        prompt would have stored, is a finished request's last group not yet stored: sent to
        the worker this or the previous step, or still to be sent (a next turn that arrives
        while the engine was idle meets its previous answer's last part here)."""
        pending = {op.key for op in self._flushes}
        pending.update(k for k, at in self._flushed_at.items() if at >= self._step - 1)
        if not pending:
            return False
        n = held.index(False)
        if state.plan.segments[n].key in pending:
            return True
        return any(key in pending for _, key in self.scheme.forks(self.cache, request, state.plan, n))

    def _lookup(self, keys: list[ContentKey]) -> list[bool]:
        """Which keys the cache holds, in one pass that stops at the first miss."""
        held: list[bool] = []
        for key in keys:
            held.append(self.cache.contains(key))
            if not held[-1]:
                break
        return held + [False] * (len(keys) - len(held))

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is not None:
            state.load = num_external_tokens > 0
            if state.load:
                state.hit = state.computed + num_external_tokens
                self.counts["hit_tokens"] += num_external_tokens
                if self.hybrid is not None:       # the request waits for it: load now, once
                    state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
                    self._async_ops += self._loads(request.request_id, state)
                    self._async_reqs.add(request.request_id)
                    if self.states:
                        at = self._state_at(request.request_id, state, state.hit)
                        self._async_states.append(at or vllm_hybrid.StateCopy(request.request_id, None, state.hit, ()))

    def build_connector_meta(self, scheduler_output) -> MMTierConnectorMetadata:
        meta = MMTierConnectorMetadata(loads=self._async_ops, state_loads=self._async_states)
        self._async_ops, self._async_states = [], []
        meta.flushes, self._flushes = self._flushes, []
        self._step += 1
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self._reqs.get(req_id)        # its blocks were freed in this schedule
            if state is not None and state.block_ids:
                meta.flushes += self._decode_saves(req_id, state, state.done, final=True)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            if state.load:
                meta.loads += self._loads(new.req_id, state)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            saves = self._saves(new.req_id, state, max(done, state.hit))
            meta.saves += saves
            self._state_save(meta, new.req_id, state, saves, done)
            state.done, state.start = done, new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            if req_id in cached.resumed_req_ids:           # preempted: blocks were rebuilt
                state.block_ids = []
            if cached.new_block_ids[i] is not None:
                tables = cached.new_block_ids[i]
                state.block_ids = [(state.block_ids[g] if g < len(state.block_ids) else []) + list(ids)
                                   for g, ids in enumerate(tables)]
            if state.load:                                 # resumed with a hit: load it again
                meta.loads += self._loads(req_id, state)
                self.counts["resumed_loads"] += 1
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            saves = self._saves(req_id, state, max(done, state.hit))
            meta.saves += saves
            self._state_save(meta, req_id, state, saves, done)
            # earlier steps wrote the KV of positions [0, num_computed_tokens)
            written = cached.num_computed_tokens[i]
            meta.flushes += self._decode_saves(req_id, state, written, final=False)
            self._mark_state(meta, req_id, state, written)
            state.done, state.start = done, written
        meta.flush_states, self._flush_states = self._flush_states, []
        self._flushed_at = {k: at for k, at in self._flushed_at.items() if at >= self._step - 1}
        self._flushed_at.update((op.key, self._step) for op in meta.flushes)
        if meta.flushes:
            handed = _blocks_handed_out(scheduler_output)
            meta.flush_wait = any(b in handed for op in meta.flushes for b in op.block_ids)
        return meta

    def _decode_saves(self, req_id: str, state: _ReqState, written: int, *, final: bool) -> list[GroupCopy]:
        """The groups past the prompt whose KV vLLM wrote (positions below ``written`` whose
        tokens are known), chained after the prompt's as the next turn's prompt chains them (see
        the module docstring): whole chunks, and with ``final`` (the request finished or was
        preempted) the part of a chunk its last whole block ends. They join the plan."""
        request = state.request
        if not self.save_decode or not state.decode or request is None:
            return []
        bs, chunk = self.block_size, self.scheme.chunk_blocks * self.block_size
        known = len(request.all_token_ids)
        end = min(written, known) // bs * bs
        segs = state.plan.segments
        last = segs[-1].end if segs else 0
        if end <= last or (not final and end < (last // chunk + 1) * chunk):
            return []                  # no new whole chunk (and not the last part) yet
        prompt_full = len(request.prompt_token_ids or ()) // bs * bs
        cuts = tuple(sorted({*state.cuts, prompt_full} - {0}))
        plan = self.scheme.plan_tokens(self.cache, request, request.all_token_ids[:end], cuts)
        if [s.key for s in plan.segments[:len(segs)]] != [s.key for s in segs] or len(plan.segments) == len(segs):
            state.decode = False       # the prompt's plan ended early (an item not cacheable)
            return []
        new = list(plan.segments[len(segs):])
        if not final and new[-1].end % chunk:
            new.pop()                  # a part of a chunk: saved when the request ends
        if not new:
            return []
        state.plan = RequestPlan(known, (*segs, *new))
        out = []
        while state.saved < len(state.plan.segments) and state.plan.segments[state.saved].end <= end:
            seg = state.plan.segments[state.saved]
            try:
                op = dataclasses.replace(self._copy(req_id, state, seg, seg.start, seg.end), decode=True)
                if self.hybrid is not None and not self._whole_in_attention(op):
                    raise ShapeError("a sliding window let some of its blocks go")
            except ShapeError as exc:  # its blocks are not all in the table the scheduler saw
                log.warning("mmtier: decode save of %s [%d, %d) skipped: %s", req_id, seg.start, seg.end, exc)
                state.decode = False
                break
            out.append(op)
            state.saved += 1
        if self.states and out:
            self._decode_state(req_id, state, out[-1], written, final)
        if final and new[-1].end % chunk and state.saved == len(state.plan.segments):
            # the part stays out of the plan: a preempted request that resumes goes on to
            # save the whole chunk (a finished one's state goes with it)
            state.plan = RequestPlan(known, state.plan.segments[:-1])
            state.saved -= 1
        return out

    def _whole_in_attention(self, op: GroupCopy) -> bool:
        """Every attention layer's group holds a block for each of ``op``'s positions."""
        attention = sorted(set(self.hybrid.layer_group.values()))
        return bool((op.group_slots[attention] >= 0).all())

    def _decode_state(self, req_id: str, state: _ReqState, op: GroupCopy, written: int, final: bool) -> None:
        """The recurrent state after the decode group ``op`` (its hit ends only where one is
        held). In mode 'align' vLLM keeps the state after ``e`` tokens in block ``e // bs - 1``
        from the step that ends at ``e`` until the schedule after the next step starts (it
        then frees it): exact where the latest steps ended or started at ``op.end``. Else, at a
        finish or preemption, the worker's copy taken when a step ended there
        (``_mark_state``); a non-final flush past its end saves none (a later miss)."""
        if written == op.end or state.start == op.end:
            at = self._state_at(req_id, state, op.end)
            if at is not None and at.whole:
                self._flush_states.append(at)
        elif final:
            self._flush_states.append(vllm_hybrid.StateCopy(req_id, op.key, op.end, ()))

    def _mark_state(self, meta: MMTierConnectorMetadata, req_id: str, state: _ReqState, written: int) -> None:
        """Where a step ended on a block boundary past the request's saved groups, the worker
        copies the state there (the last one per request): the state of the part a finish or
        preemption saves later (``_decode_state``), which vLLM frees a step after."""
        if not (self.states and self.save_decode and state.decode and written % self.block_size == 0):
            return
        segs = state.plan.segments
        if written <= (segs[-1].end if segs else 0) or written < len(state.request.prompt_token_ids or ()):
            return
        index, blocks = written // self.block_size - 1, []
        for g in self.hybrid.state_groups:
            table = state.block_ids[g] if g < len(state.block_ids) else []
            blocks.append(table[index] if index < len(table) and table[index] != vllm_hybrid.NULL_BLOCK else -1)
        mark = vllm_hybrid.StateCopy(req_id, None, written, tuple(blocks))
        if mark.whole:
            meta.state_marks.append(mark)

    def _state_save(self, meta: MMTierConnectorMetadata, req_id: str, state: _ReqState,
                    saves: list[GroupCopy], done: int) -> None:
        """The state to save with this step's groups: where the step ends on a block boundary
        at the end of a group it saves (vLLM's state of that position is then in its block)."""
        if self.states and saves and saves[-1].end == done and done % self.block_size == 0:
            at = self._state_at(req_id, state, done)
            if at is not None and at.whole:
                meta.state_saves.append(at)

    def _loads(self, req_id: str, state: _ReqState) -> list[GroupCopy]:
        """The copies that load a request's hit into its blocks (once per admission)."""
        state.load = False
        ops = self._copies(req_id, state, state.computed, state.hit)
        self.counts["load_tokens"] += sum(op.hi - op.lo for op in ops)
        return ops

    def _copies(self, req_id: str, state: _ReqState, lo: int, hi: int) -> list[GroupCopy]:
        out = []
        for seg in state.plan.segments:
            a, b = max(lo, seg.start), min(hi, seg.end)
            if a < b:
                out.append(self._copy(req_id, state, seg, a, b))
        return out

    def _saves(self, req_id: str, state: _ReqState, computed: int) -> list[GroupCopy]:
        out, segs = [], state.plan.segments
        while state.saved < len(segs) and segs[state.saved].end <= computed:
            seg = segs[state.saved]
            out.append(self._copy(req_id, state, seg, seg.start, seg.end))
            state.saved += 1
        return out

    def _copy(self, req_id: str, state: _ReqState, seg: Segment, lo: int, hi: int) -> GroupCopy:
        if self.hybrid is not None:       # each layer reads its own group's table
            per_group = vllm_hybrid.group_slots(state.block_ids, lo, hi, self.block_size)
            blocks = tuple(sorted({int(s) // self.block_size for s in per_group[per_group >= 0].tolist()}))
            return GroupCopy(req_id, seg.key, seg.start, seg.end, lo, hi, per_group[0], blocks, per_group)
        slots = slots_for(state.block_ids[0], lo, hi, self.block_size)
        blocks = tuple(sorted({int(s) // self.block_size for s in slots}))
        return GroupCopy(req_id, seg.key, seg.start, seg.end, lo, hi, torch.from_numpy(slots), blocks)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator's ``request_finished``: a request that had a load keeps its
        blocks until the worker says the load no longer writes them (``finished_sending``).
        The last groups of its generated tokens are flushed at the next step (vLLM calls this
        before it frees the blocks, and writes none of them before that step's flush)."""
        state = self._reqs.pop(request.request_id, None)
        params = self._handoff(request, state)
        if state is not None and block_ids and block_ids[0]:
            state.block_ids = [list(ids) for ids in block_ids]
            self._flushes += self._decode_saves(request.request_id, state, request.num_computed_tokens, final=True)
        if request.request_id in self._async_reqs:
            self._async_reqs.discard(request.request_id)
            return True, params
        return False, params

    def _handoff(self, request: Request, state: _ReqState | None) -> dict[str, Any] | None:
        """A prefill engine's ``kv_transfer_params`` for the decode engine (``pd``): the prompt's
        groups held or queued for saving, in order; ``None`` unless the request asked for it."""
        if (state is None or self.role == "kv_consumer"
                or not vllm_pd.wants_handoff(getattr(request, "kv_transfer_params", None))):
            return None
        full = len(request.prompt_token_ids or ()) // self.block_size * self.block_size
        segs = [s for s in state.plan.segments[:state.saved] if s.end <= full]
        return vllm_pd.handoff_params([s.key.hex for s in segs], segs[-1].end if segs else 0)


def _blocks_handed_out(scheduler_output) -> set[int]:
    """vLLM's blocks this step hands to requests (new, grown, resumed, copied into): a flush
    reading a freed block must end before the step writes them (the worker waits for it)."""
    out: set[int] = set()
    for new in scheduler_output.scheduled_new_reqs:
        for ids in new.block_ids:
            out.update(ids)
    for tables in scheduler_output.scheduled_cached_reqs.new_block_ids:
        for ids in tables or ():
            out.update(ids)
    for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
        out.add(copy.dst_block_id)
    return out
