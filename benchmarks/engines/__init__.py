"""Benchmarks of the engine integrations: vLLM connectors and engines, transformers, load."""
