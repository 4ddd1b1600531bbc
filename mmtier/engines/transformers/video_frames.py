"""Video bytes as Qwen2-VL / Qwen2.5-VL video inputs, without torchvision.

transformers' ``Qwen2VLVideoProcessor`` imports torchvision, and PyPI's torchvision does not
run beside the CPU build of torch mmtier pins. So the same inputs are made here from parts that
do run:

- **Decoding**: PyAV (FFmpeg's libraries, the ``av`` wheel): an MP4 container (``ftyp`` brand
  of the ISO family, not QuickTime) with one video stream in any codec the wheel decodes (H.264,
  MPEG-4 Part 2, HEVC, AV1, ...). ``probe`` reads the header only (size, frame count, rate);
  ``decode`` decodes every frame (so a cut-short file fails; the decoder's ``err_detect=explode``
  makes a damaged frame an error, not a concealed picture) and keeps the sampled ones as RGB.
- **Sampling** (``VideoProcessor.indices``): the rule of ``Qwen2VLVideoProcessor.sample_frames``
  with ``fps``: ``frames / rate * fps`` frames, within ``[min_frames, max_frames]`` and the
  video's frames, floored to a multiple of ``temporal_patch_size``, at
  ``arange(0, total, total / n)``.
- **Pixels**: each sampled frame is resized (the processor's ``smart_resize`` rule, bicubic),
  rescaled and normalised by the model's own PIL image processor
  (``Qwen2VLImageProcessorPil``, ``temporal_patch_size=1``), then the frames' patches are laid
  out as the video processor lays them out (``patchify``: temporal groups of
  ``temporal_patch_size`` frames, features ordered channel, frame, row, column):
  ``pixel_values_videos [t * h * w, C * tps * p * p]`` and ``video_grid_thw [[t, h, w]]``.
  The one difference from transformers' torchvision path: Pillow resizes the frames (as it
  resizes images), torchvision rounds some pixels otherwise.

The vision tower attends within each temporal patch only (its ``cu_seqlens`` are per temporal
patch), so the rows of temporal patches ``[a, b)`` run alone give the same output: that is what
lets a video be cut into segments (``VideoProcessor.segment_inputs``) that are encoded and cached
apart.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import BadMediaError

MP4_BRANDS = frozenset({b"isom", b"iso2", b"iso3", b"iso4", b"iso5", b"iso6", b"mp41", b"mp42", b"avc1",
                        b"dash", b"M4V ", b"mmp4", b"MSNV"})
MP4_DEMUXER = "mov,mp4,m4a,3gp,3g2,mj2"      # FFmpeg's demuxer of the ISO base media family


@dataclass(frozen=True)
class VideoHeader:
    """What an MP4's header declares (nothing decoded)."""

    codec: str
    width: int
    height: int
    frames: int
    fps: float

    @property
    def seconds(self) -> float:
        return self.frames / self.fps

    @property
    def pixels(self) -> int:
        return self.width * self.height


def probe(data: bytes) -> VideoHeader:
    """The header of MP4 bytes; ``BadMediaError`` (``unsupported``: another container, or no
    video stream) otherwise. Reads the container's index only, decodes no frame."""
    import av

    head = bytes(data[:12])
    if head[4:8] != b"ftyp":
        if _other_container(head):
            raise BadMediaError("this video container is not accepted; send video/mp4", unsupported=True)
        raise BadMediaError("not an MP4 file (no 'ftyp' box)")
    if head[8:12] not in MP4_BRANDS:
        brand = head[8:12].decode("latin-1")
        raise BadMediaError(f"an ISO media file of brand {brand!r} (QuickTime, 3GP, ...) is not accepted; "
                            "send video/mp4", unsupported=True)
    try:
        with av.open(io.BytesIO(data), "r") as container:
            if container.format.name != MP4_DEMUXER:
                raise BadMediaError(f"a {container.format.name} file; send video/mp4", unsupported=True)
            if not container.streams.video:
                raise BadMediaError("an MP4 with no video stream", unsupported=True)
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            header = VideoHeader(stream.codec_context.name, stream.width, stream.height, stream.frames,
                                 float(rate) if rate else 0.0)
    except av.FFmpegError as exc:
        raise BadMediaError(f"the MP4 does not open ({exc})") from None
    if header.width < 1 or header.height < 1 or header.frames < 1 or not header.fps > 0:
        raise BadMediaError(f"an MP4 that declares {header.width}x{header.height} pixels, {header.frames} "
                            f"frames at {header.fps} fps")
    return header


def decode(data: bytes, header: VideoHeader, keep: set[int] | None = None) -> list[np.ndarray]:
    """Every frame decoded (a cut-short or corrupt file fails here); the frames whose index is
    in ``keep`` (all when ``None``) returned as RGB ``[height, width, 3]`` uint8 arrays."""
    import av

    out: list[np.ndarray] = []
    n = 0
    try:
        with av.open(io.BytesIO(data), "r") as container:
            stream = container.streams.video[0]
            stream.codec_context.options = {"err_detect": "explode"}   # a damaged frame fails, not concealed
            for frame in container.decode(stream):
                if keep is None or n in keep:
                    out.append(frame.to_ndarray(format="rgb24"))
                n += 1
    except av.FFmpegError as exc:
        raise BadMediaError(f"the video does not decode ({exc})") from None
    if n != header.frames:
        raise BadMediaError(f"the video decodes to {n} frames; its header declares {header.frames}")
    for f in out:
        if f.shape[:2] != (header.height, header.width):
            raise BadMediaError(f"a frame of {f.shape[1]}x{f.shape[0]} pixels in a "
                                f"{header.width}x{header.height} video")
    return out


