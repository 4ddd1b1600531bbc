"""Benchmarks of Serve: mmtier's affinity routing against Serve's default over shared replicas."""
