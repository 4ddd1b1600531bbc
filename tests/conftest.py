"""Shared settings of the cache-level tests: where the cache's device pool lives, and the
attention backends every cache-level test runs with.

``backend`` is parametrized over ``torch`` and ``triton``: a test that takes it builds its cache
with ``**backend.cfg()`` and so runs once per backend. The pool lives on CUDA where there is a
GPU (the Triton kernels compiled), else on the CPU (the Triton kernels under
``TRITON_INTERPRET=1``, which ``./run test`` sets); ``MMTIER_TEST_DEVICE`` overrides the device.
Nothing here imports Ray.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
CACHE_DEVICE = os.environ.get("MMTIER_TEST_DEVICE") or ("cuda" if HAS_CUDA else "cpu")
TRITON_RUNS = (CACHE_DEVICE.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1") \
    and importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Backend:
    """One attention backend on the test device."""

    name: str           # CacheConfig.attention_backend
    device: str         # CacheConfig.device

    def cfg(self) -> dict[str, str]:
        return {"attention_backend": self.name, "device": self.device}

    def __str__(self) -> str:
        return self.name


@pytest.fixture(params=["torch", "triton"])
def backend(request) -> Backend:
    if request.param == "triton" and not TRITON_RUNS:
        pytest.skip("the Triton backend needs a CUDA device or TRITON_INTERPRET=1 (./run test sets it) "
                    "and the triton package")
    return Backend(request.param, CACHE_DEVICE)
