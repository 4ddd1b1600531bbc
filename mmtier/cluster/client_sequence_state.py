"""What the ``ClusterCache`` client keeps per sequence (``SequenceState``): its home, the runs
held there (``HomeRun``), the groups attended where they live (``RemoteAttachment``), its prefix
chain (``next_chain``), and the view it returns (``ClusterSequence``)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Literal

from ..content import ContentKey
from ..core.segments import SequenceHandle

Transfer = Literal["remote", "copy"]


@dataclass(frozen=True)
class ClusterSequence:
    """A sequence as the client sees it (``TieredKVCache.sequence`` gives the full table)."""

    handle: SequenceHandle
    length: int
    home: str | None
    attached: tuple[ContentKey, ...]


@dataclass
class HomeRun:
    """A run of the sequence held in the home pool: local handle and its position offset."""

    handle: SequenceHandle
    offset: int
    keys: list[ContentKey] = field(default_factory=list)


@dataclass
class RemoteAttachment:
    """A group attended where it lives: holder, key, absolute start, start in the proxy."""

    holder: str
    key: ContentKey
    start: int
    local_start: int | None       # None for a store (it takes absolute starts)


@dataclass
class SequenceState:
    """One cluster sequence as the client tracks it: its home pool and the runs held there, the
    groups attended elsewhere and the proxy sequences holding them there, what it attached, its
    length and prefix chain (``named``: chain -> the prefix-dependent key attached there, as
    ``table.SequenceTable.named``), and the lock its operations take."""

    handle: SequenceHandle
    home: str | None = None
    subs: list[HomeRun] = field(default_factory=list)
    sealed: bool = True           # the next local op opens a new home run
    remotes: list[RemoteAttachment] = field(default_factory=list)
    proxies: dict[str, SequenceHandle] = field(default_factory=dict)
    proxy_starts: dict[tuple[str, bytes], int] = field(default_factory=dict)
    attached: list[ContentKey] = field(default_factory=list)
    length: int = 0
    chain: bytes = b"\0" * 32
    named: dict[bytes, bytes] = field(default_factory=dict)
    tail_modality: str | None = None
    lock: asyncio.Lock | None = None


def next_chain(chain: bytes, identity: bytes) -> bytes:
    """The prefix chain past one more piece of content (``SequenceTable.extend_chain``'s step)."""
    return hashlib.sha256(chain + identity).digest()
