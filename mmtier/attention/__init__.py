"""Attention over pages: plans (segments, pins, operands), batches, step plans, disk-streamed attention."""
