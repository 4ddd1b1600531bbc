"""Typed errors. Every error mmtier raises on purpose is an ``MMTierError``.

A failed call leaves the cache exactly as it was; corrupt stored data is reported as a miss
plus a counter and surfaces as ``CorruptDataError`` only from the storage layer's own API.
"""

from __future__ import annotations


class MMTierError(Exception):
    """Base of every error mmtier raises on purpose."""


class ConfigError(MMTierError, ValueError):
    """An invalid configuration; ``fields`` names the offending fields (dotted paths)."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.fields = fields
        self.lines: tuple[str, ...] = tuple(f"{f}: {message}" for f in fields)


class NodeLabelError(ConfigError):
    """A node's stable name (the Ray label ``mmtier.io/node``) that is invalid, or that another
    live node has too: both would write one disk folder. Nothing was created."""


class ShapeError(MMTierError, ValueError):
    """A tensor whose shape does not fit the spec it is meant for."""


class DTypeError(MMTierError, TypeError):
    """A tensor whose dtype (or device) does not fit the spec it is meant for."""


class UnknownModalityError(MMTierError, KeyError):
    """A modality that the configuration does not define (or of the wrong payload kind)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class UnknownKeyError(MMTierError, KeyError):
    """A content key that this cache does not hold, or a sequence id it does not know."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ForeignKeyError(MMTierError, ValueError):
    """A content key that this cache did not issue (other model, layout or secret) or forged."""


class PrefixMismatchError(ForeignKeyError):
    """A prefix-dependent group placed where the sequence does not hold the prefix its K/V was
    computed after (its key's parent): reusing it there would be silently wrong."""


class CapacityError(MMTierError):
    """No tier could take the data, after eviction and demotion tried to make room."""


class CorruptDataError(MMTierError):
    """Stored data failed verification (checksum, key fields, layout). Callers see a miss."""


class LeaseExpiredError(MMTierError):
    """A read or transfer whose lease expired before it finished; nothing was returned."""


class StorageFullError(CapacityError):
    """A disk tier refused a write: ENOSPC or its free-space floor would be crossed."""


class ClosedError(MMTierError):
    """The cache (or tier) was closed."""


class HolderLostError(UnknownKeyError):
    """What a call needed lived only on an actor that died (or did not answer): recompute it.
    ``lost``: the digests of the groups that went with it, where the caller knows them."""

    def __init__(self, message: str, lost: tuple[str, ...] = ()):
        super().__init__(message)
        self.lost = lost


class UnsupportedError(MMTierError, NotImplementedError):
    """A model, mask or option an integration does not handle; the message says which."""


class BadMediaError(MMTierError, ValueError):
    """Media bytes that do not decode as an accepted type (a truncated PNG, not a WAV file);
    ``unsupported``: well-formed bytes of a type that is not accepted (a GIF, a float WAV)."""

    def __init__(self, message: str, *, unsupported: bool = False):
        super().__init__(message)
        self.unsupported = unsupported


class BusyError(MMTierError):
    """A model or engine that did not become free within its wait; nothing ran (try again)."""
