"""The tiny model shape the vLLM connector tests use, and its mmtier cache fields: no vLLM
import, so a test driver that only starts the cluster and asks engine actors needs none."""

from __future__ import annotations

BS, L, H, D = 8, 2, 2, 16


def cache_fields(disk_dir, device_pages=64) -> dict:
    token = 2 * L * H * D * 4
    return dict(model="tiny-vllm", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                modalities={"text": {"page_size": BS, "share": 0.5},
                            "vision": {"page_size": 16, "share": 0.5}},
                device="cpu", device_bytes=device_pages * 16 * token, host_bytes=0,
                disk_dir=str(disk_dir), disk_bytes=64 << 20, disk_free_floor_bytes=0)


EMBED_WIDTH = 24


def with_embeddings(fields: dict) -> dict:
    """``fields`` plus a ``vision_embed`` modality (encoder outputs, the EC connector's)."""
    mods = {name: {**spec, "share": 0.4} for name, spec in fields["modalities"].items()}
    mods["vision_embed"] = {"kind": "embedding", "width": EMBED_WIDTH, "page_size": 16, "share": 0.2}
    return {**fields, "modalities": mods}
