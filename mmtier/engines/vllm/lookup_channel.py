"""The lookup channel: a scheduler asks the cache of the engine's worker, in another process,
how many of a prompt's leading groups it holds.

vLLM's default executor on one device (``mp``, how ``vllm serve`` and ``LLM`` run) puts the
scheduler in the engine-core process and the model runner, which owns the pages, in a worker
process of its own (Ray's executor does the same). Only the worker's cache knows what was saved,
so its connector serves this channel and the scheduler's asks it: one round trip per lookup, a
few keys of a few hundred bytes each, answered from the worker's index without touching a page.
Two questions: how many *leading* keys are held (a prompt's run of groups), and which is the
first key held (of candidates in order of preference, such as the parts of a chunk an earlier
prompt may have stored: one round trip for all of them, each looked up as if asked alone, in
order, until one is held).
LMCache meets the same split the same way (a lookup client in the scheduler, a lookup server in
the worker, ZMQ IPC); this one is a Unix socket, length-prefixed JSON (never pickle), one
persistent connection per scheduler, and a per-call timeout after which the answer is "nothing
held" (a miss is always safe: vLLM computes those tokens).

The socket lives in a directory only this user can enter (``0700``) and is named after vLLM's
engine id (the same in both processes), so engines never answer each other.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...content import ContentKey
from ...errors import ConfigError, MMTierError

log = logging.getLogger(__name__)

MAX_MESSAGE = 8 << 20          # bytes in one request or answer (about 20K keys)
_HEADER = struct.Struct(">I")


def socket_path(engine_id: str, rank: int = 0, shard: int | None = None) -> Path:
    """Where the worker of engine ``engine_id`` (data-parallel ``rank``; ``shard``: its
    tensor / pipeline-parallel worker, where there are several) listens."""
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:48]
    if not safe:
        raise ConfigError(f"engine id {engine_id!r} names no lookup socket", ("engine_id",))
    base = Path(tempfile.gettempdir()) / f"mmtier-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    if base.stat().st_uid != os.getuid() or base.stat().st_mode & 0o077:
        raise ConfigError(f"{base} must belong to this user alone (mode 0700)", ("TMPDIR",))
    return base / (f"lookup-{safe}-{rank}.sock" if shard is None else f"lookup-{safe}-{rank}-{shard}.sock")


def _send(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"a lookup message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("lookup channel closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> dict:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_MESSAGE:
        raise ValueError(f"a lookup message of {n} bytes exceeds {MAX_MESSAGE}")
    obj = json.loads(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ValueError("a lookup message is a JSON object")
    return obj


class LookupServer:
    """Answers ``{"keys": [wire, ...]}`` with ``{"held": n}``, the number of leading keys
    ``leading_held`` says are held, and ``{"first": [wire, ...]}`` with ``{"held": i}``, the
    index of the first key held (``null``: none), asking ``leading_held`` one key at a time in
    order. One thread accepts, one thread per connection answers."""

    def __init__(self, path: Path, leading_held: Callable[[list[ContentKey]], int]):
        self.path = Path(path)
        self._leading_held = leading_held
        self._closed = threading.Event()
        self.answered = 0
        self.refused = 0
        if self.path.exists():          # a socket left by a process that died: ours to replace
            self.path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.listen(8)
        self._sock.settimeout(0.5)
        self._thread = threading.Thread(target=self._accept, name="mmtier-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="mmtier-lookup-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    req = _recv(conn)
                except (ConnectionError, OSError):
                    return
                except ValueError as exc:        # not our protocol: drop the connection
                    self.refused += 1
                    log.warning("mmtier lookup: refused a malformed request (%s)", exc)
                    return
                try:
                    if "first" in req:
                        keys = [ContentKey.from_wire(w) for w in req["first"]]
                        held: int | None = next((i for i, k in enumerate(keys) if self._leading_held([k])), None)
                    else:
                        keys = [ContentKey.from_wire(w) for w in req["keys"]]
                        held = int(self._leading_held(keys))
                except (KeyError, TypeError, ValueError, MMTierError) as exc:
                    self.refused += 1
                    _send(conn, {"error": type(exc).__name__})
                    continue
                self.answered += 1
                try:
                    _send(conn, {"held": held})
                except OSError:
                    return

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(timeout=2)
        if self.path.exists():
            self.path.unlink()


class LookupClient:
    """The scheduler's end: ``leading_held(keys)`` and ``first_held(keys)``; nothing held (0,
    ``None``) when the worker cannot be reached or does not answer within ``timeout_s`` (logged
    once per outage)."""

    def __init__(self, path: Path, timeout_s: float = 2.0):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False
        self.calls = 0
        self.failures = 0

    def leading_held(self, keys: Sequence[ContentKey]) -> int:
        if not keys:
            return 0

        def valid(held: Any) -> bool:
            return isinstance(held, int) and not isinstance(held, bool) and 0 <= held <= len(keys)
        held = self._ask({"keys": [k.to_wire() for k in keys]}, valid)
        return 0 if held is None else held

    def first_held(self, keys: Sequence[ContentKey]) -> int | None:
        """The index of the first of ``keys`` the worker holds (one round trip for all of
        them); ``None`` when it holds none."""
        if not keys:
            return None

        def valid(held: Any) -> bool:
            return held is None or (isinstance(held, int) and not isinstance(held, bool) and 0 <= held < len(keys))
        return self._ask({"first": [k.to_wire() for k in keys]}, valid)

    def _ask(self, request: dict, valid: Callable[[Any], bool]) -> Any:
        """The worker's ``held`` answer to ``request``; ``None`` where it gave none in time (or
        answered ``null``)."""
        with self._lock:
            self.calls += 1
            for attempt in range(2):             # a worker restarted since: reconnect once
                try:
                    sock = self._connect()
                    _send(sock, request)
                    answer = _recv(sock)
                    held = answer.get("held")
                    if not valid(held):
                        raise ValueError(f"lookup answer {answer!r}")
                    self._warned = False
                    return held
                except (OSError, ConnectionError, ValueError) as exc:
                    self._drop()
                    if attempt == 1:
                        self.failures += 1
                        if not self._warned:
                            log.warning("mmtier: the worker's lookup channel %s did not answer "
                                        "(%s): counted as a miss", self.path, exc)
                            self._warned = True
        return None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.path))
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def held_run(cache: Any, keys: Sequence[ContentKey]) -> int:
    """How many leading ``keys`` ``cache`` holds (it stops at the first miss)."""
    n = 0
    for key in keys:
        if not cache.contains(key):
            break
        n += 1
    return n


class LookupChannel:
    """One connector's end of the channel where vLLM's workers run in processes of their own:
    each worker's end serves its cache (``held_run``), the scheduler's end (``asks``) asks
    them all. An engine of ``shards`` workers (tensor / pipeline parallel, each holding its
    shard of every group) has a socket per worker (``shard``: this worker's); the scheduler's
    answer is the least of theirs, so it reports a hit only where every worker can load it.
    ``key_of`` maps a scheduler's key to the one the worker's cache holds (its shard's)."""

    def __init__(self, name: str, rank: int, *, worker: bool, cache: Any, shards: int = 1, shard: int = 0,
                 key_of: Callable[[ContentKey], ContentKey] | None = None):
        def path(i: int) -> Path:
            return socket_path(name, rank, None if shards == 1 else i)

        self.asks = not worker
        mapped = key_of or (lambda key: key)
        self._server = None if self.asks else LookupServer(
            path(shard), lambda keys: held_run(cache, [mapped(k) for k in keys]))
        self._clients = [LookupClient(path(i)) for i in range(shards)] if self.asks else []

    def leading_held(self, keys: Sequence[ContentKey]) -> int:
        """The workers' answer, the least of theirs (the scheduler's end only)."""
        assert self._clients, "the worker's end answers, it does not ask"
        held = len(keys)
        for client in self._clients:
            held = min(held, client.leading_held(keys))
            if held == 0:
                break
        return held

    def first_held(self, keys: Sequence[ContentKey]) -> int | None:
        """The index of the first of ``keys`` every worker holds (``None``: none): one round
        trip per worker where they agree, as they do when each saved its shard of every group
        (the scheduler's end only)."""
        assert self._clients, "the worker's end answers, it does not ask"
        start = 0
        while start < len(keys):
            firsts = [client.first_held(keys[start:]) for client in self._clients]
            if any(f is None for f in firsts):
                return None
            last = max(firsts)
            if all(f == last for f in firsts):
                return start + last
            start += last              # a key some worker lacks: on from the next one some hold
        return None

    def close(self) -> None:
        for end in (self._server, *self._clients):
            if end is not None:
                end.close()
