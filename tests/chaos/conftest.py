"""Shared pieces of the chaos suite: a tiny cache config over three tiers, seeded K/V with exact
fingerprints, a subprocess runner, and a figures log for ``docs/reliability.md``.

Every test here injects a real fault (SIGKILL, removed nodes, killed actors, crafted files, a
full filesystem) and asserts that nothing is lost beyond what the fault took and nothing is
served wrong. Ray binds loopback only: the two variables below are set before anything imports
Ray. ``MMTIER_CHAOS_REPORT=<path>``: the figures every test recorded, as JSON, at session end.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mmtier import CacheConfig, ModalitySpec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "chaos-mm"
SECRET = "chaos-secret"
L, H, D = 2, 2, 32
TOKEN_BYTES = 2 * L * H * D * 4                   # K and V of one token, all layers, float32
VISION_PAGE = 32 * TOKEN_BYTES                    # 32 KiB
TEXT_PAGE = 16 * TOKEN_BYTES                      # 16 KiB


def make_cfg(disk_dir: Path | None, *, device_pages: int = 4, host_pages: int = 0,
             disk_bytes: int = 64 << 20, **over) -> CacheConfig:
    """``device_pages`` vision pages (and as many text pages) on the CPU "device"; the host tier
    holds ``host_pages`` vision pages' worth of bytes; float32 so any byte pattern is legal."""
    base = dict(
        model=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
        modalities={"text": ModalitySpec(page_size=16, share=1 / 3),
                    "vision": ModalitySpec(page_size=32, share=2 / 3)},
        device="cpu", device_bytes=3 * device_pages * TEXT_PAGE + 4096,
        host_bytes=host_pages * VISION_PAGE, disk_dir=disk_dir, disk_bytes=disk_bytes,
        disk_free_floor_bytes=0, key_secret=SECRET)
    base.update(over)
    return CacheConfig(**base)


def media(i: int) -> bytes:
    return f"chaos-image-{i}".encode()


def seeded_kv(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g))


def fingerprint(k: torch.Tensor, v: torch.Tensor) -> str:
    """SHA-256 over the exact bytes of K then V (what was put vs what was read)."""
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tmp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).rglob("*") if p.name.endswith(".tmp"))


def run_child(code: str, env: dict[str, str] | None = None, timeout: float = 120.0,
              input: str | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` in the repo root, mmtier importable, with extra ``env``."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout, input=input)


_FIGURES: dict[str, dict] = {}


@pytest.fixture
def figures(request):
    """``figures["name"] = value``: kept per test, printed, and written at session end."""
    mine: dict = {}
    yield mine
    if mine:
        _FIGURES[request.node.nodeid] = mine
        print(f"\n[chaos figures] {request.node.name}: {json.dumps(mine, sort_keys=True)}")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MMTIER_CHAOS_REPORT")
    if path and _FIGURES:
        Path(path).write_text(json.dumps(_FIGURES, indent=2, sort_keys=True))
