"""Tests of the cache facade and its parts."""
