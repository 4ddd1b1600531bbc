"""``ClusterCache.attach``: a stored group referenced at a sequence's next position wherever it
is held: attached in the home pool, attended where it lives (a proxy on the holder), or copied
into the home pool through the object store, by the copy-after-N rule. A part of
``ClusterCache`` (this class is one of its bases), kept in its own file.
"""

from __future__ import annotations

from ..content import ContentKey, tenant_scope
from ..errors import ForeignKeyError, HolderLostError, PrefixMismatchError, UnknownKeyError
from ..table import SequenceHandle, naming
from . import placement
from .client_calls import _info_dict
from .client_state import Transfer, _chain, _Remote, _Seq, _Sub
from .registry import Location


class AttachOps:
    """Attaching groups held anywhere over ``ClusterCache``'s own state (its per-sequence state,
    holders and remote-use counts)."""

    async def attach_async(self, seq: SequenceHandle, key: ContentKey, *,
                           transfer: Transfer | None = None) -> None:
        """Reference a stored group at the sequence's next position, wherever it is held."""
        st = self._seq(seq)
        self._check_key(key, "kv")
        if key.scope != tenant_scope(self._salt(seq.tenant)):
            raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
        if transfer not in (None, "remote", "copy"):
            raise ValueError(f"transfer must be 'remote', 'copy' or None, got {transfer!r}")
        async with st.lock:
            self._check_place(seq, st, key)
            for _attempt in range(3):       # a holder found dead on the way: look up again
                loc = (await self._lookup([key]))[0]
                self.metrics.hit(key.modality, loc is not None)
                if loc is None:
                    raise UnknownKeyError(f"{key!r} is not in the cluster cache (put it first)")
                holders = [h for h, _ in loc.holders if h in self._actors]
                if not holders:
                    self.refresh()
                    holders = [h for h, _ in loc.holders if h in self._actors]
                if not holders:
                    raise HolderLostError(f"{key!r}: no live holder")
                if st.home is None:
                    st.home = self._best_home([loc]) or self._default_home()
                    self._homed[st.home] += 1
                try:
                    await self._attach_once(st, key, loc, holders, transfer)
                except HolderLostError:
                    if st.home not in self._actors:
                        raise
                    continue
                st.attached.append(key)
                st.length += loc.num_tokens
                names = naming(key, st.chain)
                st.chain = _chain(st.chain, b"group:" + key.digest)
                if names is not None:
                    st.named[st.chain] = names
                st.tail_modality = key.modality
                self._registry.ref.remote([key.hex], 1)
                return
            raise HolderLostError(f"{key!r}: its holders kept failing")

    def _check_place(self, seq: SequenceHandle, st: _Seq, key: ContentKey) -> None:
        """The rule of ``TieredKVCache._check_place`` over the cluster sequence's chain: a
        prefix-dependent key only where the sequence holds the prefix it was derived under."""
        if key.sharing != "prefix":
            return
        here = self.keys.chain(modality=key.modality, chain_digest=st.chain, tenant_salt=self._salt(seq.tenant))
        if key.parent is None or key.parent not in (here.digest, st.named.get(st.chain)):
            raise PrefixMismatchError(
                f"{key!r} was derived under another prefix than sequence {seq.id} holds at position "
                f"{st.length}: its K/V were computed after other tokens (derive it with "
                "parent=prefix_key(seq), or the key placed last)")

    async def _attach_once(self, st: _Seq, key: ContentKey, loc: Location, holders: list[str],
                           transfer: Transfer | None) -> None:
        home = st.home
        if home not in holders:
            uses_key = (home, key.digest)
            self._remote_uses[uses_key] += 1
            copy = placement.should_copy(transfer, self._remote_uses[uses_key],
                                         self.settings.copy_after_remote_uses)
            if not copy:
                await self._attach_remote(st, key, self._nearest(holders, home))
                return
            await self._copy(key, loc, self._nearest(holders, home), home)
        sub = None if st.sealed else st.subs[-1]
        try:
            handle, _start, _n, evicted = await self._call(self._actor(home).attach.remote(
                sub.handle if sub else None, st.handle.tenant, key.to_wire()), home)
        except HolderLostError:
            raise
        except UnknownKeyError:
            self._forget_evicted(home, [key.hex])          # the registry was stale: a miss
            raise HolderLostError(f"{key!r} left {home} meanwhile") from None
        if sub is None:
            sub = _Sub(handle, st.length)
            st.subs.append(sub)
            st.sealed = False
        sub.keys.append(key)
        self._forget_evicted(home, evicted)

    def _nearest(self, holders: list[str], home: str) -> str:
        """A holder on the home's node first (a store there is cheapest), then any pool."""
        return placement.nearest(holders, home, self._info)

    async def _attach_remote(self, st: _Seq, key: ContentKey, holder: str) -> None:
        info = self._info[holder]
        local_start = None
        if info.kind == "pool":
            local_start = st.proxy_starts.get((holder, key.digest))
            if local_start is None:
                handle, local_start, _n, evicted = await self._call(self._actor(holder).attach.remote(
                    st.proxies.get(holder), st.handle.tenant, key.to_wire()), holder)
                st.proxies[holder] = handle
                st.proxy_starts[(holder, key.digest)] = local_start
                self._forget_evicted(holder, evicted)
        else:
            held = await self._call(self._actor(holder).holds.remote([key.to_wire()]), holder)
            if not held[0]:
                self._forget_evicted(holder, [key.hex])
                raise HolderLostError(f"{key!r} left {holder} meanwhile")
        st.remotes.append(_Remote(holder, key, st.length, local_start))
        st.sealed = True

    async def _copy(self, key: ContentKey, loc: Location, src: str, dst: str) -> None:
        """Ship a group's pages ``src -> dst`` through the object store (the client never
        touches the bytes) and record the new holder."""
        meta_ref, buf_ref = self._actor(src).export.options(num_returns=2).remote(key.to_wire())
        await self._call(meta_ref, src)
        item, evicted = await self._call(self._actor(dst).import_group.remote(key.to_wire(), meta_ref, buf_ref), dst)
        self._forget_evicted(dst, evicted)
        if item is not None:
            await self._call(self._registry.add.remote(dst, [item], _info_dict(self._info[dst])))
            self.metrics.copied(key.modality, loc.nbytes)
            self.counters["copies"] += 1
