"""The OpenMP threads of a vLLM CPU engine with mmtier's KV connector: as many as without it.

vLLM's CPU build binds each worker's OpenMP threads itself under its ``mp`` executor (the
default, how ``vllm serve`` and ``LLM`` run): ``VLLM_CPU_OMP_THREADS_BIND='auto'`` keeps cores
back for its scheduler process, one per local worker, and one more per worker where *any* KV
connector is configured (``vllm.utils.ompmultiprocessing.OMPProcessManager``, written for NIXL's
transfer threads). So on N cores a plain engine computes on N - 1 threads and the same engine
with a KV connector on N - 2 (on 2 cores: 1 thread, and 2 with a connector, where the
reservation cannot be met). A matrix product or an attention split over another number of
threads sums in another order, and in bfloat16 the answers move: an engine with mmtier's
connector answered otherwise than plain vLLM with nothing loaded (an Intel Xeon with AMX; here,
a tiny Gemma 3 in bf16 under the ``mp`` executor, with a connector that does nothing as well).

``same_threads_as_without_a_connector()`` (called by mmtier's vLLM plugin in every vLLM
process) wraps ``OMPProcessManager.__init__`` so that, where the engine's KV connector is
mmtier's and the user has not set ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (which vLLM then takes as
it is), the binding is computed as for the same engine without a KV connector. mmtier's reader
and writer threads share those cores with the engine's. Other connectors, an explicit binding
(``VLLM_CPU_OMP_THREADS_BIND``: vLLM reserves nothing then) and GPU platforms are untouched.
Where vLLM has no such class (another version), nothing is changed and ``False`` is returned."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from .names import names_kv_connector

log = logging.getLogger(__name__)


class _WithoutKVConnector:
    """A vLLM config seen without its KV connector (everything else read through)."""

    kv_transfer_config = None

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def same_threads_as_without_a_connector() -> bool:
    """Wrap vLLM's ``OMPProcessManager.__init__`` (see the module docstring). Idempotent;
    ``False`` where vLLM has no such class."""
    try:
        from vllm.utils import ompmultiprocessing
    except ImportError:
        return False
    manager = getattr(ompmultiprocessing, "OMPProcessManager", None)
    if manager is None:
        return False
    if getattr(manager.__init__, "_mmtier", False):
        return True
    original = manager.__init__

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if names_kv_connector(getattr(config, "kv_transfer_config", None)) and \
                os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") is None:
            log.info("mmtier: vLLM's CPU threads bound as for the engine without a KV connector "
                     "(set VLLM_CPU_NUM_OF_RESERVED_CPU to choose otherwise)")
            config = _WithoutKVConnector(config)
        original(self, config, *args, **kwargs)

    __init__._mmtier = True
    manager.__init__ = __init__
    return True
