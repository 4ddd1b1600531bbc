"""Media bytes the Serve app accepts, checked before a turn is routed: ``image/png``,
``image/jpeg`` (decoded in full by Pillow), ``video/mp4`` (every frame decoded by PyAV),
``audio/wav`` (PCM16, read by the stdlib ``wave``) and ``audio/mpeg`` (MP3, every frame decoded
by PyAV).

``check_image`` / ``check_video`` / ``check_wav`` / ``check_mp3`` return what the bytes hold (``ImageInfo`` /
``VideoInfo`` / ``AudioInfo``) or raise ``BadMediaError``: ``unsupported`` when the bytes are
another format (a GIF, a WebM or QuickTime video, a float WAV) or a media type the app does not
take, else bytes that do not decode (truncated, not an image).
Sizes are checked from the header before anything is decoded (a decompression bomb is refused
by its declared size), so a check costs at most one decode of an item within the limits.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BadMediaError

if TYPE_CHECKING:                     # video_frames imports torch: only when a video is checked
    from ..engines.transformers.video_frames import VideoHeader

IMAGE_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg"}      # Pillow format -> media type
AUDIO_TYPES = ("audio/wav",)                  # mmtier's own app; the vLLM ingress also takes MP3
VIDEO_TYPES = ("video/mp4",)
ACCEPTED = {"image": tuple(IMAGE_TYPES.values()), "video": VIDEO_TYPES, "audio": AUDIO_TYPES}
MIN_RATE, MAX_RATE = 1000, 192_000
MP3_SLACK_S = 0.1                     # an MP3's decoded length may fall short of its header's by a frame


@dataclass(frozen=True)
class ImageInfo:
    media_type: str            # "image/png" | "image/jpeg"
    width: int
    height: int


@dataclass(frozen=True)
class VideoInfo:
    media_type: str            # "video/mp4"
    header: VideoHeader        # codec, frame size, frames and rate, as the MP4 declares them


@dataclass(frozen=True)
class AudioInfo:
    media_type: str            # "audio/wav" | "audio/mpeg"
    rate: int                  # samples per second
    channels: int
    frames: int

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


class TooLargeMedia(BadMediaError):
    """Well-formed media whose declared size is over a limit (the app answers 413)."""


def check_image(data: bytes, max_pixels: int) -> ImageInfo:
    """A PNG or JPEG that decodes in full, of at most ``max_pixels`` pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise BadMediaError("not a PNG or JPEG image (Pillow cannot identify it)") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadMediaError(f"the image does not decode ({exc})") from None
    with img:
        kind = IMAGE_TYPES.get(img.format or "")
        if kind is None:
            raise BadMediaError(f"{img.format} images are not accepted; send image/png or image/jpeg",
                                unsupported=True)
        width, height = img.size
        if width < 1 or height < 1:
            raise BadMediaError(f"an image of {width}x{height} pixels")
        if width * height > max_pixels:
            raise TooLargeMedia(f"an image of {width}x{height} pixels is over the {max_pixels}-pixel limit")
        try:
            img.load()                                  # the whole image: a truncated one fails here
        except (OSError, ValueError, SyntaxError) as exc:
            raise BadMediaError(f"the image does not decode ({exc})") from None
    return ImageInfo(kind, width, height)


def check_wav(data: bytes, max_seconds: float) -> AudioInfo:
    """A RIFF/WAVE file of 16-bit PCM, mono or stereo, whose frames are all there."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise BadMediaError("not a WAV file (no RIFF/WAVE header)")
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, rate, frames = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            if width != 2:
                raise BadMediaError(f"{8 * width}-bit WAV is not accepted; send 16-bit PCM", unsupported=True)
            if channels not in (1, 2):
                raise BadMediaError(f"a WAV of {channels} channels; send mono or stereo", unsupported=True)
            if not MIN_RATE <= rate <= MAX_RATE:
                raise BadMediaError(f"a sample rate of {rate} Hz; send {MIN_RATE}-{MAX_RATE} Hz")
            if frames < 1:
                raise BadMediaError("a WAV with no samples")
            if frames > max_seconds * rate:
                raise TooLargeMedia(f"{frames / rate:.1f} s of audio is over the {max_seconds} s limit")
            got = len(w.readframes(frames))
    except wave.Error as exc:                           # e.g. "unknown format: 3" (float samples)
        raise BadMediaError(f"not a PCM WAV file ({exc}); send 16-bit PCM", unsupported=True) from None
    except (EOFError, OSError) as exc:
        raise BadMediaError(f"the WAV file is cut short ({exc or 'end of data'})") from None
    if got != frames * channels * width:
        raise BadMediaError(f"the WAV file is cut short: {got} of {frames * channels * width} sample bytes")
    return AudioInfo("audio/wav", rate, channels, frames)


def check_mp3(data: bytes, max_seconds: float) -> AudioInfo:
    """An MP3 (an ID3 tag or an MPEG audio frame first) whose every frame decodes (PyAV, with
    the decoder's ``err_detect=explode``: a damaged frame is an error), of at most
    ``max_seconds``: the declared length is checked before decoding, the decoded one after."""
    import av

    if not (data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0)):
        raise BadMediaError("not an MP3 file (no ID3 tag or MPEG audio frame first)")
    frames = rate = channels = 0
    declared = None
    try:
        with av.open(io.BytesIO(data), format="mp3") as container:
            declared = None if container.duration is None else container.duration / av.time_base
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None or stream.codec_context.name not in ("mp3", "mp3float"):
                raise BadMediaError("an MP3 container with no MP3 audio stream", unsupported=True)
            if declared is not None and declared > max_seconds:
                raise TooLargeMedia(f"{declared:.1f} s of audio is over the {max_seconds} s limit")
            stream.codec_context.options = {"err_detect": "explode"}
            rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
            for frame in container.decode(stream):
                frames += frame.samples
                if frames > max_seconds * rate:
                    raise TooLargeMedia(f"over {max_seconds} s of audio (the limit)")
    except av.FFmpegError as exc:
        raise BadMediaError(f"the MP3 does not decode ({exc})") from None
    if frames < 1 or not MIN_RATE <= rate <= MAX_RATE:
        raise BadMediaError(f"an MP3 of {frames} samples at {rate} Hz")
    if declared is not None and frames < (declared - MP3_SLACK_S) * rate:      # frames are independent:
        raise BadMediaError(f"the MP3 is cut short: {frames / rate:.2f} s of the {declared:.2f} s its "
                            "header declares")                                  # a cut file decodes
    return AudioInfo("audio/mpeg", rate, channels, frames)


def check_video(data: bytes, max_seconds: float, max_frames: int, max_pixels: int) -> VideoInfo:
    """An MP4 whose every frame decodes, of at most ``max_seconds``, ``max_frames`` frames and
    ``max_pixels`` pixels a frame, all as its header declares them, checked before any frame is
    decoded (a video bomb is refused by its declared size)."""
    from ..engines.transformers.video_frames import decode, probe

    header = probe(data)
    if header.pixels > max_pixels:
        raise TooLargeMedia(f"video frames of {header.width}x{header.height} pixels are over the "
                            f"{max_pixels}-pixel limit")
    if header.frames > max_frames:
        raise TooLargeMedia(f"a video of {header.frames} frames is over the {max_frames}-frame limit")
    if header.seconds > max_seconds:
        raise TooLargeMedia(f"{header.seconds:.1f} s of video is over the {max_seconds} s limit")
    decode(data, header, keep=set())          # every frame: a cut-short or corrupt file fails here
    return VideoInfo(VIDEO_TYPES[0], header)
