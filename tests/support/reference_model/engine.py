"""``ReferenceEngine``: the reference model in an actor that holds its own pool (a ``PoolHost``).

The shape every engine takes on the cluster: the model's process embeds its device's cache, so
a turn's attention reads local pages; the cluster sees it as that device's pool (its name is
``mmtier.cluster.host_name(node, i)``). Conversations are opened, fed turn by turn, and closed;
each turn answers its tokens, its time inside the actor, its model counters and the Ray calls
it made (``RayTransport.calls``: at most one lookup, one fetch per remote group, one publish).
Used by the demo and the tests; a plain class, wrapped with ``ray.remote`` by the caller.
"""

from __future__ import annotations

import copy
import itertools
import time

import torch

from mmtier.cluster.engine_pool import PoolHost
from mmtier.cluster.settings import ClusterSettings

from .encoders import ModelError
from .reference import Item, ModelCounters, ReferenceModel


class ReferenceEngine(PoolHost):
    """Conversations of the reference model over the embedded pool."""

    def __init__(self, settings_json: dict, seed: int = 0, torch_threads: int = 1, device: str = "cpu"):
        torch.set_num_threads(torch_threads)
        super().__init__(ClusterSettings(**settings_json), device=device)
        self.model = ReferenceModel(seed=seed)
        self.model.check_cache(self.local)
        self._sessions: dict[int, object] = {}
        self._ids = itertools.count(1)

    def open(self, tenant: str) -> int:
        model = copy.copy(self.model)              # shares weights; counters of its own
        model.counters = ModelCounters()
        sid = next(self._ids)
        self._sessions[sid] = model.session(self.local, tenant)
        return sid

    def turn(self, sid: int, prompt: list[Item], max_new_tokens: int) -> dict:
        """One turn: ``tokens``, ``seconds`` (in this process), ``counters`` (the model's, this
        turn) and ``calls`` (Ray calls of the embedded pool, this turn, by kind)."""
        session = self._session(sid)
        before_calls = dict(self.transport.calls)
        before = session.model.counters.snapshot()
        t0 = time.perf_counter()
        tokens = session.send(prompt, max_new_tokens)
        seconds = time.perf_counter() - t0
        after = session.model.counters.snapshot()
        calls = {k: n - before_calls.get(k, 0) for k, n in self.transport.calls.items()
                 if n != before_calls.get(k, 0)}
        return {"tokens": tokens, "seconds": seconds, "calls": calls,
                "counters": _delta(before, after), "xkeys": [k.to_wire() for k in session.xkeys]}

    def close_session(self, sid: int) -> None:
        self._session(sid).close()
        del self._sessions[sid]

    def spill(self, wires: list[dict]) -> tuple[int, int]:
        """Hand these groups to the node store (the demo's pressure valve): ``(groups, bytes)``."""
        from mmtier.content import ContentKey

        return tuple(self.local.offload(ContentKey.from_wire(w) for w in wires))

    def _session(self, sid: int):
        s = self._sessions.get(sid)
        if s is None:
            raise ModelError(f"no open session {sid}")
        return s


def _delta(before: dict, after: dict) -> dict:
    out: dict[str, object] = {}
    for name, per in after.items():
        if isinstance(per, dict):
            out[name] = {m: n - before[name].get(m, 0) for m, n in per.items() if n != before[name].get(m, 0)}
        else:
            out[name] = per - before[name]
    return out
