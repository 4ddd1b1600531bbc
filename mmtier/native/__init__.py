"""C helpers for the CPU data path, built on first use (``build``) and called through ctypes:
row copies between an engine's blocks and the cache's pages (``rows``, the NaN / Inf test fused
into them) and copies that take each page's xxh3 on the way (``digests``: the host tier's
verified reads and writes in one pass over memory)."""
