"""mmtier: a tiered, modality-aware, paged KV-cache store for multimodal LLM serving on Ray.

The core (this package minus ``cluster/`` and ``serve/``) imports without Ray.
"""

from .cache import TieredKVCache
from .config import CacheConfig, ModalitySpec
from .content import ContentKey
from .core.segments import SequenceHandle
from .errors import (
    CapacityError,
    ConfigError,
    CorruptDataError,
    DTypeError,
    ForeignKeyError,
    LeaseExpiredError,
    MMTierError,
    PrefixMismatchError,
    ShapeError,
    StorageFullError,
    UnknownKeyError,
    UnknownModalityError,
)

__version__ = "0.1.0"

__all__ = [
    "CacheConfig", "ModalitySpec", "TieredKVCache", "ContentKey", "SequenceHandle",
    "MMTierError", "ConfigError", "ShapeError", "DTypeError", "UnknownModalityError",
    "UnknownKeyError", "ForeignKeyError", "PrefixMismatchError", "CapacityError", "StorageFullError",
    "CorruptDataError", "LeaseExpiredError",
]


def __getattr__(name: str):
    """``mmtier.start`` / ``connect`` / ``shutdown`` import Ray only when first used."""
    if name in ("start", "connect", "shutdown"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'mmtier' has no attribute {name!r}")
