"""A check for a class composed of base classes, one file each (``TieredKVCache`` and its parts,
``ClusterCache`` and its parts): no name is defined twice, no part imports the composing module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def check_composed(cls: type, min_parts: int) -> None:
    """``cls``'s bases never define the same name twice (the MRO would silently shadow one) and
    none of them imports ``cls``'s own module (a cycle)."""
    parts = cls.__mro__[1:-1]
    assert len(parts) >= min_parts
    owner: dict[str, str] = {}
    for c in cls.__mro__[:-1]:
        for name in vars(c):
            if name.startswith("__") and name.endswith("__"):
                continue
            assert name not in owner, f"{name} is defined in both {owner[name]} and {c.__name__}"
            owner[name] = c.__name__
    home = {cls.__module__, cls.__module__.rsplit(".", 1)[-1]}
    for c in parts:
        path = Path(sys.modules[c.__module__].__file__)
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & home, f"{path.name} imports {cls.__module__}"


def check_facade(cls: type, parts: list[type], min_parts: int) -> None:
    """``cls`` is a facade over ``parts`` (objects it holds, not bases): it has no base class of
    its own, each part has fewer than three, and no part imports ``cls``'s module (a cycle)."""
    assert cls.__bases__ == (object,), f"{cls.__name__} has bases {cls.__bases__}"
    assert len(parts) >= min_parts
    home = {cls.__module__, cls.__module__.rsplit(".", 1)[-1]}
    for c in parts:
        assert len(c.__bases__) < 3, f"{c.__name__} has {len(c.__bases__)} bases"
        path = Path(sys.modules[c.__module__].__file__)
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & home, f"{path.name} imports {cls.__module__}"
