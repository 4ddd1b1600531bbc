"""Tests of the Ray layer."""
