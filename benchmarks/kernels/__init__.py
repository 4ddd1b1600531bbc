"""Benchmarks of the attention kernels: paged vs contiguous, compiled variants, long context."""
