"""What every storage tier shares: the context manager and the batched forms of the narrow
interface (``contains / put / get / remove / close``), defaulting to loops."""

from __future__ import annotations

from collections.abc import Iterable

from ..content import ContentKey


class StorageTier:
    def contains(self, key: ContentKey) -> bool:
        raise NotImplementedError

    def remove(self, key: ContentKey) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def contains_many(self, keys: Iterable[ContentKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def remove_many(self, keys: Iterable[ContentKey]) -> list[bool]:
        return [self.remove(k) for k in keys]
