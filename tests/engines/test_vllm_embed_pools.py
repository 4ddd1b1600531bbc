"""Which mmtier pool holds a vLLM media item's encoder output (``vllm.keys.embed_pools``): the
encoder-cache connector and the router that locates items both read it, so an image, a video
and a clip each land in their medium's pool and nowhere else."""

from __future__ import annotations

import pytest

from mmtier.config import CacheConfig
from mmtier.engines.vllm.keys import embed_pools
from mmtier.errors import ConfigError


def cfg(*embeds: str) -> CacheConfig:
    mods = {"text": {"page_size": 32, "share": 0.5}, "audio": {"page_size": 32, "share": 0.1}}
    for name in embeds:
        mods[name] = {"kind": "embedding", "width": 16, "page_size": 8, "share": 0.1}
    return CacheConfig(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", modalities=mods,
                       device="cpu", device_bytes=1 << 20, host_bytes=0)


def test_each_medium_goes_to_the_embedding_pool_of_its_kv_modality():
    assert embed_pools(cfg("vision_embed", "audio_embed"), {}) == {
        "image": "vision_embed", "video": "vision_embed", "audio": "audio_embed"}
    assert embed_pools(cfg("audio_embed"), {}) == {"audio": "audio_embed"}   # images: not cached


def test_the_modality_map_and_a_named_pool_override_it():
    both = cfg("vision_embed", "audio_embed")
    assert embed_pools(both, {"mmtier_modalities": {"video": "audio"}})["video"] == "audio_embed"
    assert set(embed_pools(both, {"mmtier_embed_modality": "audio_embed"}).values()) == {"audio_embed"}


@pytest.mark.parametrize("extra", [{"mmtier_embed_modality": "audio"}, {"mmtier_embed_modality": "nope"}, {}])
def test_a_pool_that_holds_no_embeddings_is_refused(extra):
    with pytest.raises(ConfigError):
        embed_pools(cfg(), extra)
