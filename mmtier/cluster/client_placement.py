"""Where a ``ClusterCache`` sequence lives and where its attention runs: the home pool (least used,
nearest the bytes it will attend), the holder to attend or copy from, the copy-after-N rule, and
the per-actor plan of attention parts. Plain functions over the client's view of the holders."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ..content import ContentKey
from ..errors import HolderLostError
from .actors import STORE_PREFIX
from .client_sequence_state import SequenceState, Transfer
from .pool import Part
from .registry import HolderInfo, Location


def least_used(names: list[str], homed: Counter[str]) -> str:
    """The pool homing the fewest sequences (ties by name)."""
    return min(names, key=lambda n: (homed[n], n))


def default_home(local: list[str], every: list[str], homed: Counter[str]) -> str:
    """The least used pool on the client's node, else anywhere."""
    names = local or every
    if not names:
        raise HolderLostError("no mmtier pool is alive; run mmtier.start()")
    return least_used(names, homed)


def _pools_on(info: dict[str, HolderInfo], node: str) -> list[str]:
    return sorted(n for n, i in info.items() if i.kind == "pool" and i.node == node)


def best_home(locs: Iterable[Location | None], info: dict[str, HolderInfo],
              homed: Counter[str]) -> str | None:
    """The pool holding most bytes of these groups (a store's bytes count for its node's pools)."""
    score: Counter[str] = Counter()
    for loc in locs:
        if loc is None:
            continue
        for holder, _tier in loc.holders:
            hi = info.get(holder)
            if hi is None:
                continue
            if hi.kind == "pool":
                score[holder] += 2 * loc.nbytes
            else:
                for p in _pools_on(info, hi.node):
                    score[p] += loc.nbytes
    if not score:
        return None
    return max(score, key=lambda n: (score[n], -homed[n]))


def nearest(holders: list[str], home: str, info: dict[str, HolderInfo]) -> str:
    """A holder on the home's node first (a store there is cheapest), then any pool."""
    home_info = info.get(home)
    if home_info is None:
        raise HolderLostError(f"home pool {home} is gone")
    node = home_info.node
    known = [h for h in holders if h in info]
    if not known:
        raise HolderLostError(f"no live holder among {holders}")
    return min(known, key=lambda h: (info[h].node != node, info[h].kind != "pool", h))


def nearest_by_name(holders: list[str], node: str) -> str:
    """A holder on ``node`` first, a pool before a store (its export is a view, no gather), by
    name alone (``mmtier-pool:<node>:...`` / ``mmtier-store:<node>``): for callers with no
    ``HolderInfo`` map (an embedded pool, an engine process)."""
    return min(holders, key=lambda h: (h.split(":")[1] != node, h.startswith(STORE_PREFIX), h))


def should_copy(transfer: Transfer | None, uses: int, copy_after: int) -> bool:
    """The copy-after-N rule: the ``copy_after``-th attach of a group from one home copies it
    there (0 never copies); ``transfer`` overrides the rule for one call."""
    return transfer == "copy" or (transfer is None and copy_after > 0 and uses >= copy_after)


def plan(st: SequenceState, wanted: set[ContentKey] | None) -> dict[str, list]:
    """The parts each holder attends for this sequence: its home's runs, then its remote groups
    (a pool's proxy with its offset, or a store's key with its absolute start)."""
    out: dict[str, list] = {}
    for sub in st.subs:
        if wanted is None:
            out.setdefault(st.home, []).append(Part(sub.handle, sub.offset, None))
        else:
            keys = tuple(k.to_wire() for k in dict.fromkeys(sub.keys) if k in wanted)
            if keys:
                out.setdefault(st.home, []).append(Part(sub.handle, sub.offset, keys))
    for r in st.remotes:
        if wanted is not None and r.key not in wanted:
            continue
        if r.local_start is None:
            out.setdefault(r.holder, []).append((r.key.to_wire(), r.start))
        else:
            out.setdefault(r.holder, []).append(
                Part(st.proxies[r.holder], r.start - r.local_start, (r.key.to_wire(),), r.local_start))
    return out


# ---------------------------------------------------------------------- an embedded pool's plan
def transfer_plan(nbytes: int, local_capacity: int, calls_left: int, *, link_bytes_per_s: float,
                  call_s: float, large_fraction: float = 0.5) -> str:
    """How an embedded pool uses a group held elsewhere: ``"fetch"`` (pulled whole into the
    local pool, then attended at memory speed) or ``"remote"`` (partial attention where it
    lives: a call per layer and step). A group that fits the local pool's modality arena is
    always fetched unless it is very large (over ``large_fraction`` of the arena) *and* moving
    it costs more than the calls the turn still has to make; one that does not fit at all can
    only be attended where it lives."""
    if nbytes > local_capacity:
        return "remote"
    if nbytes <= large_fraction * local_capacity:
        return "fetch"
    return "remote" if nbytes / link_bytes_per_s > calls_left * call_s else "fetch"
