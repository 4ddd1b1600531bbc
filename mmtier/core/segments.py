"""Sequence tables (the seed's ``MultimodalBlockTable``): ordered segments of modality groups.

A segment places a group at an absolute start position of a sequence. Views: by modality
(``text_blocks``, ``vision_blocks``, ``audio_blocks``, ``video_blocks``: a video's segments,
``blocks(modality)``) and by content key (``by_key``). The kernels' operands are compiled from
chosen segments by ``mmtier.attention.compile``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..content import ContentKey
from .groups import ModalityGroup


@dataclass(frozen=True)
class Segment:
    group: ModalityGroup
    start: int
    before: bytes = b"\0" * 32        # the sequence's prefix chain where the segment starts (EMPTY_CHAIN)

    @property
    def num_tokens(self) -> int:
        return self.group.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.group.num_tokens


EMPTY_CHAIN = b"\0" * 32


def naming(key: ContentKey, before: bytes) -> bytes | None:
    """The digest that names a sequence's content once ``key`` is placed where its chain is
    ``before`` (a valid parent of what comes next): a prefix-dependent key names all before it
    and itself; a content-only key names only itself, so only at a sequence's start."""
    if key.sharing == "prefix" or before == EMPTY_CHAIN:
        return key.digest
    return None


@dataclass(frozen=True)
class SequenceHandle:
    """What ``create_sequence`` returns: the sequence id and its (server-side) tenant."""

    id: int
    tenant: str


@dataclass
class SequenceTable:
    handle: SequenceHandle
    segments: list[Segment] = field(default_factory=list)
    chain: bytes = b"\0" * 32        # running digest of everything the sequence holds
    open_runs: list = field(default_factory=list)   # its reservations (layer_writes.Reservation)
                                     # not yet fully written: releasing the sequence ends them
    ends: list[bytes] = field(default_factory=list)  # the chain where each segment's own tokens end
    named: dict[bytes, bytes] = field(default_factory=dict)  # chain -> digest of the prefix-
                                     # dependent key that names the same content (attached or
                                     # sealed there): a valid parent of what comes next

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def add(self, group: ModalityGroup, identity: bytes, names: bytes | None = None) -> Segment:
        """A new segment; ``names``: the digest of the prefix-dependent key it was attached as."""
        seg = Segment(group, self.length, self.chain)
        self.segments.append(seg)
        self.extend_chain(identity, names)
        self.ends.append(self.chain)
        return seg

    def grow(self, identity: bytes) -> None:
        """More tokens in the tail segment's run."""
        self.extend_chain(identity)
        self.ends[-1] = self.chain

    def extend_chain(self, identity: bytes, names: bytes | None = None) -> None:
        """The chain past more content (a segment's, or a group attended elsewhere: no segment
        here); ``names``: the prefix-dependent key that content was attached as."""
        self.chain = hashlib.sha256(self.chain + identity).digest()
        if names is not None:
            self.named[self.chain] = names

    def name_segment(self, index: int, names: bytes) -> None:
        """Segment ``index`` was sealed as the prefix-dependent key ``names``."""
        self.named[self.ends[index]] = names

    @property
    def tail(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    # ---- views ----
    def blocks(self, modality: str) -> list[Segment]:
        return [s for s in self.segments if s.group.modality == modality]

    @property
    def text_blocks(self) -> list[Segment]:
        return self.blocks("text")

    @property
    def vision_blocks(self) -> list[Segment]:
        return self.blocks("vision")

    @property
    def audio_blocks(self) -> list[Segment]:
        return self.blocks("audio")

    @property
    def video_blocks(self) -> list[Segment]:
        return self.blocks("video")

    @property
    def by_key(self) -> dict[ContentKey, list[Segment]]:
        out: dict[ContentKey, list[Segment]] = {}
        for s in self.segments:
            if s.group.key is not None:
                out.setdefault(s.group.key, []).append(s)
        return out

    def groups(self) -> list[ModalityGroup]:
        return [s.group for s in self.segments]
