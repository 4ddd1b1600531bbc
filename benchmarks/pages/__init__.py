"""Benchmarks of the page pools: allocate+free throughput, CPU attention over their pages."""
