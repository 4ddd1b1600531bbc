"""Benchmarks of the eviction policies: trace replays, trace generators, recompute costs."""
