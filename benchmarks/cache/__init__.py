"""Benchmarks of the whole cache (``TieredKVCache``): multi-turn multimodal dialogue."""
