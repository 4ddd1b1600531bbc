"""A check for a facade over parts, one file each (``TieredKVCache`` and its parts, ``ClusterCache``
and its parts): the facade has no base class, no part imports the facade's module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def check_facade(cls: type, parts: list[type], min_parts: int, reexported_by: tuple[str, ...] = ()) -> None:
    """``cls`` is a facade over ``parts`` (objects it holds, not bases): it has no base class of
    its own, each part has fewer than three, and no part imports ``cls``'s module, nor a module
    of ``reexported_by`` (a package that re-exports it): a cycle."""
    assert cls.__bases__ == (object,), f"{cls.__name__} has bases {cls.__bases__}"
    assert len(parts) >= min_parts
    home = {cls.__module__, cls.__module__.rsplit(".", 1)[-1]} | set(reexported_by)
    for c in parts:
        assert len(c.__bases__) < 3, f"{c.__name__} has {len(c.__bases__)} bases"
        path = Path(sys.modules[c.__module__].__file__)
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module is None
                     for a in n.names}                   # from . import tiered
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not imported & home, f"{path.name} imports {sorted(imported & home)}"
