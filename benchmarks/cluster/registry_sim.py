"""The registry model's parts: calibration, workloads and the discrete-event simulation.

``registry_model`` sweeps these; the parts live here so the tests drive the same code.

- ``Calibration``: a registry actor's fixed cost per call (``call_s``), its cost per key
  (``key_s``) and the client's share of a round trip that the actor does not see (``client_s``),
  fitted from measured figures (``calibrate``).
- ``TraceWork`` (the Mooncake trace's prompt blocks) and ``PoissonWork`` (synthetic): each
  engine's requests and, per request, the keys it must ask the registry for and the keys it
  publishes, once the engine's location cache (``registry_cache_s``) has answered what it can.
- ``simulate``: one run of one design at one cluster-wide request rate; ``Point`` its figures.

Every registry server (a shard, a replica, the one actor) is a single-server FIFO queue, as a
Ray actor runs its calls one at a time: a call's start is ``max(arrival, server free)`` and its
end start + service (the Lindley recursion, exact for FIFO), with calls offered to the servers in
time order by a heap of engine events.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

DESIGNS = ("a", "b", "c", "d", "e")
DESIGN_NAMES = {
    "a": "one actor, a call per key",
    "b": "one actor, batched per step",
    "c": "N shards by key hash, batched per step",
    "d": "a replica per node, fed by events",
    "e": "N shards by chain, batched per step",
}
KEY_SPACE = 1 << 22                 # engines' copies of the trace get disjoint key ids
MEDIA_POOL = 100                    # shared media groups the requests that carry one draw from
MEDIA_BASE = 1 << 61                # their ids: apart from every engine's trace keys


class CalibrationError(ValueError):
    """A results file lacks the figures the model is fitted from."""


@dataclass(frozen=True)
class Calibration:
    call_s: float                   # the actor's fixed cost per call
    key_s: float                    # the actor's cost per key in a call
    client_s: float                 # the caller's share of a round trip (serialise, send, receive)
    source: str                     # which file and figures, said in the results
    service: str = "det"            # "det": service = call_s + n * key_s; "exp": exponential, that mean

    def service_s(self, n: int) -> float:
        return self.call_s + n * self.key_s


def fit(single_per_s: float, batched_keys_per_s: float, batch: int, server_fraction: float,
        source: str) -> Calibration:
    """Per-call and per-key costs from a sequential single-key rate and a pipelined batched rate.

    One sequential single-key call takes ``1 / single_per_s`` end to end, of which the actor's
    share is ``server_fraction`` (the rest is the client's: ``client_s``); pipelined calls of
    ``batch`` keys keep the actor busy, so ``call_s + batch * key_s = batch / batched_keys_per_s``.
    """
    if not (single_per_s > 0 and batched_keys_per_s > 0 and batch > 1 and 0 < server_fraction <= 1):
        raise CalibrationError(f"cannot fit from single={single_per_s}, batched={batched_keys_per_s}, "
                               f"batch={batch}, server_fraction={server_fraction}")
    rtt = 1.0 / single_per_s
    server_single = server_fraction * rtt
    per_batch = batch / batched_keys_per_s
    key_s = (per_batch - server_single) / (batch - 1)
    call_s = server_single - key_s
    if key_s <= 0 or call_s <= 0:
        raise CalibrationError(f"the figures give call_s={call_s:.3g}, key_s={key_s:.3g}: not a cost "
                               f"(server_fraction {server_fraction} too small or too large)")
    return Calibration(call_s=call_s, key_s=key_s, client_s=rtt - server_single, source=source)


# The names ``calibrate`` reads from ``registry_scale.json`` (the sharded registry's measurement),
# each with the fallbacks a first version of that file may use.
SCALE_SINGLE = ("single_lookups_per_s", "registry_single_lookups_per_s", "lookups_per_s_single_key")
SCALE_BATCHED = ("batched_lookups_per_s", "registry_lookups_per_s", "keys_per_s_batched__shards_1",
                 "lookups_per_s__shards_1")
SCALE_BATCH = ("batch_keys", "lookup_batch", "batch")


def _first(data: dict, names: Sequence[str]) -> tuple[str, float] | None:
    for n in names:
        v = data.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return n, float(v)
    return None


def calibrate(results: Path, server_fraction: float) -> Calibration:
    """From ``results/registry_scale.json`` when it holds the figures, else ``results/cluster.json``.

    ``registry_scale.json`` may also give ``call_s`` and ``key_s`` (and ``client_s``) directly,
    fitted by its own benchmark; then they are used as they are.
    """
    scale = results / "registry_scale.json"
    if scale.exists():
        data = json.loads(scale.read_text())
        if all(isinstance(data.get(k), (int, float)) for k in ("call_s", "key_s")):
            client = float(data.get("client_s", 0.0))
            return Calibration(float(data["call_s"]), float(data["key_s"]), client,
                               f"registry_scale.json ({data.get('date', '?')}): call_s, key_s, client_s")
        single, batched = _first(data, SCALE_SINGLE), _first(data, SCALE_BATCHED)
        if single and batched:
            batch = _first(data, SCALE_BATCH)
            n = int(batch[1]) if batch else 1000
            return fit(single[1], batched[1], n, server_fraction,
                       f"registry_scale.json ({data.get('date', '?')}): {single[0]}, {batched[0]} "
                       f"({n} keys a call), server share of a single call {server_fraction}")
    cluster = results / "cluster.json"
    if not cluster.exists():
        raise CalibrationError(f"neither {scale} nor {cluster} holds the registry's figures")
    data = json.loads(cluster.read_text())
    single, batched = _first(data, ("registry_single_lookups_per_s",)), _first(data, ("registry_lookups_per_s",))
    if not (single and batched):
        raise CalibrationError(f"{cluster} lacks registry_single_lookups_per_s / registry_lookups_per_s")
    note = " (registry_scale.json present but without these figures)" if scale.exists() else ""
    return fit(single[1], batched[1], 1000, server_fraction,
               f"cluster.json ({data.get('date', '?')}): registry_single_lookups_per_s "
               f"{single[1]:,.0f}/s, registry_lookups_per_s {batched[1]:,.0f} keys/s at 1,000 keys a "
               f"call; server share of a single call {server_fraction}{note}")


# ---------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Prepared:
    """One per-engine request rate's workload: request templates and each engine's arrivals."""

    needed: list[np.ndarray]        # per template: key ids the engine must ask the registry for
    new: np.ndarray                 # per template: keys it publishes (new content)
    root: np.ndarray                # per template: its first key (design e places the chain by it)
    times: np.ndarray               # template arrival times over one period, seconds, sorted
    period_s: float                 # the templates repeat after this (a trace wraps around)

    def arrivals(self, t_end: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One engine's (times, template indices, laps) in [0, t_end): the period from a random
        phase; each lap is new content (its keys apart from the other laps')."""
        n = len(self.times)
        phase = rng.uniform(0, self.period_s)
        laps = int(math.ceil((t_end + phase) / self.period_s)) + 1
        t = (self.times[None, :] + self.period_s * np.arange(laps)[:, None]).ravel() - phase
        idx = np.tile(np.arange(n), laps)
        lap = np.repeat(np.arange(laps), n)
        keep = (t >= 0) & (t < t_end)
        return t[keep], idx[keep], lap[keep]


class TraceWork:
    """The Mooncake trace: a request's keys are its prompt's 512-token block hashes.

    Each engine replays its own copy of the trace (disjoint key ids, a random phase), its
    timestamps scaled to the engine's rate: a session stays on its engine, and the hit pattern
    (which blocks recur, how soon) is the trace's. Each lap of the copy is new content (fresh
    keys), so a fast engine does not learn the whole trace: the cache starts each lap cold, as
    the trace itself does. A block is published (``new``) the first time
    the trace names it; at steady state an eviction removes one for each, so each costs two keys
    of writes. Keys an engine saw less than ``registry_cache_s`` ago are answered by its cache.
    """

    def __init__(self, records: Sequence[tuple[float, Sequence[int]]], name: str):
        if not records:
            raise ValueError("an empty trace")
        self.name = name
        self.t = np.array([r[0] for r in records], dtype=float)
        self.t -= self.t[0]
        self.keys = [np.asarray(r[1], dtype=np.int64) for r in records]
        if max(int(k.max(initial=0)) for k in self.keys) >= KEY_SPACE:
            raise ValueError(f"hash ids beyond {KEY_SPACE}")
        gap = float(np.mean(np.diff(self.t))) if len(self.t) > 1 else 1.0
        self.span = float(self.t[-1]) + gap          # one lap of the trace, trace seconds
        self.rate = len(self.t) / self.span          # requests per trace second
        seen: set[int] = set()
        first = []
        for k in self.keys:
            f = 0
            for h in k.tolist():
                if h not in seen:
                    seen.add(h)
                    f += 1
            first.append(f)
        self.first = np.array(first, dtype=np.int64)
        self.root = np.array([int(k[0]) if len(k) else 0 for k in self.keys], dtype=np.int64)
        self._cache: dict[tuple[float, float], Prepared] = {}

    @classmethod
    def load(cls, path: Path) -> TraceWork:
        """Mooncake's JSONL: ``timestamp`` (ms) and ``hash_ids`` per line."""
        records = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            obj = json.loads(line)
            if not isinstance(obj.get("timestamp"), (int, float)) or not isinstance(obj.get("hash_ids"), list):
                raise ValueError(f"{path}:{i + 1}: no timestamp / hash_ids")
            records.append((obj["timestamp"] / 1000.0, obj["hash_ids"]))
        return cls(records, path.name)

    def keys_per_request(self) -> float:
        return float(np.mean([len(k) for k in self.keys]))

    def prepare(self, rate_per_engine: float, cache_s: float) -> Prepared:
        ck = (round(rate_per_engine, 9), cache_s)
        if ck not in self._cache:
            scale = self.rate / rate_per_engine      # wall seconds per trace second
            times = self.t * scale
            period = self.span * scale
            last: dict[int, float] = {}
            needed: list[np.ndarray] = []
            for t, k in zip(times, self.keys, strict=True):
                miss = [h for h in k.tolist() if t - last.get(h, -math.inf) > cache_s]
                for h in k.tolist():
                    last[h] = t
                needed.append(np.array(miss, dtype=np.int64))
            self._cache[ck] = Prepared(needed, self.first, self.root, times, period)
        return self._cache[ck]


class PoissonWork:
    """Synthetic: Poisson arrivals, ``keys`` uniform random keys per request, ``new`` published
    each; no cache hits (every key is asked). The queueing tests' workload."""

    def __init__(self, keys: int, new: int = 0, templates: int = 4096, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.name = f"poisson({keys} keys, {new} new)"
        self._needed = [rng.integers(0, KEY_SPACE, keys, dtype=np.int64) for _ in range(templates)]
        self._new = np.full(templates, new, dtype=np.int64)
        self.seed = seed

    def keys_per_request(self) -> float:
        return float(len(self._needed[0]))

    def prepare(self, rate_per_engine: float, cache_s: float) -> Prepared:
        rng = np.random.default_rng(self.seed + 1)
        n = len(self._needed)
        gaps = rng.exponential(1.0 / rate_per_engine, 50_000)
        times = np.cumsum(gaps)
        idx_t = np.arange(len(times)) % n
        needed = [self._needed[i] for i in idx_t]
        roots = np.array([int(self._needed[i][0]) for i in idx_t], dtype=np.int64)
        return Prepared(needed, self._new[idx_t], roots, times, float(times[-1]) + float(gaps[0]))


# ---------------------------------------------------------------------------- the simulation
@dataclass(frozen=True)
class Inputs:
    """The model's knobs (the defaults are the committed run's)."""

    step_s: float = 0.025           # an engine's scheduler step: its lookups go out once a step
    registry_cache_s: float = 5.0   # how long an engine trusts a location it learned
    engines_per_node: int = 8
    event_flush_s: float = 0.1      # design d: a node sends its stores' events to every replica this often
    p99_bound_s: float = 0.010      # a lookup slower than this at p99: saturated
    backlog_bound_s: float = 0.1    # work left on a server at the window's end beyond this: saturated
    util_bound: float = 0.9         # the busiest server busier than this: saturated
    warmup_s: float = 0.1
    steps_per_run: int = 8000       # engine steps simulated per run (sets the window: 0.25-10 s) ...
    requests_per_run: int = 1000    # ... or requests, whichever is longer (a p99 of enough lookups; up to 30 s)
    window_s: float | None = None   # a fixed window instead (the tests)
    media_share: float = 0.0        # requests that also ask one shared media group (a root of its own:
                                    # its own key's shard, design e's second call; registry_scale's share)
    seed: int = 0

    def window(self, engines: int, rate: float) -> float:
        if self.window_s is not None:
            return self.window_s
        steps = min(10.0, max(0.25, self.steps_per_run * self.step_s / engines))
        return max(steps, min(30.0, self.requests_per_run / rate))


@dataclass(frozen=True)
class Point:
    design: str
    engines: int
    servers: int
    rate: float                     # requests/s, cluster-wide
    p99_s: float                    # lookup latency: sent to answered, the client's share included
    mean_s: float
    max_util: float                 # the busiest server's busy fraction over the window
    mean_util: float
    lookups: int                    # requests that asked the registry, in the window
    keys_per_s: float               # keys asked, cluster-wide
    calls_per_s: float              # calls served, all servers (lookups and writes)
    backlog_s: float                # the busiest server's work left at the window's end
    saturated: bool
    by: str                         # what saturated it: "util", "p99", "util+p99" ("" when not)


def shard_of(keys: np.ndarray, n: int) -> np.ndarray:
    """A key's shard: a multiplicative hash of its id (content keys are digests: uniform)."""
    if n == 1:
        return np.zeros(len(keys), dtype=np.int64)
    return (((keys * 2654435761) & 0xFFFFFFFF) >> 8) % n


class _Servers:
    """Single-server FIFO queues (the Lindley recursion), busy time counted inside the window."""

    def __init__(self, n: int, cal: Calibration, w0: float, w1: float, rng: np.random.Generator):
        self.free = [0.0] * n
        self.busy = [0.0] * n
        self.cal, self.w0, self.w1, self.rng = cal, w0, w1, rng
        self.calls = 0

    def call(self, s: int, arrive: float, keys: int) -> float:
        svc = self.cal.service_s(keys)
        if self.cal.service == "exp":
            svc = float(self.rng.exponential(svc))
        start = max(arrive, self.free[s])
        end = start + svc
        self.free[s] = end
        lo, hi = max(start, self.w0), min(end, self.w1)
        if hi > lo:
            self.busy[s] += hi - lo
        if self.w0 <= arrive < self.w1:
            self.calls += 1
        return end


def _media(template: int, share: float) -> int | None:
    """The shared media group request template ``template`` asks for too (``None``: none); the
    same templates carry one in every design, spread over the pool."""
    if share <= 0 or (template * 0.6180339887) % 1.0 >= share:
        return None
    return MEDIA_BASE + template % MEDIA_POOL


def simulate(design: str, engines: int, rate: float, cal: Calibration, inp: Inputs, work,
             shards: int = 1) -> Point:
    """One run: ``engines`` engines sharing ``rate`` requests/s cluster-wide, ``design`` serving.

    a: every key a call of its own to one actor, sent when the request arrives (writes too);
    b / c: once a step each engine sends one call per shard its keys fall in (b: one shard) and
    one write call per shard; e: as c, but a request's keys and writes all go to the shard of its
    chain's first key (one call per shard its requests' chains fall in), a shared media group's
    (``media_share`` of the requests, one each) on its own key's shard; d: one call to its node's
    replica per step, and every
    ``event_flush_s`` each node sends its stores' events (two keys per new block: the add and an
    eviction's remove) to every replica.
    """
    if design not in DESIGNS:
        raise ValueError(f"unknown design {design!r}: one of {DESIGNS}")
    if engines < 1 or rate <= 0 or shards < 1:
        raise ValueError(f"engines {engines}, rate {rate}, shards {shards}: must be positive")
    n_servers = {"a": 1, "b": 1, "c": shards, "e": shards, "d": max(1, math.ceil(engines / inp.engines_per_node))}[design]
    rng = np.random.default_rng(inp.seed)
    w0 = inp.warmup_s
    w1 = w0 + inp.window(engines, rate)
    prep = work.prepare(rate / engines, inp.registry_cache_s)
    srv = _Servers(n_servers, cal, w0, w1, rng)
    half = cal.client_s / 2
    lat: list[float] = []
    keys_asked = 0
    arr = [prep.arrivals(w1, rng) for _ in range(engines)]
    # an engine's lap of the trace: its own keys (int64 products wrap; shard_of keeps the low bits)
    offset = [KEY_SPACE * (a[2] * 4096 + e) for e, a in enumerate(arr)]

    if design == "a":
        t_all = np.concatenate([a[0] for a in arr])
        i_all = np.concatenate([a[1] for a in arr])
        order = np.argsort(t_all, kind="stable")
        for j in order.tolist():
            t, i = float(t_all[j]), int(i_all[j])
            k = len(prep.needed[i])
            done = t
            for _ in range(k):
                done = srv.call(0, t + half, 1)
            for _ in range(2 * int(prep.new[i])):
                srv.call(0, t + half, 1)
            if k and w0 <= t < w1:
                lat.append(done + half - t)
                keys_asked += k
    else:
        heap: list[tuple[float, int, int]] = []       # (time, kind 0 step / 1 flush, engine or node)
        for e in range(engines):
            heapq.heappush(heap, (float(rng.uniform(0, inp.step_s)), 0, e))
        nodes = n_servers if design == "d" else 0
        pending = [0] * nodes
        for nd in range(nodes):
            heapq.heappush(heap, (float(rng.uniform(0, inp.event_flush_s)), 1, nd))
        pos = [0] * engines
        while heap:
            now, kind, who = heapq.heappop(heap)
            if now >= w1:
                continue
            if kind == 1:                               # d: a node's events to every replica
                if pending[who]:
                    for r in range(nodes):
                        srv.call(r, now + half, pending[who])
                    pending[who] = 0
                heapq.heappush(heap, (now + inp.event_flush_s, 1, who))
                continue
            e = who
            heapq.heappush(heap, (now + inp.step_s, 0, e))
            times, idx, _ = arr[e]
            hi = int(np.searchsorted(times, now, side="right"))
            lo, pos[e] = pos[e], hi
            if hi == lo:
                continue
            reqs = idx[lo:hi].tolist()
            asking = sum(1 for i in reqs if len(prep.needed[i]))
            written = 2 * int(sum(int(prep.new[i]) for i in reqs))
            if design == "d":
                nd = e // inp.engines_per_node
                pending[nd] += written
                k = sum(len(prep.needed[i]) for i in reqs)
                if k:
                    done = srv.call(nd, now + half, k)
                    if w0 <= now:
                        lat.extend([done + half - now] * asking)
                        keys_asked += k
                continue
            if design == "e":                           # a request's keys and writes on its chain's shard
                home = shard_of(prep.root[reqs] + offset[e][lo:hi], n_servers).tolist()
                ask: dict[int, int] = {}
                put: dict[int, int] = {}
                for s, i in zip(home, reqs, strict=True):
                    if len(prep.needed[i]):
                        ask[s] = ask.get(s, 0) + len(prep.needed[i])
                    m = _media(i, inp.media_share) if len(prep.needed[i]) else None
                    if m is not None:
                        sm = int(shard_of(np.array([m], dtype=np.int64), n_servers)[0])
                        ask[sm] = ask.get(sm, 0) + 1
                    if prep.new[i]:
                        put[s] = put.get(s, 0) + 2 * int(prep.new[i])
                done = now
                for s, k in ask.items():
                    done = max(done, srv.call(s, now + half, k))
                if asking and w0 <= now:
                    lat.extend([done + half - now] * asking)
                    keys_asked += sum(ask.values())
                for s, k in put.items():
                    srv.call(s, now + half, k)
                continue
            if asking:
                keys = np.concatenate([prep.needed[i] + o for i, o in zip(reqs, offset[e][lo:hi].tolist(),
                                                                          strict=True)]
                                      + [np.array([m], dtype=np.int64) for m in
                                         (_media(i, inp.media_share) for i in reqs if len(prep.needed[i]))
                                         if m is not None])
                counts = np.bincount(shard_of(keys, n_servers), minlength=n_servers)
                done = now
                for s in np.flatnonzero(counts).tolist():
                    done = max(done, srv.call(s, now + half, int(counts[s])))
                if w0 <= now:
                    lat.extend([done + half - now] * asking)
                    keys_asked += len(keys)
            if written:
                # new blocks' keys are spread like any key: a write call per shard they fall in
                wc = np.bincount(rng.integers(0, n_servers, written), minlength=n_servers)
                for s in np.flatnonzero(wc).tolist():
                    srv.call(s, now + half, int(wc[s]))
    window = w1 - w0
    utils = [b / window for b in srv.busy]
    backlog = max(0.0, max(srv.free) - w1)
    la = np.asarray(lat) if lat else np.zeros(1)
    p99 = float(np.percentile(la, 99))
    max_util = max(utils)
    over_util = max_util > inp.util_bound or backlog > inp.backlog_bound_s
    over_p99 = p99 > inp.p99_bound_s
    by = "+".join(n for n, v in (("util", over_util), ("p99", over_p99)) if v)
    return Point(design=design, engines=engines, servers=n_servers, rate=rate, p99_s=p99,
                 mean_s=float(la.mean()), max_util=max_util, mean_util=float(np.mean(utils)),
                 lookups=len(lat), keys_per_s=keys_asked / window, calls_per_s=srv.calls / window,
                 backlog_s=backlog, saturated=bool(by), by=by)


@dataclass(frozen=True)
class Saturation:
    rate: float                     # the highest rate found below saturation (requests/s, cluster-wide)
    first_saturated: float | None   # the lowest rate found saturated (None: none up to the cap)
    points: tuple[Point, ...]


def find_saturation(design: str, engines: int, cal: Calibration, inp: Inputs, work, shards: int = 1,
                    start: float = 50.0, cap: float = 100_000.0, bisect: int = 5,
                    floor: float = 1.0) -> Saturation:
    """The highest rate below saturation: doubling from ``start`` up to ``cap`` (halving down to
    ``floor`` when ``start`` saturates; rate 0 when even ``floor`` does), then ``bisect``
    geometric halvings of the interval between the last rate below and the first above."""
    points: list[Point] = []

    def saturates(r: float) -> bool:
        points.append(simulate(design, engines, r, cal, inp, work, shards))
        return points[-1].saturated

    ok, bad = 0.0, None
    r = start
    if saturates(r):
        bad = r
        while r / 2 >= floor:
            r /= 2
            if not saturates(r):
                ok = r
                break
            bad = r
    else:
        ok = r
        while r < cap:
            r = min(cap, r * 2)
            if saturates(r):
                bad = r
                break
            ok = r
    if bad is not None and ok > 0:
        for _ in range(bisect):
            mid = math.sqrt(ok * bad)
            if saturates(mid):
                bad = mid
            else:
                ok = mid
    return Saturation(ok, bad, tuple(sorted(points, key=lambda q: q.rate)))


def with_service(cal: Calibration, service: str) -> Calibration:
    return replace(cal, service=service)
