"""Tests of the page pools."""
