"""Tests of end to end, through a model."""
