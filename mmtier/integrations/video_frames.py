"""Old path, kept for configs written against it; the code lives in ``mmtier.engines.transformers.video_frames``."""

from mmtier.engines.transformers.video_frames import (  # noqa: F401
    VideoHeader,
    VideoProcessor,
    decode,
    probe,
    segment_inputs,
    segments,
)
