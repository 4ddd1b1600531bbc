"""``NodeCache``: a ``ClusterCache`` as the reference model sees it, from one node.

The reference model (``mmtier.models``) drives any object with ``TieredKVCache``'s surface. A
``ClusterCache`` has that surface except ``sequence(seq)`` (the model reads
``sequence(seq).length``); this wrapper supplies it, and homes the sequences it creates on a
pool of its node (``create_sequence(..., node=)``), so a Serve replica's conversations keep
their private K/V next to the replica. Every other attribute is the ``ClusterCache``'s own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..table import SequenceHandle


@dataclass(frozen=True)
class SequenceView:
    """What the model reads of a cluster sequence."""

    length: int


class NodeCache:
    """Delegates to ``cluster`` (a ``ClusterCache``); adds ``sequence`` and node-local homes."""

    def __init__(self, cluster, node: str | None = None):
        self.cluster = cluster
        self.node = node if node is not None and cluster.pools(node) else None

    def __getattr__(self, name: str):
        return getattr(self.cluster, name)

    def create_sequence(self, tenant: str | None = None, **kw) -> SequenceHandle:
        if self.node is not None and "node" not in kw and "hint_keys" not in kw:
            kw["node"] = self.node
        return self.cluster.create_sequence(tenant, **kw)

    def sequence(self, seq: SequenceHandle) -> SequenceView:
        own = getattr(type(self.cluster), "sequence", None)
        if own is not None:                       # the client grew its own: use it
            return own(self.cluster, seq)
        # ClusterCache keeps each sequence's length in its per-sequence state (validated by
        # ``sequence``: an unknown or released handle raises UnknownKeyError, as in TieredKVCache).
        return SequenceView(self.cluster.sequence(seq).length)
