"""``ChatEngine``: the ``ChatModel`` in an actor that holds its own pool (a ``PoolHost``).

The model and its device's cache live in one process: a turn's attention reads local pages
through ``HostedCache`` (no Ray call per layer or step). Cluster traffic is the turn's
boundaries only: ``begin_turn`` with the keys the turn will read (``Conversation.turn_keys``: the
history's spans, the turn's opening spans, its images' encoder outputs and its clips; one
batched registry lookup for those not held here, and each one another holder has, the node
store included, is fetched whole instead of recomputed) and
``end_turn`` (one publish of the groups the turn made). ``dense_turn`` answers the same turn with
the dense reference in this same process, so the demo times both under the same conditions.
A plain class: the caller wraps it with ``ray.remote`` and names it ``host_name(node)``.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import asdict

import torch

from ..cluster.engine_pool import PoolHost
from ..cluster.settings import ClusterSettings
from ..content import ContentKey
from ..errors import ConfigError, UnknownKeyError
from .conversation import Conversation
from .dense import dense_turn
from .model import ChatModel


class ChatEngine(PoolHost):
    """Conversations of a ``ChatModel`` over the embedded pool; one turn at a time."""

    def __init__(self, settings_json: dict, seed: int = 0, torch_threads: int = 1, device: str = "cpu"):
        torch.set_num_threads(torch_threads)
        super().__init__(ClusterSettings(**settings_json), device=device)
        self.chat = ChatModel.tiny(seed)
        want = self.chat.cache_config().model
        if self.cache.cfg.model != want:
            raise ConfigError(f"the cluster's cache is configured for {self.cache.cfg.model!r}, not this "
                              f"engine's model {want!r}", ("model",))
        self.chat.warm_up()
        self._convs: dict[int, Conversation] = {}
        self._ids = itertools.count(1)
        self._turn_lock = threading.Lock()        # one model, one turn at a time

    def open(self, tenant: str) -> int:
        sid = next(self._ids)
        self._convs[sid] = self.chat.conversation(self.local, tenant)
        return sid

    def turn(self, sid: int, items: list, max_new_tokens: int) -> dict:
        """One turn: ``tokens``, ``seconds`` (in this process, turn boundaries included),
        ``counters`` (``TurnCounters`` as a dict), ``calls`` (Ray calls this turn, by kind) and
        ``keys`` (wire form of the groups the conversation uses: history spans and clips)."""
        conv = self._conv(sid)
        with self._turn_lock:
            before = dict(self.transport.calls)
            t0 = time.perf_counter()
            keys, fallbacks = conv.turn_lookup(items)
            self.local.begin_turn(keys, fallbacks=fallbacks)
            t1 = time.perf_counter()
            try:
                r = conv.send(items, max_new_tokens)
            finally:
                t2 = time.perf_counter()
                self.local.end_turn()
            t3 = time.perf_counter()
        calls = {k: n - before.get(k, 0) for k, n in self.transport.calls.items() if n != before.get(k, 0)}
        return {"tokens": r.tokens, "seconds": t3 - t0, "boundary_seconds": (t1 - t0) + (t3 - t2),
                "calls": calls, "counters": asdict(r.counters), "keys": [k.to_wire() for k in r.keys]}

    def dense_turn(self, history: list, items: list, max_new_tokens: int) -> dict:
        """The same turn recomputed densely (no cache) in this process: ``tokens``, ``seconds``."""
        with self._turn_lock:
            t0 = time.perf_counter()
            tokens = dense_turn(self.chat, history, items, max_new_tokens)
            return {"tokens": tokens, "seconds": time.perf_counter() - t0}

    def encoder_runs(self) -> dict:
        return {"cache": dict(self.chat.encoder_runs), "dense": dict(self.chat.dense_encoder_runs)}

    def close_session(self, sid: int) -> None:
        self._conv(sid).close()
        del self._convs[sid]

    def spill(self, wires: list[dict]) -> tuple[int, int]:
        """Hand these groups to the node store (the demo's pressure valve): ``(groups, bytes)``."""
        return tuple(self.local.offload(ContentKey.from_wire(w) for w in wires))

    def _conv(self, sid: int) -> Conversation:
        conv = self._convs.get(sid)
        if conv is None:
            raise UnknownKeyError(f"no open conversation {sid}")
        return conv
