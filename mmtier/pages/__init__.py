"""Pages: the device arena and its pools, payload checks and writes, copies between pages and tensors, GPU memory sizing,
and the write kernels (``kernels/``), with what attention's kernels share with them (the backend choice, Triton launch
settings, int32 index arrays)."""
