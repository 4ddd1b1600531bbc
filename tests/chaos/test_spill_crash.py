"""Scenario 1: a crash at every I/O step of a spill.

Injected: the writing process is SIGKILLed by the test hook in ``mmtier/storage/disk_writes.py``
(``_CRASH_STEP`` / ``_CRASH_AT``, the same as ``MMTIER_CRASH_STEP=<step>:<n>``: the n-th time
a write reaches ``step``) at each of ``before_write``, ``after_write``, ``after_fsync``,
``after_rename``, ``after_dir_fsync``. One helper process imports mmtier once and forks one
writer per case (import takes seconds on a loaded 2-core box; a fork does not); the writer sets
the hook and runs until the hook kills it.

1. Through the whole cache (``TieredKVCache``, no host tier: every demotion is a synchronous
   device -> disk spill): the writer puts 8 groups of 2 pages into a 4-page device; put ``i``
   spills group ``i - 2``; the crash hits the ``n``-th spill (n = 1 and n = 4, so earlier spills
   are already durable). 10 cases.
2. Through ``DiskTier`` with 2-page chunks (groups of 5 pages = 3 files): the crash hits the
   second file of the first group (a partial group on disk) or, for ``after_dir_fsync``, the
   end of the second group. 5 cases.

After the restart (a new cache / tier over the same directory) every group is absent or
byte-exact (its fingerprint equals what the writer put), every spill that finished before the
crash is present, exactly the groups whose only copy was in the killed process are lost, and no
temporary file remains.
"""

from __future__ import annotations

import hashlib
import json
import signal

import pytest
import torch

from mmtier import TieredKVCache
from mmtier.content import KeyMaker, tenant_salt
from mmtier.core.groups import Tier
from mmtier.storage import DiskTier
from mmtier.storage.disk_writes import CRASH_STEPS

from .conftest import (
    MODEL,
    SECRET,
    VISION_PAGE,
    fingerprint,
    make_cfg,
    media,
    run_child,
    seeded_kv,
    tmp_files,
)

pytestmark = pytest.mark.chaos

N_GROUPS = 8
TOKENS = 50                                    # 2 vision pages of 32 tokens
CACHE_NTH = (1, 4)
DISK_NTH = 2
BEHIND_NTH = 4


def cache_writer(directory: str) -> None:
    from pathlib import Path

    # write-behind off: these cases count the spills (``behind_writer`` crashes the write-behind)
    cache = TieredKVCache(make_cfg(Path(directory), device_pages=4, host_pages=0, write_behind=False))
    for i in range(N_GROUPS):
        cache.put(cache.content_key("vision", media(i), tenant="acme"), *seeded_kv(i, TOKENS))


def behind_writer(directory: str) -> None:
    """Every group stays on the device (room for all); the write-behind writes each to disk in
    the background; the process is killed by the hook mid-write, or by itself once the queue
    is drained (no crash step): nothing ever closes the cache."""
    import os
    from pathlib import Path

    cache = TieredKVCache(make_cfg(Path(directory), device_pages=2 * N_GROUPS, host_pages=0))
    for i in range(N_GROUPS):
        cache.put(cache.content_key("vision", media(i), tenant="acme"), *seeded_kv(i, TOKENS))
    assert cache.durable is not None and cache.durable.drain()
    assert all(g.tier == Tier.DEVICE for g in cache.index.groups.values())
    os.kill(os.getpid(), signal.SIGKILL)


def disk_group(i: int):
    """Group ``i`` for the chunked DiskTier run: 5 vision pages of seeded values (3 files)."""
    spec = make_cfg(None).spec("vision")
    key = KeyMaker(MODEL, SECRET).derive(
        modality="vision", layout=spec.layout_fields(), media=hashlib.sha256(media(100 + i)).digest(),
        tenant_salt=tenant_salt(SECRET, "acme"))
    pages = torch.randn(5, *spec.page_shape, generator=torch.Generator().manual_seed(1000 + i))
    return key, spec, pages


def disk_writer(directory: str) -> None:
    disk = DiskTier(directory, model=MODEL, capacity_bytes=1 << 30, chunk_bytes=2 * VISION_PAGE)
    for i in range(3):
        key, spec, pages = disk_group(i)
        disk.put(key, spec, 5 * spec.page_size, pages)


