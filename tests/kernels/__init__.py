"""Tests of the attention kernels."""
