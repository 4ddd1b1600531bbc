"""``ClusterKeys``: the keys of a ``ClusterCache``, derived exactly as a ``TieredKVCache`` with the
same config derives them (the config, secret included, comes from the registry), so they are
identical on every node: tenant salts, ``content_key``, the chain key of a sequence's prefix, and
the check every key passed in goes through."""

from __future__ import annotations

from ..cache.keys import DEFAULT_TENANT
from ..config import CacheConfig
from ..content import ContentKey, KeyMaker, media_digest, tenant_salt
from ..errors import DTypeError, ForeignKeyError, UnknownModalityError


class ClusterKeys:
    def __init__(self, cfg: CacheConfig):
        self.cfg = cfg
        self.maker = KeyMaker(cfg.model, cfg.key_secret)

    def salt(self, tenant: str | None) -> bytes:
        tenant = DEFAULT_TENANT if tenant is None else tenant
        if not isinstance(tenant, str) or not tenant:
            raise ForeignKeyError(f"tenant must be a non-empty string, got {tenant!r}")
        return tenant_salt(self.cfg.key_secret, tenant)

    def content_key(self, modality: str, media: bytes | bytearray | memoryview, *,
                    tenant: str | None = None, parent: ContentKey | None = None,
                    params: dict[str, object] | None = None) -> ContentKey:
        """The key of a media item: the same bytes give the same key on every node."""
        spec = self.cfg.spec(modality)
        if not isinstance(media, (bytes, bytearray, memoryview)):
            raise DTypeError(f"media must be bytes-like, got {type(media).__name__}")
        return self.maker.derive(modality=modality, layout=spec.layout_fields(),
                                 media=media_digest(media, params), tenant_salt=self.salt(tenant),
                                 parent=parent)

    def chain_key(self, modality: str | None, chain: bytes, tenant: str | None) -> ContentKey:
        """The key of the prefix whose chain digest is ``chain`` (``modality``: its last part's;
        ``None``: the config's first modality)."""
        modality = modality or next(iter(self.cfg.modalities))
        return self.maker.chain(modality=modality, chain_digest=chain, tenant_salt=self.salt(tenant))

    def check(self, key: ContentKey, kind: str | None = None) -> None:
        """``key`` was made under this config's secret and, with ``kind``, holds that payload."""
        self.maker.verify(key)
        spec = self.cfg.spec(key.modality)
        if kind is not None and spec.kind != kind:
            raise UnknownModalityError(f"modality {key.modality!r} holds {spec.kind!r} payloads, not {kind!r}")
