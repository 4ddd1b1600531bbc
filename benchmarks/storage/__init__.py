"""Benchmarks of the disk tier: spill and restore against the raw disk, torch.save and Ray."""
