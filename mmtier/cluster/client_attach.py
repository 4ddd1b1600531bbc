"""``Attacher``: ``ClusterCache.attach``, a stored group referenced at a sequence's next position
wherever it is held: attached in the home pool, attended where it lives (a proxy on the holder),
or copied into the home pool through the object store, by the copy-after-N rule. It owns the
count of remote uses per (home, group) that rule reads."""

from __future__ import annotations

from collections import Counter

from ..content import ContentKey, tenant_scope
from ..core.segments import SequenceHandle, naming
from ..errors import ForeignKeyError, HolderLostError, PrefixMismatchError, UnknownKeyError
from . import client_placement as placement
from .client_holders import Holders
from .client_keys import ClusterKeys
from .client_sequence_state import HomeRun, RemoteAttachment, SequenceState, Transfer, next_chain
from .client_sequences import SequenceBook
from .metrics import ClientMetrics
from .registry import Location
from .transfer_copies import GroupCopier


class Attacher:
    def __init__(self, book: SequenceBook, keys: ClusterKeys, holders: Holders, copier: GroupCopier,
                 metrics: ClientMetrics, copy_after_remote_uses: int):
        self.book = book
        self.keys = keys
        self.holders = holders
        self.copier = copier
        self.metrics = metrics
        self.copy_after = copy_after_remote_uses
        self.remote_uses: Counter[tuple[str, bytes]] = Counter()

    async def attach(self, seq: SequenceHandle, key: ContentKey, *, transfer: Transfer | None = None) -> None:
        """Reference a stored group at the sequence's next position, wherever it is held."""
        st = self.book.get(seq)
        self.keys.check(key, "kv")
        if key.scope != tenant_scope(self.keys.salt(seq.tenant)):
            raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
        if transfer not in (None, "remote", "copy"):
            raise ValueError(f"transfer must be 'remote', 'copy' or None, got {transfer!r}")
        h = self.holders
        async with st.lock:
            self._check_place(seq, st, key)
            for _attempt in range(3):       # a holder found dead on the way: look up again
                loc = (await h.lookup([key]))[0]
                self.metrics.hit(key.modality, loc is not None)
                if loc is None:
                    raise UnknownKeyError(f"{key!r} is not in the cluster cache (put it first)")
                holders = h.alive(n for n, _ in loc.holders)
                if not holders:
                    h.refresh()
                    holders = h.alive(n for n, _ in loc.holders)
                if not holders:
                    raise HolderLostError(f"{key!r}: no live holder")
                if st.home is None:
                    self.book.set_home(st, self.book.best_home([loc]) or self.book.default_home())
                try:
                    await self._attach_once(st, key, loc, holders, transfer)
                except HolderLostError:
                    if st.home not in h.actors:
                        raise
                    continue
                st.attached.append(key)
                st.length += loc.num_tokens
                names = naming(key, st.chain)
                st.chain = next_chain(st.chain, b"group:" + key.digest)
                if names is not None:
                    st.named[st.chain] = names
                st.tail_modality = key.modality
                h.registry.ref([key.address], 1)
                return
            raise HolderLostError(f"{key!r}: its holders kept failing")

    def _check_place(self, seq: SequenceHandle, st: SequenceState, key: ContentKey) -> None:
        """The rule of ``CacheKeys.check_place`` (``mmtier/cache/keys.py``) over the cluster
        sequence's chain: a prefix-dependent key only where the sequence holds the prefix it was
        derived under."""
        if key.sharing != "prefix":
            return
        here = self.keys.chain_key(key.modality, st.chain, seq.tenant)
        if key.parent is None or key.parent not in (here.digest, st.named.get(st.chain)):
            raise PrefixMismatchError(
                f"{key!r} was derived under another prefix than sequence {seq.id} holds at position "
                f"{st.length}: its K/V were computed after other tokens (derive it with "
                "parent=prefix_key(seq), or the key placed last)")

    async def _attach_once(self, st: SequenceState, key: ContentKey, loc: Location,
                           holders: list[str], transfer: Transfer | None) -> None:
        h = self.holders
        home = st.home
        if home not in holders:
            uses_key = (home, key.digest)
            self.remote_uses[uses_key] += 1
            copy = placement.should_copy(transfer, self.remote_uses[uses_key], self.copy_after)
            if not copy:
                await self.attend_remotely(st, key, self.nearest(holders, home))
                return
            await self.copier.copy(key, loc, self.nearest(holders, home), home)
        sub = None if st.sealed else st.subs[-1]
        try:
            handle, _start, _n, evicted = await h.call(h.actor(home).attach.remote(
                sub.handle if sub else None, st.handle.tenant, key.to_wire()), home)
        except HolderLostError:
            raise
        except UnknownKeyError:
            h.forget_evicted(home, [key.address])          # the registry was stale: a miss
            raise HolderLostError(f"{key!r} left {home} meanwhile") from None
        if sub is None:
            sub = HomeRun(handle, st.length)
            st.subs.append(sub)
            st.sealed = False
        sub.keys.append(key)
        h.forget_evicted(home, evicted)

    def nearest(self, holders: list[str], home: str) -> str:
        """A holder on the home's node first (a store there is cheapest), then any pool."""
        return placement.nearest(holders, home, self.holders.info)

    async def proxy_start(self, st: SequenceState, key: ContentKey, holder: str) -> int:
        """Where ``key`` starts in the sequence's proxy on the pool ``holder`` (attached there
        the first time)."""
        h = self.holders
        local_start = st.proxy_starts.get((holder, key.digest))
        if local_start is None:
            handle, local_start, _n, evicted = await h.call(h.actor(holder).attach.remote(
                st.proxies.get(holder), st.handle.tenant, key.to_wire()), holder)
            st.proxies[holder] = handle
            st.proxy_starts[(holder, key.digest)] = local_start
            h.forget_evicted(holder, evicted)
        return local_start

    async def attend_remotely(self, st: SequenceState, key: ContentKey, holder: str) -> None:
        h = self.holders
        local_start = None
        if h.kind(holder) == "pool":
            local_start = await self.proxy_start(st, key, holder)
        else:
            held = await h.call(h.actor(holder).holds.remote([key.to_wire()]), holder)
            if not held[0]:
                h.forget_evicted(holder, [key.address])
                raise HolderLostError(f"{key!r} left {holder} meanwhile")
        st.remotes.append(RemoteAttachment(holder, key, st.length, local_start))
        st.sealed = True