def _other_container(head: bytes) -> bool:
    """Bytes that open as a known video container other than MP4 (WebM / Matroska, AVI, MPEG-TS,
    GIF, Ogg)."""
    return (head[:4] == b"\x1a\x45\xdf\xa3" or (head[:4] == b"RIFF" and head[8:12] == b"AVI ")
            or head[:1] == b"\x47" or head[:4] in (b"GIF8", b"OggS"))


class VideoProcessor:
    """Qwen2-VL's video preprocessing over PyAV and the PIL image processor (module doc)."""

    def __init__(self, image_processor, *, fps: float = 2.0, min_frames: int = 4, max_frames: int = 768,
                 min_pixels: int | None = None, max_pixels: int | None = None):
        from transformers import Qwen2VLImageProcessorPil

        size = image_processor.size
        self.fps, self.min_frames, self.max_frames = float(fps), int(min_frames), int(max_frames)
        self.patch_size, self.merge_size = image_processor.patch_size, image_processor.merge_size
        self.temporal_patch_size = image_processor.temporal_patch_size
        self.min_pixels = int(min_pixels if min_pixels is not None else size["shortest_edge"])
        self.max_pixels = int(max_pixels if max_pixels is not None else size["longest_edge"])
        self.frames = Qwen2VLImageProcessorPil(
            size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            patch_size=self.patch_size, merge_size=self.merge_size, temporal_patch_size=1,
            image_mean=image_processor.image_mean, image_std=image_processor.image_std)

    @property
    def params(self) -> dict[str, str]:
        """The settings that change a video's tokens (they enter its content keys)."""
        return {"fps": f"{self.fps:g}", "frames": f"{self.min_frames}-{self.max_frames}",
                "pixels": f"{self.min_pixels}-{self.max_pixels}",
                "patch": f"{self.patch_size}x{self.merge_size}x{self.temporal_patch_size}"}

    def indices(self, header: VideoHeader) -> list[int]:
        """The frames sampled from a video (``Qwen2VLVideoProcessor.sample_frames`` with fps)."""
        tps, total = self.temporal_patch_size, header.frames
        most = math.floor(min(self.max_frames, total) / tps) * tps
        n = total / header.fps * self.fps
        n = math.floor(min(max(n, self.min_frames), most, total) / tps) * tps
        if n < tps:
            raise BadMediaError(f"a video of {total} frames: at least {tps} are needed")
        return torch.arange(0, total, total / n).int().tolist()

    def grid(self, header: VideoHeader) -> tuple[int, int, int]:
        """``(t, h, w)`` patches of the sampled video, from the header alone."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        try:
            h, w = smart_resize(header.height, header.width, factor, self.min_pixels, self.max_pixels)
        except ValueError as exc:                    # an aspect ratio over 200
            raise BadMediaError(f"video frames of {header.width}x{header.height}: {exc}") from None
        n = len(self.indices(header))
        return n // self.temporal_patch_size, h // self.patch_size, w // self.patch_size

    def sampled_fps(self, header: VideoHeader) -> float:
        return len(self.indices(header)) / header.frames * header.fps

    def second_per_grid(self, header: VideoHeader) -> float:
        """Seconds per temporal patch (Qwen2.5-VL's ``second_per_grid_ts``)."""
        return self.temporal_patch_size / self.sampled_fps(header)

    def inputs(self, data: bytes, header: VideoHeader | None = None) -> dict[str, torch.Tensor]:
        """``pixel_values_videos`` and ``video_grid_thw`` of the video's sampled frames."""
        header = header or probe(data)
        picks = self.indices(header)
        return self.from_frames(decode(data, header, set(picks)))     # distinct, in order

    def from_frames(self, frames: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """Video inputs of RGB frames already sampled (a multiple of ``temporal_patch_size``)."""
        tps, p = self.temporal_patch_size, self.patch_size
        if not frames or len(frames) % tps:
            raise BadMediaError(f"{len(frames)} frames: a video needs a multiple of {tps}")
        out = self.frames(images=list(frames), return_tensors="np")
        grids = out["image_grid_thw"]
        if not (grids == grids[0]).all():
            raise BadMediaError("the frames of a video differ in size")
        _, gh, gw = (int(x) for x in grids[0])
        n, groups = gh * gw, len(frames) // tps
        x = np.asarray(out["pixel_values"]).reshape(groups, tps, n, 3, p * p)
        x = x.transpose(0, 2, 3, 1, 4).reshape(groups * n, 3 * tps * p * p)
        return {"pixel_values_videos": torch.from_numpy(np.ascontiguousarray(x)),
                "video_grid_thw": torch.tensor([[groups, gh, gw]])}

    def tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.merge_size ** 2


def segment_inputs(inputs: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """The video inputs of temporal patches ``[start, end)`` alone (rows are t-major)."""
    t, h, w = (int(x) for x in inputs["video_grid_thw"][0])
    if not 0 <= start < end <= t:
        raise BadMediaError(f"temporal patches [{start}, {end}) of a video of {t}")
    rows = h * w
    return {"pixel_values_videos": inputs["pixel_values_videos"][start * rows:end * rows],
            "video_grid_thw": torch.tensor([[end - start, h, w]])}


def segments(t: int, per_segment: int) -> list[tuple[int, int]]:
    """Temporal patches ``[0, t)`` cut into segments of ``per_segment`` (the last may be shorter)."""
    if per_segment < 1:
        raise BadMediaError(f"a video segment of {per_segment} temporal patches")
    return [(a, min(a + per_segment, t)) for a in range(0, t, per_segment)]
