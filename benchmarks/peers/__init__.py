"""Benchmarks against peer systems: mmtier's data path side by side with LMCache's."""
