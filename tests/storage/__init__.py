"""Tests of the host and disk tiers."""
