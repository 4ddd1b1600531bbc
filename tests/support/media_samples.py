"""Real media bytes for the Serve tests, made here (seeded): PNG / JPEG by Pillow, WAV (16-bit
PCM) by the stdlib ``wave``, and the bad kinds the app must refuse; ``part``: an item as an
OpenAI chat content part."""

from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np


def image(seed: int, size: tuple[int, int] = (32, 32), fmt: str = "PNG", flat: bool = False) -> bytes:
    """Seeded random pixels, or (``flat``) one seeded colour: a large image in few bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3)
    pixels = np.broadcast_to(rng.integers(0, 256, 3, dtype=np.uint8), shape) if flat else \
        rng.integers(0, 256, shape, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def wav(seed: int, seconds: float = 0.5, rate: int = 16000, channels: int = 1) -> bytes:
    """A seeded tone plus noise, 16-bit PCM."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.4 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.1 * rng.standard_normal(t.size)
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    pcm = np.repeat(pcm[:, None], channels, 1).reshape(-1)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def float_wav(frames: int = 800, rate: int = 16000) -> bytes:
    """A well-formed WAV of 32-bit float samples (format tag 3): not PCM16."""
    data = np.linspace(-0.5, 0.5, frames, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def video(seed: int, frames: int = 8, size: tuple[int, int] = (32, 24), fps: int = 4, fmt: str = "mp4",
          codec: str = "mpeg4", still: bool = False) -> bytes:
    """Seeded random frames encoded at test time by PyAV (FFmpeg) into an in-memory container:
    ``mp4`` (the accepted kind), or ``mov`` (QuickTime), ``webm`` / ``matroska`` (VP9) for the
    kinds the app refuses. ``still``: every frame the same."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    pixels = [first if still or i == 0 else rng.integers(0, 256, first.shape, dtype=np.uint8) for i in range(frames)]
    return encode_video(pixels, fps, fmt, "libvpx-vp9" if fmt in ("webm", "matroska") else codec)


def encode_video(pixels, fps: int, fmt: str = "mp4", codec: str = "mpeg4") -> bytes:
    """RGB frames (``[H, W, 3]`` uint8 each) encoded by PyAV into an in-memory ``fmt`` container."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = pixels[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for frame in pixels:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


DEFAULT_TYPE = {"image": "image/png", "video": "video/mp4"}
FORMATS = {"audio/wav": "wav", "audio/mpeg": "mp3"}


def part(item) -> dict:
    """An OpenAI content part: text, or ``(kind, bytes[, extra])``; ``extra``: ``media_type``
    (the data URL's type; an audio clip's ``format``) or other keys, put in the part as given."""
    if isinstance(item, str):
        return {"type": "text", "text": item}
    kind, data, extra = item[0], item[1], dict(item[2]) if len(item) > 2 else {}
    b64 = base64.b64encode(data).decode()
    declared = extra.pop("media_type", None)
    if kind == "audio":
        return {"type": "input_audio", "input_audio": {"data": b64, "format": FORMATS.get(declared, "wav"), **extra}}
    field = f"{kind}_url"
    return {"type": field, field: {"url": f"data:{declared or DEFAULT_TYPE[kind]};base64,{b64}", **extra}}
