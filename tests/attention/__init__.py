"""Tests of attention."""
