"""A test fixture: a small seeded reference model that drives the cache with real attention
(text, image and audio encoders, cross attention), for the end-to-end, pool-host and
hosted-remote tests. It is not part of mmtier: the demo, the benchmarks and Serve run the
transformers models (``mmtier.chat.model``). No weights are downloaded: it is seeded and
deterministic.

    from mmtier import TieredKVCache
    from tests.support.reference_model import Audio, Image, ReferenceModel, Text

    model = ReferenceModel(seed=0)
    with TieredKVCache(model.cache_config(device_bytes=16 << 20)) as cache:
        tokens = model.generate(cache, "acme", [Text("describe "), Image(png_bytes)], 8)
        assert tokens == model.generate_dense([Text("describe "), Image(png_bytes)], 8)
"""

from .decoder import Decoder, DecoderDims
from .encoders import AudioEncoder, MediaError, ModelError, VisionEncoder
from .reference import (
    Audio,
    Image,
    Media,
    ModelCounters,
    PromptError,
    ReferenceModel,
    Text,
    cross_modality,
    embed_modality,
    model_id,
    reference_config,
)
from .session import CachedSession

__all__ = [
    "Audio", "AudioEncoder", "CachedSession", "Decoder", "DecoderDims", "Image", "Media",
    "MediaError", "ModelCounters", "ModelError", "PromptError", "ReferenceModel", "Text",
    "VisionEncoder", "cross_modality", "embed_modality", "model_id", "reference_config",
]
