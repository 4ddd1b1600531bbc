"""``ClusterKeys``: the keys of a ``ClusterCache``, derived exactly as a ``TieredKVCache`` with the
same config derives them (the config, secret included, comes from the registry), so they are
identical on every node: tenant salts, ``content_key``, the chain key of a sequence's prefix, and
the check every key passed in goes through."""

from __future__ import annotations

from ..cache.keys import media_key, salt_of
from ..config import CacheConfig
from ..content import ContentKey, KeyMaker
from ..errors import UnknownModalityError


class ClusterKeys:
    def __init__(self, cfg: CacheConfig):
        self.cfg = cfg
        self.maker = KeyMaker(cfg.model, cfg.key_secret)

    def salt(self, tenant: str | None) -> bytes:
        return salt_of(self.cfg, tenant)

    def content_key(self, modality: str, media: bytes | bytearray | memoryview, *,
                    tenant: str | None = None, parent: ContentKey | None = None,
                    params: dict[str, object] | None = None) -> ContentKey:
        """The key of a media item: the same bytes give the same key on every node."""
        return media_key(self.cfg, self.maker, modality, media, tenant=tenant, parent=parent, params=params)

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
