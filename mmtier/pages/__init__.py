"""Pages: the device arena and its pools, payload checks and writes, copies between pages and tensors, GPU memory sizing."""
