"""Attention over pages: plans (segments, pins, operands), batches, step plans, disk-streamed attention, and the
kernels (``kernels/``: Triton paged attention and merge, the torch path)."""
