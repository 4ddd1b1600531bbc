"""Tests of the serving app."""
