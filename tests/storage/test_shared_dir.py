"""Several processes over one disk-tier directory (two engine processes of a node, one restarted
beside the other): a tier never deletes, adopts or budgets another running process's writes in
flight, never quarantines another model's files, and reads another running process's files
without counting them in its budget or deleting them. The other processes are real ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from mmtier.storage import writers
from tests.storage.test_disk import TEXT, group_files, quarantined, tier
from tests.storage.test_helpers import MODEL, key, rand_pages, same_bytes

ROOT = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent("""
    import sys
    from tests.storage.test_disk import TEXT, tier
    from tests.storage.test_helpers import key, rand_pages
    disk = tier(sys.argv[1])
    disk.put(key("text", int(sys.argv[2])), TEXT, 48, rand_pages(TEXT, 3, seed=int(sys.argv[2])))
    print("written", flush=True)
    sys.stdin.readline()                   # stays alive until the test lets it go
""")


def start_writer(directory: Path, i: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(i)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=60)


def test_another_running_processs_write_in_flight_is_left_alone_a_dead_ones_removed(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        final = "text-" + "ab" * 32 + "-0of1.arrow"
        live = tmp_path / f"{final}.{sleeper.pid}-0123456789ab.tmp"
        live.write_bytes(b"half a file")
        dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True, check=True).stdout.strip()
        dead = tmp_path / f"{final}.{dead_pid}-0123456789ab.tmp"
        dead.write_bytes(b"left by a crash")
        disk = tier(tmp_path)
        st = disk.stats()
        assert live.exists() and st["tmp_kept_at_start"] == 1
        assert not dead.exists() and st["tmp_removed_at_start"] == 1
        assert disk.used_bytes == 0 and st["groups"] == 0          # in flight: not adopted
    finally:
        sleeper.kill()
        sleeper.wait()
    again = tier(tmp_path)                                           # its writer is gone now
    assert not live.exists() and again.stats()["tmp_removed_at_start"] == 1


def test_a_running_processs_files_are_read_but_neither_budgeted_nor_deleted(tmp_path):
    proc = start_writer(tmp_path, 1)
    try:
        disk = tier(tmp_path)
        k = key("text", 1)
        assert disk.stats()["borrowed_at_start"] == 1 and disk.used_bytes == 0
        assert same_bytes(disk.get(k, TEXT, MODEL), rand_pages(TEXT, 3, seed=1))   # a hit
        files = group_files(tmp_path)
        assert disk.remove(k) and group_files(tmp_path) == files   # forgotten here, not deleted
        # this process's own group counts and is deleted on removal as before
        mine = key("text", 2)
        entry = disk.put(mine, TEXT, 48, rand_pages(TEXT, 3, seed=2))
        assert disk.used_bytes == entry.nbytes
        assert disk.remove(mine) and disk.used_bytes == 0 and group_files(tmp_path) == files
    finally:
        stop(proc)
    restarted = tier(tmp_path)                 # the writer has exited: its files are taken over
    assert restarted.stats()["borrowed_at_start"] == 0 and restarted.used_bytes > 0
    assert same_bytes(restarted.get(key("text", 1), TEXT, MODEL), rand_pages(TEXT, 3, seed=1))


def test_a_borrowed_file_its_writer_removed_is_a_plain_miss_not_corruption(tmp_path):
    proc = start_writer(tmp_path, 3)
    try:
        disk = tier(tmp_path)
        for f in group_files(tmp_path):        # the writer evicted it meanwhile
            f.unlink()
        assert disk.get(key("text", 3), TEXT, MODEL) is None
        st = disk.stats()
        assert st["misses"] == 1 and st["corrupt_reads"] == 0 and quarantined(tmp_path) == []
        assert not disk.contains(key("text", 3))
    finally:
        stop(proc)


def test_writer_names_tell_a_reused_pid_from_the_writer():
    me = writers.this_writer()
    assert writers.alive(me)
    pid, start = me.split(":")
    assert not writers.alive(f"{pid}:{int(start) + 1}")           # same pid, another process
    assert not writers.alive("not-a-writer") and not writers.alive(None)
