"""``TurnWorker``: the per-node worker of the Serve app (a plain class; ``app.py`` wraps it).

One worker runs on each node (pinned by a per-node resource), as a named actor that holds its
device's pool (``mmtier.actors.PoolHost``, name ``host_name(node)``): the model and its cache
live in one process, so a turn's attention reads local pages with no Ray call. The model is a
pluggable chat engine (``engines.py``: the transformers chat model by default, or the
reference model); its open conversations run over that embedded cache; media groups held
elsewhere are found by one registry lookup per turn and pulled whole into the pool (the turn's
``traffic`` in the answer counts those calls); new groups are published after the turn.

Turns of one conversation run one at a time (a lock per conversation); turns of different
conversations run concurrently in threads, except on a ``serial`` engine (the transformers chat
model keeps per-turn state), whose turns take the model one at a time (503 ``busy`` after
``TURN_WAIT_S``, the conversation unchanged); the pool's own actor methods always run alongside. Each conversation counts its own turns' cache
work, so the cache information of a turn is exactly what that turn did. A turn that fails
half-way closes its conversation (its state is no longer a prefix the model can extend).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..actors.pool_host import PoolHost
from ..errors import BadMediaError, BusyError, CapacityError, MMTierError, UnknownKeyError
from .config import ServeAppConfig
from .engines import Conversation, load_engine

log = logging.getLogger(__name__)

TURN_WAIT_S = 240.0       # longest a turn waits for a serial engine's model (other turns)


@dataclass
class _Conversation:
    id: str
    tenant: str
    chat: Conversation
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    turns: int = 0


class TurnWorker(PoolHost):
    """Runs turns of conversations on this node, over the pool it holds. A threaded actor:
    turns of different conversations, and the pool's own methods (exports to other holders,
    pings), run concurrently."""

    def __init__(self, cfg_json: dict, index: int, expected_node: str | None = None):
        import ray
        import torch

        self.app_cfg = ServeAppConfig.parse(cfg_json)
        torch.set_num_threads(self.app_cfg.workers.torch_threads)
        super().__init__(self.app_cfg.settings())
        self.index = index
        if expected_node is not None and expected_node != self.node:
            log.warning("worker %d expected on node %s runs on %s", index, expected_node,
                        ray.get_runtime_context().get_node_id())
        self.engine = load_engine(self.app_cfg.model)
        self.engine.check_cache(self.local)
        self._convs: OrderedDict[str, _Conversation] = OrderedDict()
        self._convs_lock = threading.Lock()
        self._serial = threading.Lock()          # a serial engine's one turn at a time

    # ------------------------------------------------------------------ remote interface
    def turn(self, tenant: str, conversation_id: str | None, items: list[tuple[str, object]],
             max_new_tokens: int) -> tuple[int, dict]:
        """``(status, body)``; ``items``: ``("text", str)`` or ``(request media type, bytes)``."""
        return self._turn(tenant, conversation_id, items, max_new_tokens)

    def close_conversation(self, tenant: str, conversation_id: str) -> tuple[int, dict]:
        return self._close_one(tenant, conversation_id)

    def info(self) -> dict:
        with self._convs_lock:
            return {"index": self.index, "node": self.node, "conversations": len(self._convs),
                    "pool": self.name}

    # ------------------------------------------------------------------ turns
    def _turn(self, tenant, conversation_id, items, max_new_tokens) -> tuple[int, dict]:
        self._sweep()
        try:
            self.engine.check(items, max_new_tokens)           # nothing opened on bad input
        except BadMediaError as exc:
            return 400, _error(400, "bad_media", str(exc))
        except MMTierError as exc:                              # check raises only on bad input
            return 400, _error(400, "bad_prompt", str(exc))
        conv = None
        try:
            if conversation_id is None:
                conv = self._open(tenant)
            else:
                conv = self._find(tenant, conversation_id)
                if conv is None:
                    return 404, _error(404, "unknown_conversation",
                                       f"no open conversation {conversation_id!r} for this API key "
                                       "(closed, expired, or never opened)")
            with conv.lock:
                if conv.id not in self._convs:       # closed while we waited
                    return 404, _error(404, "unknown_conversation", f"conversation {conv.id!r} was closed")
                with self._model_turn():
                    calls_before = dict(self.transport.calls)
                    t0 = time.perf_counter()
                    out = conv.chat.send(items, max_new_tokens)
                    seconds = time.perf_counter() - t0
                    traffic = {k: n - calls_before.get(k, 0) for k, n in self.transport.calls.items()
                               if n != calls_before.get(k, 0)}
                conv.turns += 1
                conv.last_used = time.monotonic()
        except BusyError as exc:                  # nothing ran: the conversation stays as it was
            return 503, _error(503, "busy", str(exc))
        except CapacityError as exc:
            self._drop(conv)
            return 503, _error(503, "capacity", f"the cache has no room for this turn: {exc}")
        except UnknownKeyError as exc:            # a holder died mid-turn (HolderLostError)
            self._drop(conv)
            return 503, _error(503, "holder_lost", f"cached state was lost mid-turn; start again: {exc}")
        except MMTierError as exc:
            self._drop(conv)
            log.exception("turn failed")
            return 500, _error(500, "internal", f"{type(exc).__name__}: {exc}")
        return 200, {
            "conversation_id": conv.id, "turn": conv.turns, "tokens": out.tokens, "text": out.text,
            "node": self.node, "worker": self.index, "seconds": round(seconds, 4),
            "cache": {"counts": out.counts, "traffic": traffic},
        }

    @contextmanager
    def _model_turn(self):
        """The model for one turn: alone when the engine is ``serial`` (``BusyError`` when other
        turns keep it past ``TURN_WAIT_S``), so the turn's traffic and counts are its own."""
        if not self.engine.serial:
            yield
            return
        if not self._serial.acquire(timeout=TURN_WAIT_S):
            raise BusyError(f"the model stayed busy with other turns for {TURN_WAIT_S:.0f} s")
        try:
            yield
        finally:
            self._serial.release()

    def _open(self, tenant: str) -> _Conversation:
        chat = self.engine.open(self.local, tenant)
        conv = _Conversation(f"w{self.index}.{secrets.token_hex(12)}", tenant, chat)
        with self._convs_lock:
            self._convs[conv.id] = conv
        return conv

    def _find(self, tenant: str, conversation_id: str) -> _Conversation | None:
        with self._convs_lock:
            conv = self._convs.get(conversation_id)
            if conv is None or conv.tenant != tenant:     # another tenant's id: not found
                return None
            self._convs.move_to_end(conversation_id)
            return conv

    def _drop(self, conv: _Conversation | None) -> None:
        if conv is not None:
            self._close(conv)

    def _close(self, conv: _Conversation) -> None:
        with self._convs_lock:
            self._convs.pop(conv.id, None)
        try:
            conv.chat.close()
        except MMTierError as exc:                 # the cluster lost it already
            log.warning("closing conversation %s: %s", conv.id, exc)

    def _close_one(self, tenant: str, conversation_id: str) -> tuple[int, dict]:
        conv = self._find(tenant, conversation_id)
        if conv is None:
            return 404, _error(404, "unknown_conversation", f"no open conversation {conversation_id!r}")
        with conv.lock:
            self._close(conv)
        return 200, {"conversation_id": conversation_id, "closed": True}

    def _sweep(self) -> None:
        """Close conversations idle past the TTL, and the idlest beyond the limit."""
        w = self.app_cfg.workers
        now = time.monotonic()
        with self._convs_lock:
            stale = [c for c in self._convs.values() if now - c.last_used > w.conversation_ttl_s]
            extra = max(0, len(self._convs) - len(stale) - w.max_conversations + 1)
            live = [c for c in self._convs.values() if c not in stale]
            stale += live[:extra]                   # OrderedDict: least recently used first
        for conv in stale:
            if conv.lock.acquire(blocking=False):   # one in use is not idle
                try:
                    self._close(conv)
                finally:
                    conv.lock.release()


def _error(status: int, kind: str, message: str) -> dict:
    return {"error": {"status": status, "type": kind, "message": message}}
