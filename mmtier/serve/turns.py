"""``TurnRunner``: the turns of a worker's conversations over one cache (a plain class, no Ray).

``worker.TurnWorker`` (the Ray actor that holds a node's pool) runs its turns through one; a test
runs one in-process over a ``TieredKVCache``. It owns the open conversations, their locks, the
serial engine's one-turn-at-a-time rule, and the mapping of a turn's failure to an answer.

Turns of one conversation run one at a time (a lock per conversation, waited for at most
``turn_wait_s``, then 503 ``busy``); turns of different conversations run concurrently in
threads, except on a ``serial`` engine (the transformers chat model keeps per-turn state), whose
turns take the model one at a time (503 ``busy`` after ``turn_wait_s``; nothing ran). Each conversation counts its own turns' cache work, so the cache
information of a turn is exactly what that turn did.

A failed turn (503 ``capacity``: the cache had no room for it; 503 ``holder_lost``: cached
state it needed was lost) closes its conversation only when the conversation cannot go on: when
the turn opened it (the client never learnt its id), or when the engine says its state is no
longer a prefix the model can extend (``Conversation.broken``). A conversation whose failed turn
left its history as it was stays open: its next turn that fits runs as if the failed one had
never been sent.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import BadMediaError, BusyError, CapacityError, MMTierError, UnknownKeyError
from .config import Workers
from .engines import Conversation, TurnEngine

log = logging.getLogger(__name__)


@dataclass
class _Conversation:
    id: str
    tenant: str
    chat: Conversation
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    turns: int = 0


class TurnRunner:
    """Conversations of ``engine`` over ``cache`` (a worker's ``HostedCache``, or any
    ``TieredKVCache``). ``calls``: the cluster calls made so far, by kind (a ``RayTransport``'s
    counter; its change over a turn is the turn's ``traffic``)."""

    def __init__(self, engine: TurnEngine, cache, workers: Workers, *, index: int = 0,
                 node: str = "local", calls: Counter[str] | None = None):
        self.engine, self.cache, self.workers = engine, cache, workers
        self.index, self.node = index, node
        self.calls: Counter[str] = calls if calls is not None else Counter()
        self._convs: OrderedDict[str, _Conversation] = OrderedDict()
        self._convs_lock = threading.Lock()
        self._serial = threading.Lock()          # a serial engine's one turn at a time

    @property
    def conversations(self) -> int:
        with self._convs_lock:
            return len(self._convs)

    def turn(self, tenant: str, conversation_id: str | None, items: list[tuple[str, object]],
             max_new_tokens: int) -> tuple[int, dict]:
        """``(status, body)``; ``items``: ``("text", str)`` or ``(request media type, bytes)``."""
        self._sweep()
        try:
            self.engine.check(items, max_new_tokens)           # nothing opened on bad input
        except BadMediaError as exc:
            return 400, _error(400, "bad_media", str(exc))
        except MMTierError as exc:                              # check raises only on bad input
            return 400, _error(400, "bad_prompt", str(exc))
        conv, opened = None, conversation_id is None
        try:
            if opened:
                conv = self._open(tenant)
            else:
                conv = self._find(tenant, conversation_id)
                if conv is None:
                    return 404, _error(404, "unknown_conversation",
                                       f"no open conversation {conversation_id!r} for this API key "
                                       "(closed, expired, or never opened)")
            with self._conversation_turn(conv):
                if conv.id not in self._convs:       # closed while we waited
                    return 404, _error(404, "unknown_conversation", f"conversation {conv.id!r} was closed")
                with self._model_turn():
                    calls_before = dict(self.calls)
                    t0 = time.perf_counter()
                    out = conv.chat.send(items, max_new_tokens)
                    seconds = time.perf_counter() - t0
                    traffic = {k: n - calls_before.get(k, 0) for k, n in self.calls.items()
                               if n != calls_before.get(k, 0)}
                conv.turns += 1
                conv.last_used = time.monotonic()
        except BusyError as exc:                  # nothing ran: the conversation stays as it was
            return 503, _error(503, "busy", f"{exc}{self._after_failure(conv, opened, ran=False)}")
        except CapacityError as exc:
            return 503, _error(503, "capacity", f"the cache has no room for this turn: {exc}"
                                                f"{self._after_failure(conv, opened)}")
        except UnknownKeyError as exc:            # a holder died mid-turn (HolderLostError)
            return 503, _error(503, "holder_lost", f"cached state was lost mid-turn: {exc}"
                                                   f"{self._after_failure(conv, opened)}")
        except MMTierError as exc:
            if conv is not None:
                self._close(conv)
            log.exception("turn failed")
            return 500, _error(500, "internal", f"{type(exc).__name__}: {exc}")
        return 200, {
            "conversation_id": conv.id, "turn": conv.turns, "tokens": out.tokens, "text": out.text,
            "node": self.node, "worker": self.index, "seconds": round(seconds, 4),
            "cache": {"counts": out.counts, "traffic": traffic},
        }

    def close_conversation(self, tenant: str, conversation_id: str) -> tuple[int, dict]:
        conv = self._find(tenant, conversation_id)
        if conv is None:
            return 404, _error(404, "unknown_conversation", f"no open conversation {conversation_id!r}")
        with conv.lock:
            self._close(conv)
        return 200, {"conversation_id": conversation_id, "closed": True}

    # ------------------------------------------------------------------ helpers
    def _after_failure(self, conv: _Conversation | None, opened: bool, ran: bool = True) -> str:
        """Close ``conv`` after its turn failed unless it can go on (see the module doc); the
        sentence that tells the client which."""
        if conv is None:
            return ""
        if opened or (ran and conv.chat.broken):
            self._close(conv)
            return "; the conversation is closed: start a new one" if not opened else ""
        again = "send the turn again" if not ran else "send the turn again, or a smaller one"
        return f"; conversation {conv.id} is unchanged: {again}"

    @contextmanager
    def _conversation_turn(self, conv: _Conversation):
        """The conversation for one turn (its turns go one at a time)."""
        with self._within(conv.lock, f"another turn of conversation {conv.id} kept it"):
            yield

    @contextmanager
    def _model_turn(self):
        """The model for one turn: alone when the engine is ``serial``, so the turn's traffic and
        counts are its own."""
        if not self.engine.serial:
            yield
            return
        with self._within(self._serial, "the model stayed busy with other turns"):
            yield

    @contextmanager
    def _within(self, lock: threading.Lock, busy: str):
        """``lock`` held for the block, waited for at most ``turn_wait_s``: else ``BusyError``
        (nothing ran)."""
        wait = self.workers.turn_wait_s
        if not lock.acquire(timeout=wait):
            raise BusyError(f"{busy} for {wait:g} s")
        try:
            yield
        finally:
            lock.release()

    def _open(self, tenant: str) -> _Conversation:
        chat = self.engine.open(self.cache, tenant)
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

    def _close(self, conv: _Conversation) -> None:
        with self._convs_lock:
            self._convs.pop(conv.id, None)
        try:
            conv.chat.close()
        except MMTierError as exc:                 # the cluster lost it already
            log.warning("closing conversation %s: %s", conv.id, exc)

    def _sweep(self) -> None:
        """Close conversations idle past the TTL, and the idlest beyond the limit."""
        w = self.workers
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
