"""Tests of the native helpers."""
