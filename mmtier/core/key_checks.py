"""``spec_of_key``: the check of a caller's content key against a cache's config, with the spec
it names: the key is authentic for the cache's ``KeyMaker``, its modality is configured and, when
asked, holds that payload kind. Shared by the key part (``cache.keys.CacheKeys``) and residency
(``tiers.residency.Residency``), neither of which imports the other.
"""

from __future__ import annotations

from ..config import CacheConfig, ModalitySpec
from ..content import ContentKey, KeyMaker
from ..errors import UnknownModalityError


def spec_of_key(cfg: CacheConfig, maker: KeyMaker, key: ContentKey, kind: str | None = None) -> ModalitySpec:
    """The spec of ``key``'s modality once the key is checked (``kind``: ``"kv"`` or
    ``"embedding"``, the payload its modality must hold)."""
    maker.verify(key)
    spec = cfg.spec(key.modality)
    if kind is not None and spec.kind != kind:
        raise UnknownModalityError(f"modality {key.modality!r} holds {spec.kind!r} payloads, not {kind!r}")
    return spec
