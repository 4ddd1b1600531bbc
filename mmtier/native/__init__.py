"""C helpers for the CPU data path, built on first use (``build``) and called through ctypes:
row copies between an engine's blocks and the cache's pages (``rows``)."""
