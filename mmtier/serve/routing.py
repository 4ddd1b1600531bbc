"""Cache affinity: which node's worker takes a request (plain logic, no Ray).

The Serve app runs one worker per node, pinned there by a per-node resource, and an ingress
that routes each request by one rule, first match wins:

1. **content**: the node holding the most bytes of the request's content for this tenant, as
   the ContentRegistry says (one batched lookup): its conversation's prefix groups (the spans
   earlier turns sealed, keyed by their content chained from the start, so a conversation's
   later requests go where its history is, with no conversation id anywhere) and the
   content-only groups of its media (cross-attention K/V and encoder outputs of each item). A
   pool's bytes count twice, a node store's once (a pool serves attention at once; a store's
   groups are restored first), the same weighting ``ClusterCache`` uses to home a sequence
   near its hint keys.
2. **least_loaded**: otherwise (nothing of it cached for this tenant) the node whose worker
   has the fewest requests in flight from this ingress; ties rotate.

A request whose worker is lost (dead or restarting) is sent once more, to the least loaded of
the other nodes (rule **failover**): requests are stateless, so nothing is lost with the worker
but what its pool held, which the other node recomputes.

Which node a worker is pinned to (``pin_targets``): in production every Ray node carries the
automatic resource ``node:<ip>``, and a worker claims a sliver of it; where nodes share an IP
(a one-machine test cluster) each node carries its own custom resource with a common prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError

POOL_WEIGHT, STORE_WEIGHT = 2, 1


@dataclass(frozen=True)
class PinTarget:
    node: str                # Ray node id
    resource: str            # the resource a worker claims to land there
    gpus: float = 0.0        # the node's GPUs (a worker on it claims one when workers.device is auto)


@dataclass
class Route:
    node: str
    rule: str                                  # "content" | "least_loaded" | "failover"
    scores: dict[str, int] = field(default_factory=dict)   # node -> weighted bytes of content


def pin_targets(nodes: Iterable[dict], prefix: str | None) -> list[PinTarget]:
    """One target per alive node that can be pinned (``ray.nodes()`` entries), by node id."""
    out: list[PinTarget] = []
    for n in nodes:
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        if prefix is None:
            name = f"node:{n.get('NodeManagerAddress')}"
            if name in res:
                out.append(PinTarget(n["NodeID"], name, res.get("GPU", 0.0)))
            continue
        names = sorted(r for r in res if r.startswith(prefix))
        if len(names) > 1:
            raise ConfigError(f"node {n['NodeID']} carries {len(names)} resources starting with "
                              f"{prefix!r} ({names}); give each node exactly one",
                              ("affinity.pin_resource_prefix",))
        if names:
            out.append(PinTarget(n["NodeID"], names[0], res.get("GPU", 0.0)))
    seen = Counter(t.resource for t in out)
    dup = sorted(r for r, c in seen.items() if c > 1)
    if dup:
        raise ConfigError(f"several nodes share the pin resource(s) {dup} (nodes on one IP?); set "
                          "affinity.pin_resource_prefix and give each node its own custom resource",
                          ("affinity.pin_resource_prefix",))
    return sorted(out, key=lambda t: t.resource)


class Router:
    """The rule above over the nodes that have a worker; in-flight counts are this ingress's."""

    def __init__(self, nodes: Sequence[str]):
        if not nodes:
            raise ConfigError("no worker nodes to route to", ("affinity",))
        self.nodes = list(nodes)
        self.inflight: Counter[str] = Counter()
        self._turn = 0

    def scores(self, locations: Iterable, holder: Callable[[str], tuple[str, str] | None]) -> dict[str, int]:
        """Weighted bytes per worker node. ``locations``: registry ``Location``s (or None);
        ``holder(name)`` -> ``(node, "pool" | "store")`` or None for an unknown holder."""
        score: Counter[str] = Counter()
        for loc in locations:
            if loc is None:
                continue
            for name, _tier in loc.holders:
                info = holder(name)
                if info is None or info[0] not in self.nodes:
                    continue
                score[info[0]] += loc.nbytes * (POOL_WEIGHT if info[1] == "pool" else STORE_WEIGHT)
        return dict(score)

    def choose(self, scores: dict[str, int]) -> Route:
        if scores:
            best = max(scores.values())
            tied = [n for n in self.nodes if scores.get(n) == best]
            return Route(self._least(tied), "content", scores)
        return Route(self._least(self.nodes), "least_loaded", scores)

    def failover(self, lost: str, scores: dict[str, int]) -> Route | None:
        """Another node for a request whose worker on ``lost`` did not take it."""
        others = [n for n in self.nodes if n != lost]
        return Route(self._least(others), "failover", scores) if others else None

    def _least(self, nodes: list[str]) -> str:
        low = min(self.inflight[n] for n in nodes)
        tied = [n for n in nodes if self.inflight[n] == low]
        self._turn += 1
        return tied[self._turn % len(tied)]
