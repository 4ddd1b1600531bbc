"""What the ``ClusterCache`` client keeps per sequence: its home, the runs held there (``_Sub``),
the groups attended where they live (``_Remote``), and the view it returns (``ClusterSequence``)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Literal

from ..cache.table import SequenceHandle
from ..content import ContentKey

Transfer = Literal["remote", "copy"]


@dataclass(frozen=True)
class ClusterSequence:
    """A sequence as the client sees it (``TieredKVCache.sequence`` gives the full table)."""

    handle: SequenceHandle
    length: int
    home: str | None
    attached: tuple[ContentKey, ...]


@dataclass
class _Sub:
    """A run of the sequence held in the home pool: local handle and its position offset."""

    handle: SequenceHandle
    offset: int
    keys: list[ContentKey] = field(default_factory=list)


@dataclass
class _Remote:
    """A group attended where it lives: holder, key, absolute start, start in the proxy."""

    holder: str
    key: ContentKey
    start: int
    local_start: int | None       # None for a store (it takes absolute starts)


@dataclass
class _Seq:
    handle: SequenceHandle
    home: str | None = None
    subs: list[_Sub] = field(default_factory=list)
    sealed: bool = True           # the next local op opens a new sub
    remotes: list[_Remote] = field(default_factory=list)
    proxies: dict[str, SequenceHandle] = field(default_factory=dict)
    proxy_starts: dict[tuple[str, bytes], int] = field(default_factory=dict)
    attached: list[ContentKey] = field(default_factory=list)
    length: int = 0
    chain: bytes = b"\0" * 32
    named: dict[bytes, bytes] = field(default_factory=dict)   # chain -> the prefix-dependent
                                  # key attached there (table.SequenceTable.named)
    tail_modality: str | None = None
    lock: asyncio.Lock | None = None


def _chain(chain: bytes, identity: bytes) -> bytes:
    return hashlib.sha256(chain + identity).digest()
