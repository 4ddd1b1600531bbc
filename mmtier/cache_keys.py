"""Content keys and tenants of a ``TieredKVCache``: the tenant salt, ``content_key`` (the bytes
hashed here), ``prefix_key`` (a sequence's chain) and the check of a caller's key. A part of
``TieredKVCache`` (this class is one of its bases), kept in its own file.
"""

from __future__ import annotations

from .config import ModalitySpec
from .content import ContentKey, media_digest, tenant_salt
from .errors import DTypeError, ForeignKeyError, PrefixMismatchError, UnknownModalityError
from .table import SequenceHandle, SequenceTable

DEFAULT_TENANT = "default"


class KeyAPI:
    """Keys and tenants over ``TieredKVCache``'s own state (its config, key maker, lineage and
    sequence tables)."""

    def _salt(self, tenant: str | None) -> bytes:
        tenant = DEFAULT_TENANT if tenant is None else tenant
        if not isinstance(tenant, str) or not tenant:
            raise ForeignKeyError(f"tenant must be a non-empty string, got {tenant!r}")
        return tenant_salt(self.cfg.key_secret, tenant)

    def content_key(
        self,
        modality: str,
        media: bytes | bytearray | memoryview,
        *,
        tenant: str | None = None,
        parent: ContentKey | None = None,
        params: dict[str, object] | None = None,
    ) -> ContentKey:
        """The key of a media item: hashes the bytes here (never trusts a caller's id).

        ``parent`` (a ``prefix_key``) makes the key prefix-dependent; ``params`` are the
        preprocessing parameters that change the tokens (resolution, sample rate, ...)."""
        spec = self.cfg.spec(modality)
        if not isinstance(media, (bytes, bytearray, memoryview)):
            raise DTypeError(f"media must be bytes-like, got {type(media).__name__}")
        key = self.keys.derive(
            modality=modality, layout=spec.layout_fields(), media=media_digest(media, params),
            tenant_salt=self._salt(tenant), parent=parent)
        if parent is not None:
            with self._lock:
                self.lineage.note(key, parent)
        return key

    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        """A key naming everything ``seq`` holds so far; pass it as ``parent=`` to chain."""
        with self._lock:
            table = self._table(seq)
            modality = table.tail.group.modality if table.tail else next(iter(self.cfg.modalities))
            key = self.keys.chain(modality=modality, chain_digest=table.chain,
                                  tenant_salt=self._salt(seq.tenant))
            last = next((s.group.key for s in reversed(table.segments) if s.group.key is not None), None)
            if last is not None:
                self.lineage.note(key, last)
            return key

    def _check_key(self, key: ContentKey, kind: str | None = None) -> ModalitySpec:
        self.keys.verify(key)
        spec = self.cfg.spec(key.modality)
        if kind is not None and spec.kind != kind:
            raise UnknownModalityError(f"modality {key.modality!r} holds {spec.kind!r} payloads, not {kind!r}")
        return spec

    def _check_place(self, seq: SequenceHandle, table: SequenceTable, key: ContentKey, before: bytes) -> None:
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
        here = self.keys.chain(modality=key.modality, chain_digest=before, tenant_salt=self._salt(seq.tenant))
        if key.parent != here.digest and key.parent != table.named.get(before):
            raise PrefixMismatchError(
                f"{key!r} was derived under another prefix than sequence {seq.id} holds where it would "
                "stand: its K/V were computed after other tokens (derive it with "
                "parent=prefix_key(seq), or the key placed last)")
