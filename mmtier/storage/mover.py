"""The mover: asynchronous spill, restore and prefetch between the host and disk tiers.

One worker thread runs one asyncio event loop (the mover's own); disk writes use aiofiles on
it, reads and checksum work run on its small thread pool. Jobs wait in a priority queue:
demand restores (``RESTORE``) first, then prefetches (``PREFETCH``), then spills (``SPILL``);
FIFO within a priority. A job starts only while the bytes in flight stay within
``max_inflight_bytes`` (a job larger than the bound runs alone). A job for a key that is
already queued or running returns that job's future (a restore joining a queued prefetch
raises its priority). Every call returns a ``concurrent.futures.Future``; its done-callbacks
run on the mover's thread, so keep them short.

The rule "a page is never reused while a copy from it is in flight" is enforced two ways:

- a spill from the host tier (``pages=None``) takes a hold on the host entry when it is
  submitted; the slots return to the free stack only after the write finished, even if the
  owner removes the group meanwhile;
- a spill from pages the owner manages (device pool pages, a staging buffer) passes
  ``release=``: a callable the mover calls exactly once when it no longer reads the source
  (success, failure or cancellation), before the future resolves. The owner frees or unpins
  those pages there.

How the cache drives it (sketch)::

    mover = Mover(host, disk, model=cfg.model, max_inflight_bytes=cfg.max_inflight_bytes)
    # demote host -> disk, dropping the host copy once the file is durable:
    mover.spill(key, spec, num_tokens, remove_from_host=True).add_done_callback(on_spilled)
    # device -> disk straight from pool pages (gathered), pages freed in the release hook:
    mover.spill(key, spec, n_tok, pool.view[ids], release=lambda: pool.free(ids))
    # a sequence needs a disk group now: restore into host slots (None: a miss, recompute)
    entry = mover.restore(key, spec).result(timeout=30)
    mover.prefetch(key, spec)                     # likely needed soon: same, lower priority
    x = mover.fetch(key, spec).result(timeout=30)  # disk -> a fresh tensor, host untouched
    pages, ok = mover.fetch_many(keys, spec).result()  # several groups, one job
    one, ok = mover.fetch_many(keys, spec, layer=3).result()  # just layer 3 of each page
    mover.close()                                 # waits for queued and in-flight jobs
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import ClosedError, MMTierError, ShapeError, UnknownKeyError
from .arrow_files import DiskTier
from .dest_pages import DestTokens
from .host import HostEntry, HostTier
from .staging import StagingPool

log = logging.getLogger(__name__)


class Priority(IntEnum):
    RESTORE = 0
    PREFETCH = 1
    SPILL = 2


@dataclass(eq=False)
class _Job:
    op: str
    priority: int
    key: ContentKey | None
    nbytes: int
    run: Callable[[], Awaitable[object]]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    releases: list[Callable[[], None]] = field(default_factory=list)
    started: bool = False


class Mover:
    """Spill / restore / prefetch jobs over a host and a disk tier, on one worker loop."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None, *, model: str,
                 max_inflight_bytes: int, workers: int = 4, name: str = "mmtier-mover"):
        if max_inflight_bytes <= 0:
            raise ValueError(f"max_inflight_bytes must be > 0, got {max_inflight_bytes}")
        self.host, self.disk, self.model = host, disk, model
        self.max_inflight_bytes = max_inflight_bytes
        self._lock = threading.Lock()
        self._heap: list[tuple[int, int, _Job]] = []
        self._seq = itertools.count()
        self._by_key: dict[tuple[str, bytes], _Job] = {}
        self._inflight: set[_Job] = set()
        self._inflight_bytes = 0
        self._paused = False
        self._closed = False
        self._idle_waiters: list[asyncio.Future] = []
        self.peak_inflight_bytes = 0
        self.started_log: deque[tuple[str, int, ContentKey | None]] = deque(maxlen=4096)
        self._counts = dict.fromkeys(("submitted", "joined", "done", "failed", "cancelled"), 0)
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    # ---- jobs ----
    def spill(self, key: ContentKey, spec: ModalitySpec, num_tokens: int,
              pages: torch.Tensor | Sequence[torch.Tensor] | None = None, *,
              release: Callable[[], None] | None = None,
              remove_from_host: bool = False) -> concurrent.futures.Future:
        """Write a group to disk. ``pages=None``: from the host tier (held until written).
        Resolves to the ``DiskEntry``; ``remove_from_host`` drops the host copy afterwards."""
        disk, host = self._need_disk(), self.host
        releases = [release] if release is not None else []
        entry: HostEntry | None = None
        if pages is None:
            entry = host.hold(key) if host is not None else None
            if entry is None:
                self._call(releases)
                raise UnknownKeyError(f"spill of {key!r}: not in the host tier")
            releases.append(lambda: host.release(entry))  # type: ignore[union-attr]

        async def run() -> object:
            if entry is not None and not entry.is_ready:
                await asyncio.get_running_loop().run_in_executor(None, entry.wait)
            src = entry.runs() if entry is not None else pages
            # from the host tier: the write checks the pages against the entry's digests
            expected = entry.sums if entry is not None else None
            written = await disk.put_async(key, spec, num_tokens, src,  # type: ignore[arg-type]
                                           expected_sums=expected)
            if remove_from_host and host is not None:
                host.remove(key)
            return written

        nbytes = spec.pages_for(num_tokens) * spec.page_bytes
        return self._submit("spill", Priority.SPILL, key, nbytes, run, releases)

    def restore(self, key: ContentKey, spec: ModalitySpec, *,
                priority: Priority = Priority.RESTORE) -> concurrent.futures.Future:
        """Disk -> host slots. Resolves to the ``HostEntry`` or ``None`` (absent or corrupt);
        ``CapacityError`` when the host tier has no room (the owner evicts and retries)."""
        disk, host = self._need_disk(), self.host
        if host is None:
            raise MMTierError("restore needs a host tier")
        present = host.get(key)
        info = disk.info(key)
        if present is not None or info is None:
            return _resolved(present)

        async def run() -> object:
            have = host.get(key)
            if have is not None:
                return have
            entry = host.reserve(key, spec, info.num_tokens)
            try:
                got = await disk.get_async(key, spec, self.model, out=entry.runs())
            except BaseException:
                host.abort(entry)
                raise
            if got is None:
                host.abort(entry)
                return None
            return host.commit(entry)

        return self._submit("load", priority, key, info.num_pages * spec.page_bytes, run, [])

    def prefetch(self, key: ContentKey, spec: ModalitySpec) -> concurrent.futures.Future:
        """A restore at prefetch priority (after demand restores, before spills)."""
        return self.restore(key, spec, priority=Priority.PREFETCH)

    def fetch(self, key: ContentKey, spec: ModalitySpec,
              out: torch.Tensor | Sequence[torch.Tensor] | DestTokens | None = None) -> concurrent.futures.Future:
        """Disk -> a tensor (or ``out``: pages, or a group's tokens), leaving the host tier alone:
        streaming disk pages for CPU attention, a group read. Resolves to it or ``None``."""
        disk = self._need_disk()
        info = disk.info(key)
        if info is None:
            return _resolved(None)

        async def run() -> object:
            return await disk.get_async(key, spec, self.model, out=out)

        # A fetch into the caller's ``out`` must not join another caller's job (that one fills
        # its own destination): only plain fetches share.
        return self._submit("fetch", Priority.RESTORE, key if out is None else None,
                            info.num_pages * spec.page_bytes, run, [])

    def fetch_many(self, keys: Sequence[ContentKey], spec: ModalitySpec,
                   layer: int | None = None, staging: StagingPool | None = None) -> concurrent.futures.Future:
        """Disk -> one new tensor holding the pages of ``keys`` (groups of one modality) back
        to back, in order, for streaming attention; one job. With ``layer``, only that layer
        of each page is read (``DiskTier.get_layer``) and the tensor is ``[pages,
        *spec.layer_shape]``. Resolves to ``(pages, ok)``: ``ok[i]`` is False where group ``i``
        was missing or failed verification (its pages in the tensor are undefined). With
        ``staging`` the tensor is a view of a buffer taken from that pool: hand it back with
        ``staging.give(pages)`` once done with it (it is the buffer's start)."""
        disk = self._need_disk()
        infos = [disk.info(k) for k in keys]
        sizes = [info.num_pages if info is not None else 0 for info in infos]
        shape, page_bytes = ((spec.page_shape, spec.page_bytes) if layer is None
                             else (spec.layer_shape, spec.layer_bytes))
        if layer is not None and not 0 <= layer < spec.page_layers:
            raise ShapeError(f"layer {layer} out of range for {spec.name!r} ({spec.page_layers} layers)")

        def read_layers(pages: torch.Tensor) -> list[bool]:
            ok, first = [], 0
            for k, info, n in zip(keys, infos, sizes):
                ok.append(info is not None and disk.get_layer(k, spec, self.model, layer, out=pages[first:first + n])
                          is not None)
                first += n
            return ok

        def run_sync() -> object:
            if staging is None:
                pages = torch.empty(sum(sizes), *shape, dtype=spec.torch_dtype)
            else:
                buf = staging.take(sum(sizes) * page_bytes)
                pages = staging.pages(buf, sum(sizes), tuple(shape), spec.torch_dtype)
            try:
                ok = disk.get_many(keys, spec, self.model, pages, sizes) if layer is None else read_layers(pages)
            except BaseException:
                if staging is not None:
                    staging.give(pages)
                raise
            return pages, ok

        async def run() -> object:
            return await asyncio.get_running_loop().run_in_executor(None, run_sync)

        return self._submit("fetch_many", Priority.RESTORE, None, sum(sizes) * page_bytes, run, [])

    def submit(self, fn: Callable[[], object], *, priority: Priority, nbytes: int,
               release: Callable[[], None] | None = None) -> concurrent.futures.Future:
        """Any other copy (e.g. device -> host demotion) under the same queue and byte bound;
        ``fn`` is a coroutine function or a plain callable (run on the mover's pool)."""
        async def run() -> object:
            if asyncio.iscoroutinefunction(fn):
                return await fn()
            return await asyncio.get_running_loop().run_in_executor(None, fn)

        return self._submit("custom", priority, None, nbytes, run, [release] if release else [])

    # ---- state ----
    @property
    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"queued": sum(1 for _, _, j in self._heap if not j.started),
                    "inflight": len(self._inflight), "inflight_bytes": self._inflight_bytes,
                    "peak_inflight_bytes": self.peak_inflight_bytes,
                    "max_inflight_bytes": self.max_inflight_bytes, **self._counts}

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold back new starts (jobs already running go on); for batching and for tests."""
        with self._lock:
            self._paused = True
        try:
            yield
        finally:
            with self._lock:
                self._paused = False
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._pump)

    def close(self, timeout: float = 60.0, *, drain: bool = True) -> None:
        """Stop taking jobs and wait (at most ``timeout`` s) for in-flight copies; queued jobs
        run too (``drain``) or are cancelled, their ``release`` hooks called."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._paused = False
            dropped = [] if drain else [j for _, _, j in self._heap if not j.started]
            if not drain:
                self._heap.clear()
        for job in dropped:
            self._finish_unstarted(job)
        self._loop.call_soon_threadsafe(self._pump)
        try:
            asyncio.run_coroutine_threadsafe(self._wait_idle(), self._loop).result(timeout)
        except concurrent.futures.TimeoutError:
            raise MMTierError(f"mover: jobs still in flight after {timeout} s") from None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._executor.shutdown(wait=True)
        self._loop.close()

    def __enter__(self) -> Mover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- queue (submit: any thread; pump and done: the loop thread) ----
    def _submit(self, op: str, priority: int, key: ContentKey | None, nbytes: int,
                run: Callable[[], Awaitable[object]], releases: list[Callable[[], None]]
                ) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                slot = (op, key.digest) if key is not None else None
                job = self._by_key.get(slot) if slot is not None else None
                if job is not None:
                    job.releases.extend(releases)
                    self._counts["joined"] += 1
                    if priority < job.priority and not job.started:
                        job.priority = priority
                        heapq.heappush(self._heap, (priority, next(self._seq), job))
                else:
                    job = _Job(op, priority, key, nbytes, run, releases=releases)
                    heapq.heappush(self._heap, (priority, next(self._seq), job))
                    if slot is not None:
                        self._by_key[slot] = job
                    self._counts["submitted"] += 1
        if closed:
            self._call(releases)
            raise ClosedError("mover is closed")
        self._loop.call_soon_threadsafe(self._pump)
        return job.future

    def _pump(self) -> None:
        while True:
            with self._lock:
                while self._heap and (self._heap[0][2].started or self._heap[0][0] != self._heap[0][2].priority):
                    heapq.heappop(self._heap)
                if self._paused or not self._heap:
                    break
                job = self._heap[0][2]
                if self._inflight and self._inflight_bytes + job.nbytes > self.max_inflight_bytes:
                    break
                heapq.heappop(self._heap)
                job.started = True
                if not job.future.set_running_or_notify_cancel():
                    cancelled = True
                else:
                    cancelled = False
                    self._inflight.add(job)
                    self._inflight_bytes += job.nbytes
                    self.peak_inflight_bytes = max(self.peak_inflight_bytes, self._inflight_bytes)
                    self.started_log.append((job.op, job.priority, job.key))
            if cancelled:
                self._finish_unstarted(job)
                continue
            task = self._loop.create_task(job.run())
            task.add_done_callback(lambda t, job=job: self._done(job, t))
        self._check_idle()

    def _done(self, job: _Job, task: asyncio.Task) -> None:
        with self._lock:
            self._inflight.discard(job)
            self._inflight_bytes -= job.nbytes
            if job.key is not None and self._by_key.get((job.op, job.key.digest)) is job:
                del self._by_key[(job.op, job.key.digest)]
        self._call(job.releases)
        if task.cancelled():
            self._count("failed")
            job.future.set_exception(ClosedError("mover job cancelled"))
        elif task.exception() is not None:
            self._count("failed")
            job.future.set_exception(task.exception())
        else:
            self._count("done")
            job.future.set_result(task.result())
        self._pump()

    def _finish_unstarted(self, job: _Job) -> None:
        with self._lock:
            if job.key is not None and self._by_key.get((job.op, job.key.digest)) is job:
                del self._by_key[(job.op, job.key.digest)]
            self._counts["cancelled"] += 1
        self._call(job.releases)
        job.future.cancel()

    async def _wait_idle(self) -> None:
        waiter = self._loop.create_future()
        self._idle_waiters.append(waiter)
        self._pump()
        await waiter

    def _check_idle(self) -> None:
        with self._lock:
            idle = not self._inflight and not any(not j.started for _, _, j in self._heap)
        if idle:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    # ---- helpers ----
    def _need_disk(self) -> DiskTier:
        if self.disk is None:
            raise MMTierError("this mover has no disk tier")
        return self.disk

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    @staticmethod
    def _call(releases: list[Callable[[], None]]) -> None:
        for fn in releases:
            try:
                fn()
            except Exception:  # an owner's hook failing must not strand the others
                log.exception("mmtier mover: release hook %r failed", fn)


def _resolved(value: object) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut
