"""Tests of the engine connectors and adapters."""
