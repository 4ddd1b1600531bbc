"""Engine integrations: adapters that put an engine's model code on top of ``TieredKVCache``.

Each module imports its engine lazily (an optional extra): ``mmtier.integrations.transformers``
needs ``pip install mmtier[hf]``. Nothing in the core imports this package.
"""
