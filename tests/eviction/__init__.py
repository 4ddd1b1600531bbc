"""Tests of the eviction policies."""
