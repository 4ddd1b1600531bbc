"""``CacheKeys``: the content keys of a ``TieredKVCache``: the tenant salt, ``content_key`` (the
bytes hashed here), a sequence's chain key (``prefix_key``), and the checks of a caller's key
and of the place a prefix-dependent key may stand in a sequence.
"""

from __future__ import annotations

from ..config import CacheConfig, ModalitySpec
from ..content import ContentKey, KeyMaker, media_digest, tenant_salt
from ..core.key_checks import spec_of_key
from ..core.lineage import Lineage
from ..core.locking import OwnerLock
from ..core.segments import SequenceHandle, SequenceTable
from ..errors import DTypeError, ForeignKeyError, PrefixMismatchError

DEFAULT_TENANT = "default"


def salt_of(cfg: CacheConfig, tenant: str | None) -> bytes:
    """The salt of ``tenant`` (``None``: the default tenant) under ``cfg``'s secret; a tenant that
    is not a non-empty string is refused (``ForeignKeyError``)."""
    tenant = DEFAULT_TENANT if tenant is None else tenant
    if not isinstance(tenant, str) or not tenant:
        raise ForeignKeyError(f"tenant must be a non-empty string, got {tenant!r}")
    return tenant_salt(cfg.key_secret, tenant)


def media_key(cfg: CacheConfig, maker: KeyMaker, modality: str, media: bytes | bytearray | memoryview, *,
              tenant: str | None, parent: ContentKey | None,
              params: dict[str, object] | None) -> ContentKey:
    """The key of a media item under ``cfg``: the same bytes, layout, tenant and parent give the
    same key in every cache and on every node (``TieredKVCache`` and ``ClusterCache`` both)."""
    spec = cfg.spec(modality)
    if not isinstance(media, (bytes, bytearray, memoryview)):
        raise DTypeError(f"media must be bytes-like, got {type(media).__name__}")
    return maker.derive(modality=modality, layout=spec.layout_fields(), media=media_digest(media, params),
                        tenant_salt=salt_of(cfg, tenant), parent=parent)


class CacheKeys:
    """Keys and tenants. Holds no state of its own beyond what it is given: the config, the key
    maker, the lineage the keys it derives are noted in, and the lock that guards the lineage."""

    def __init__(self, cfg: CacheConfig, maker: KeyMaker, lineage: Lineage, lock: OwnerLock):
        self.cfg, self.maker, self.lineage, self.lock = cfg, maker, lineage, lock

    def salt(self, tenant: str | None) -> bytes:
        return salt_of(self.cfg, tenant)

    def content_key(self, modality: str, media: bytes | bytearray | memoryview, *,
                    tenant: str | None = None, parent: ContentKey | None = None,
                    params: dict[str, object] | None = None) -> ContentKey:
        key = media_key(self.cfg, self.maker, modality, media, tenant=tenant, parent=parent, params=params)
        if parent is not None:
            with self.lock:
                self.lineage.note(key, parent)
        return key

    def prefix_key(self, seq: SequenceHandle, table: SequenceTable) -> ContentKey:
        """The chain key of what ``table`` holds (lock held), noted as the child of the key
        placed last in it."""
        modality = table.tail.group.modality if table.tail else next(iter(self.cfg.modalities))
        key = self.maker.chain(modality=modality, chain_digest=table.chain, tenant_salt=self.salt(seq.tenant))
        last = next((s.group.key for s in reversed(table.segments) if s.group.key is not None), None)
        if last is not None:
            self.lineage.note(key, last)
        return key

    def check_key(self, key: ContentKey, kind: str | None = None) -> ModalitySpec:
        return spec_of_key(self.cfg, self.maker, key, kind)

    def check_place(self, seq: SequenceHandle, table: SequenceTable, key: ContentKey, before: bytes) -> None:
        """A prefix-dependent ``key`` may stand where the sequence's chain is ``before`` only if
        it was derived under that prefix: its parent is the sequence's ``prefix_key`` there, or
        the key attached or sealed last there when that key names all before it
        (``table.naming``). Anything else is ``PrefixMismatchError``: its K/V were computed
        after other tokens. Content-only keys stand anywhere."""
        if key.sharing != "prefix":
            return
        if key.parent is None:
            raise PrefixMismatchError(f"{key!r} names no parent (a sequence's prefix_key names a "
                                      "prefix, not a group): it cannot be placed in a sequence")
        here = self.maker.chain(modality=key.modality, chain_digest=before, tenant_salt=self.salt(seq.tenant))
        if key.parent != here.digest and key.parent != table.named.get(before):
            raise PrefixMismatchError(
                f"{key!r} was derived under another prefix than sequence {seq.id} holds where it would "
                "stand: its K/V were computed after other tokens (derive it with "
                "parent=prefix_key(seq), or the key placed last)")
