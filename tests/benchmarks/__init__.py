"""Tests of the benchmarks' own code (workloads, traces, reports)."""
