"""Benchmarks of the Ray layer: registry lookups, remote attention and copies between nodes."""
