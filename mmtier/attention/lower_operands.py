"""Attention's operands over the lower tiers: CSR operands over the host slabs (each entry held
until the call has computed) and the streamed reads of the disk-resident groups. The tiers only
say where a group lives (``LowerTiers``: its host tier, mover, staging buffers and storage keys);
attention makes its operands from them here, so the tiers import nothing of attention.

Host pages are attended in place on the slabs (the CPU path). Disk pages are streamed: only the
attended layer's slice of each page, verified, into a staging buffer, in batches queued before
the device and host parts run so the reads overlap them (``DiskStream``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ..content import ContentKey
from ..core.groups import ModalityGroup, Tier
from ..core.segments import Segment
from ..errors import CorruptDataError
from ..storage import HostTier, Mover
from ..storage.host_slabs import HostEntry
from ..storage.staging import StagingPool
from .compile import compile_segments
from .kernels.layout import PagedKV
from .streaming import DiskStream


class LowerTierView(Protocol):
    """What attention reads of the lower tiers (``tiers.lower.LowerTiers`` has it)."""

    host: HostTier | None
    mover: Mover | None
    staging: StagingPool

    def storage_key(self, group: ModalityGroup) -> ContentKey: ...


def disk_stream(lower: LowerTierView, segments: list[Segment], layer: int) -> DiskStream | None:
    """Queue the reads of the disk-resident groups among ``segments`` (in batches; only
    ``layer``'s bytes of each page) so they overlap the device and host parts of an attention
    call over that layer; ``None`` where there are none (or no disk tier)."""
    groups = [s.group for s in segments if s.group.tier == Tier.DISK]
    if not groups or lower.mover is None:
        return None
    return DiskStream(lower.mover, lower.staging, groups, [lower.storage_key(g) for g in groups], layer)


def host_operands(lower: LowerTierView, segments: list[Segment], layer: int
                  ) -> tuple[list[PagedKV], list[HostEntry]]:
    """Operands over the host slabs for in-place CPU attention, with every entry held (the
    caller gives them back with ``release_held`` once computed). ``CorruptDataError`` where a
    group's host copy is gone."""
    host = lower.host
    assert host is not None
    held: list[HostEntry] = []
    try:
        for s in segments:
            entry = host.hold(lower.storage_key(s.group))
            if entry is None:
                raise CorruptDataError(f"{s.group!r}: host copy vanished")
            held.append(entry)

        def view_of(group: ModalityGroup):
            return group.modality, host.slab_view(group.spec), list(group.location.slots)

        return compile_segments(segments, layer, view_of), held
    except BaseException:
        release_held(lower, held)
        raise


def release_held(lower: LowerTierView, held: Iterable[HostEntry]) -> None:
    """Give back host entries ``host_operands`` held."""
    for entry in held:
        lower.host.release(entry)  # type: ignore[union-attr]