ZYGOTE = """
import json, os, sys, traceback
import mmtier.storage.disk_writes as dw
from tests.chaos import test_spill_crash as t
out = {}
for kind, step, nth, directory in json.load(sys.stdin):
    pid = os.fork()
    if pid == 0:
        try:
            dw._CRASH_STEP, dw._CRASH_AT, dw._crash_hits = step, nth, 0
            getattr(t, kind + "_writer")(directory)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    out[directory] = os.waitstatus_to_exitcode(status)
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Run every crash case once: ``{(kind, step, nth): (directory, exit code)}``."""
    root = tmp_path_factory.mktemp("crash")
    cases = [("cache", s, n, str(root / f"cache-{s}-{n}")) for s in CRASH_STEPS for n in CACHE_NTH]
    cases += [("disk", s, DISK_NTH, str(root / f"disk-{s}")) for s in CRASH_STEPS]
    cases += [("behind", s, BEHIND_NTH, str(root / f"behind-{s or 'drained'}")) for s in (*CRASH_STEPS, "")]
    r = run_child(ZYGOTE, input=json.dumps(cases), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    codes = json.loads(r.stdout.split("RESULT ", 1)[1])
    return {(k, s, n): (d, codes[d]) for k, s, n, d in cases}


@pytest.mark.parametrize("nth", CACHE_NTH)
@pytest.mark.parametrize("step", CRASH_STEPS)
def test_cache_spill_crash_at_every_step(crashed, step, nth, figures):
    from pathlib import Path

    directory, code = crashed[("cache", step, nth)]
    spill = Path(directory)
    assert code == -signal.SIGKILL, f"the writer was not killed at {step}:{nth} (exit {code})"
    with TieredKVCache(make_cfg(spill, device_pages=4, host_pages=0)) as cache:
        c = cache.stats().counters
        assert tmp_files(spill) == []
        present = []
        for i in range(N_GROUPS):
            key = cache.content_key("vision", media(i), tenant="acme")
            if cache.contains(key):
                present.append(i)
                assert cache.index.groups[key].tier == Tier.DISK
                assert fingerprint(*cache.read_group(key)) == fingerprint(*seeded_kv(i, TOKENS))
        # spills 1..nth-1 finished (durable) before the crash; spill nth (group nth-1) is whole
        # once renamed, else absent; group nth was on the device only
        crashed_group = nth - 1
        whole_at_crash = step in ("after_rename", "after_dir_fsync")
        assert present == list(range(crashed_group)) + ([crashed_group] if whole_at_crash else [])
        assert c.get("disk_tmp_removed_at_start", 0) == (0 if whole_at_crash else 1)
        assert c.get("disk_corrupt_reads", 0) == 0 and c.get("corrupt_reads", 0) == 0
        assert c.get("foreign_files", 0) == 0
        # groups 0..nth were held at the crash; lost = those whose only copy was in the killed
        # process (its device, or a spill not yet renamed): recomputed by their producer
        lost = (nth + 1) - len(present)
        assert lost == 1 + (0 if whole_at_crash else 1)
        for i in range(N_GROUPS):            # recompute what is missing: served exact again
            key = cache.content_key("vision", media(i), tenant="acme")
            if i not in present:
                assert cache.put(key, *seeded_kv(i, TOKENS))
            assert fingerprint(*cache.read_group(key)) == fingerprint(*seeded_kv(i, TOKENS))
        figures.update(step=step, nth=nth, present_verified=len(present), lost=lost,
                       served_wrong=0, tmp_removed=c.get("disk_tmp_removed_at_start", 0))


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_chunked_group_crash_leaves_no_partial_group(crashed, step, figures):
    from pathlib import Path

    directory, code = crashed[("disk", step, DISK_NTH)]
    d = Path(directory)
    assert code == -signal.SIGKILL, f"the writer was not killed at {step}:{DISK_NTH} (exit {code})"
    disk = DiskTier(d, model=MODEL, capacity_bytes=1 << 30)
    try:
        st = disk.stats()
        assert tmp_files(d) == []
        present = []
        for i in range(3):
            key, spec, pages = disk_group(i)
            if disk.contains(key):
                got = disk.get(key, spec, MODEL)
                assert got is not None and torch.equal(got.view(torch.uint8), pages.view(torch.uint8))
                present.append(i)
        indexed = sorted(f for e in disk.inventory() for f in e.files)
        on_disk = sorted(p.name for p in d.iterdir() if p.is_file())
        assert on_disk == indexed                     # nothing stray beside whole groups
        if step == "after_dir_fsync":
            assert present == [0, 1] and st["partial_groups_at_start"] == 0
        else:
            assert present == []
            assert st["partial_groups_at_start"] == 1        # its renamed chunk(s) quarantined
        assert st["corrupt_reads"] == 0
        figures.update(step=step, present_verified=len(present),
                       partial_groups_quarantined=st["partial_groups_at_start"],
                       tmp_removed=st["tmp_removed_at_start"], served_wrong=0)
    finally:
        disk.close()


@pytest.mark.parametrize("step", (*CRASH_STEPS, ""))
def test_write_behind_crash_leaves_whole_groups_or_none(crashed, step, figures):
    """The write-behind killed at each step of its 4th write (or, step "", killed once its
    queue drained, nothing closed): a new cache over the directory finds only whole groups,
    byte-exact, no temporary file and nothing read as corrupt; drained, it finds all eight."""
    from pathlib import Path

    directory, code = crashed[("behind", step, BEHIND_NTH)]
    spill = Path(directory)
    assert code == -signal.SIGKILL, f"the writer was not killed at {step or 'the end'} (exit {code})"
    with TieredKVCache(make_cfg(spill, device_pages=2 * N_GROUPS, host_pages=0)) as cache:
        c = cache.stats().counters
        assert tmp_files(spill) == []
        present = []
        for i in range(N_GROUPS):
            key = cache.content_key("vision", media(i), tenant="acme")
            if cache.contains(key):
                present.append(i)
                assert cache.index.groups[key].tier == Tier.DISK
                assert fingerprint(*cache.read_group(key)) == fingerprint(*seeded_kv(i, TOKENS))
        assert c.get("disk_corrupt_reads", 0) == 0 and c.get("corrupt_reads", 0) == 0
        assert c.get("disk_quarantined_at_start", 0) == 0 and c.get("foreign_files", 0) == 0
        if not step:
            assert present == list(range(N_GROUPS))
        elif step in ("after_rename", "after_dir_fsync"):
            # four writes reached their names; others of the same batch may have finished too
            assert len(present) >= BEHIND_NTH
        else:
            assert len(present) < N_GROUPS        # the killed write's file never got its name
        figures.update(step=step or "drained", present_verified=len(present), served_wrong=0,
                       tmp_removed=c.get("disk_tmp_removed_at_start", 0))
