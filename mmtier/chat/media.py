"""What a chat turn's items become before the models see them: text as byte-level token ids,
images (PNG / JPEG bytes) as Qwen2-VL image inputs, videos (MP4 bytes) as Qwen2-VL video inputs,
audio (WAV PCM16 bytes) as Whisper features.

Text. No tokenizer can be downloaded, so the vocabulary is built here: a byte ``b`` is token
``b + BYTE0``; a few ids below and above are special (``VOCAB``). Its text form is lossless
(``bytes_text``): an answer's bytes that are not UTF-8 are written as private-use characters, so
an answer sent back as history is the same tokens. Both demo models use it; a
model loaded from a directory with its own tokenizer would map text through that instead.

Images are decoded by Pillow and prepared by the model's own image processor
(``Qwen2VLImageProcessorPil``). The number of image tokens (the processor's resize rule over the
image's header size) is known without touching the pixels, so a cached image is never decoded:
``ImageItem.inputs()`` runs the processor only when the vision tower has to run.

Videos are MP4 files read by PyAV (``video_frames``): the header gives the frames sampled at the
processor's fps and the grid, so the number of video tokens is known without decoding a frame;
``VideoItem.inputs`` decodes and patches the sampled frames only when the vision tower has to
run, and ``VideoItem.segment_inputs`` gives one segment's (a span of temporal patches).

Audio is read with the stdlib ``wave`` (mono or stereo PCM16, any rate, resampled linearly to the
feature extractor's rate) and turned into log-mel features by ``WhisperFeatureExtractor`` on
demand (a lazy mapping: a cached clip is never featurised).
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..engines.transformers.video_frames import (
    VideoHeader,
    VideoProcessor,
    probe,
    segment_inputs,
    segments,
)
from ..errors import BadMediaError, ShapeError

# -------------------------------------------------------------------------- text
PAD, BOS, EOS, UNK = 0, 1, 2, 3
BYTE0 = 4                                   # token of byte 0
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 260, 261, 262, 263
AUDIO_START, AUDIO_END = 264, 265
VOCAB = 272
SPECIAL = (PAD, BOS, EOS, UNK, *range(BYTE0 + 256, VOCAB))    # never generated in an answer


ESCAPE0 = 0x10FE00                          # U+10FE00 + b: byte b of an answer that is not UTF-8


def text_bytes(text: str) -> bytes:
    """The bytes of ``text``: UTF-8, except that a character ``U+10FE00 + b`` (Supplementary
    Private Use Area B) is the byte ``b`` (``bytes_text`` writes bytes that are not UTF-8 so).
    ``UnicodeEncodeError`` for a lone surrogate."""
    if not any(ESCAPE0 <= ord(c) <= ESCAPE0 + 0xFF for c in text):
        return text.encode()
    return b"".join(bytes([ord(c) - ESCAPE0]) if ESCAPE0 <= ord(c) <= ESCAPE0 + 0xFF else c.encode() for c in text)


def bytes_text(data: bytes) -> str:
    """``data`` as text, losslessly: UTF-8 where it is, each other byte ``b`` as ``U+10FE00 + b``
    (and each byte of a character in that range, so that it too comes back as itself):
    ``text_bytes(bytes_text(data)) == data`` for any bytes. A client that sends an answer back
    as it got it (an OpenAI ``assistant`` message) sends back exactly its tokens."""
    out = []
    for c in data.decode(errors="surrogateescape"):
        o = ord(c)
        if 0xDC80 <= o <= 0xDCFF:                   # a byte that is not UTF-8
            out.append(chr(ESCAPE0 + o - 0xDC00))
        elif ESCAPE0 <= o <= ESCAPE0 + 0xFF:        # valid UTF-8 of an escape character: as bytes
            out += [chr(ESCAPE0 + b) for b in c.encode()]
        else:
            out.append(c)
    return "".join(out)


def text_ids(text: str) -> list[int]:
    """Byte-level token ids of ``text`` (``text_bytes``: UTF-8, escaped bytes as themselves)."""
    return [b + BYTE0 for b in text_bytes(text)]


def ids_text(ids: list[int]) -> str:
    """The text of byte-level ids (special ids dropped; ``bytes_text``: lossless, so
    ``text_ids(ids_text(ids)) == ids`` for an answer's ids)."""
    return bytes_text(bytes(i - BYTE0 for i in ids if BYTE0 <= i < BYTE0 + 256))


# -------------------------------------------------------------------------- items
PNG = b"\x89PNG\r\n\x1a\n"
JPEG = b"\xff\xd8\xff"


def kind_of(item) -> str:
    """``"text"``, ``"image"``, ``"video"`` or ``"audio"`` for a turn's item; ``ShapeError``
    otherwise."""
    if isinstance(item, str):
        return "text"
    if isinstance(item, bytes | bytearray | memoryview):
        head = bytes(item[:12])
        if head.startswith(PNG) or head.startswith(JPEG):
            return "image"
        if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            return "audio"
        if head[4:8] == b"ftyp":
            return "video"
        raise ShapeError("a media item must be PNG, JPEG, MP4 or WAV bytes (its first bytes say which)")
    raise ShapeError(f"a turn's items are text (str) or media bytes, not {type(item).__name__}")


@dataclass
class ImageItem:
    """An image of a turn: its bytes, its grid of patches, its pixels on demand."""

    data: bytes
    processor: object
    grid: tuple[int, int, int]               # (t, h, w) patches, as the processor makes them

    @classmethod
    def read(cls, data: bytes, processor) -> ImageItem:
        from PIL import Image, UnidentifiedImageError
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        try:
            with Image.open(io.BytesIO(data)) as im:       # the header only
                width, height = im.size
        except (UnidentifiedImageError, OSError) as exc:
            raise ShapeError(f"image bytes could not be read: {exc}") from None
        patch, merge = processor.patch_size, processor.merge_size
        size = processor.size
        h, w = smart_resize(height, width, patch * merge, size["shortest_edge"], size["longest_edge"])
        return cls(bytes(data), processor, (1, h // patch, w // patch))

    @property
    def tokens(self) -> int:
        """Decoder tokens of this image (after the processor's 2x2 merge)."""
        t, h, w = self.grid
        return t * h * w // (self.processor.merge_size ** 2)

    @cached_property
    def inputs(self) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` from the model's image processor."""
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as im:
            out = self.processor(images=[im.convert("RGB")], return_tensors="pt")
        if tuple(out["image_grid_thw"][0].tolist()) != self.grid:
            raise ShapeError(f"the image processor made grid {out['image_grid_thw'][0].tolist()}, "
                             f"expected {list(self.grid)}")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


@dataclass
class VideoItem:
    """A video of a turn: its bytes, its header, its grid of patches (from the header), its
    pixels on demand; cut into segments of ``segment`` temporal patches."""

    data: bytes
    processor: VideoProcessor
    header: VideoHeader
    grid: tuple[int, int, int]               # (t, h, w) patches of the sampled frames
    segment: int

    @classmethod
    def read(cls, data: bytes, processor: VideoProcessor, segment: int) -> VideoItem:
        try:
            header = probe(bytes(data))
            return cls(bytes(data), processor, header, processor.grid(header), segment)
        except BadMediaError as exc:
            raise ShapeError(f"video bytes could not be read: {exc}") from None

    @property
    def tokens(self) -> int:
        return self.processor.tokens(self.grid)

    @property
    def segments(self) -> list[tuple[int, int]]:
        """``[a, b)`` temporal patches of each segment, in order."""
        return segments(self.grid[0], self.segment)

    def segment_tokens(self, a: int, b: int) -> int:
        return self.processor.tokens((b - a, *self.grid[1:]))

    @property
    def second_per_grid(self) -> float:
        return self.processor.second_per_grid(self.header)

    @cached_property
    def inputs(self) -> dict[str, torch.Tensor]:
        """``pixel_values_videos`` and ``video_grid_thw`` of the whole video (decoded once)."""
        try:
            out = self.processor.inputs(self.data, self.header)
        except BadMediaError as exc:
            raise ShapeError(f"the video does not decode: {exc}") from None
        if tuple(out["video_grid_thw"][0].tolist()) != self.grid:
            raise ShapeError(f"the video processor made grid {out['video_grid_thw'][0].tolist()}, "
                             f"expected {list(self.grid)}")
        return out

    def segment_inputs(self, a: int, b: int) -> dict[str, torch.Tensor]:
        return segment_inputs(self.inputs, a, b)


def read_wav(data: bytes, rate: int) -> np.ndarray:
    """Mono float32 samples at ``rate`` Hz from WAV PCM16 bytes."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            if w.getsampwidth() != 2:
                raise ShapeError(f"WAV sample width {w.getsampwidth()} bytes: only PCM16 is read")
            channels, src = w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ShapeError(f"WAV bytes could not be read: {exc}") from None
    x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        x = x[: len(x) // channels * channels].reshape(-1, channels).mean(1)
    if x.size == 0:
        raise ShapeError("the WAV clip has no samples")
    if src != rate:
        n = max(1, round(x.size * rate / src))
        x = np.interp(np.linspace(0, x.size - 1, n), np.arange(x.size), x).astype(np.float32)
    return x


class AudioFeatures(Mapping):
    """``{"input_features": ...}`` of a clip (read from WAV bytes at once, so bad bytes fail
    before anything changes), featurised when first read: a cached clip never is."""

    def __init__(self, data: bytes, extractor):
        self.samples = read_wav(data, extractor.sampling_rate)
        self.extractor = extractor

    @cached_property
    def _features(self) -> dict[str, torch.Tensor]:
        fe = self.extractor
        out = fe(self.samples, sampling_rate=fe.sampling_rate, return_tensors="pt")
        return {"input_features": out["input_features"]}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._features[name]

    def __iter__(self) -> Iterator[str]:
        return iter(("input_features",))

    def __len__(self) -> int:
        return 1
