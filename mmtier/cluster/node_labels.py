"""A node's stable name for its disk folders: the Ray node label ``mmtier.io/node``.

Ray gives a node a new node id each time it joins, so folders named by node id are found by
nobody after a node is removed and added again. An operator who wants a node's disk to
outlive that sets the label when the node starts (``ray start --labels mmtier.io/node=<name>``,
or KubeRay's ``rayStartParams``; docs/design.md says which name to choose); its store and pools
then keep their files under ``disk_dir / "node-<name>"``. A node without the label keeps the
folders named by node id (the behaviour before labels). Two live nodes with one label would
write one folder: refused with ``NodeLabelError`` before anything is created.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from ..errors import NodeLabelError

LABEL = "mmtier.io/node"
_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")     # a Kubernetes label value


def label_of(node: dict) -> str | None:
    """The stable name of ``node`` (a ``ray.nodes()`` entry), or ``None`` when it has none."""
    value = (node.get("Labels") or {}).get(LABEL) or None
    if value is not None and not _VALUE.fullmatch(value):      # Ray checks this too; a folder name
        raise NodeLabelError(f"node {node.get('NodeID')}: label {LABEL}={value!r} is not a valid "
                             "name (1-63 letters, digits, '-', '_', '.')", (LABEL,))
    return value


def node_folder(disk_dir: Path, label: str) -> Path:
    """The folder a labelled node keeps its store's and pools' disk tiers in."""
    return Path(disk_dir) / f"node-{label}"


def check_unique(nodes: Iterable[dict]) -> dict[str, str | None]:
    """``node id -> label`` of the live nodes; ``NodeLabelError`` when two share a label."""
    labels = {n["NodeID"]: label_of(n) for n in nodes if n.get("Alive")}
    twice = sorted(lab for lab, c in Counter(v for v in labels.values() if v).items() if c > 1)
    if twice:
        ids = {lab: sorted(i for i, v in labels.items() if v == lab) for lab in twice}
        raise NodeLabelError(f"live nodes share the label {LABEL}: {ids}; each would write the same "
                             "folder (give each node its own name, or wait until the old node is dead)",
                             (LABEL,))
    return labels


def label_of_node(node_id: str, nodes: Iterable[dict]) -> str | None:
    """The label of live node ``node_id`` among ``nodes``, checked unique among the live ones."""
    return check_unique(nodes).get(node_id)
