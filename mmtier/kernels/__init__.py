"""Attention kernels (temporary torch-only dispatch; the Triton dispatch replaces this)."""
from .reference import merge_attention_states_torch, paged_attention_torch, write_kv_torch


def paged_attention(q, q_indptr, q_pos, operands, *, causal=True, scale=None, backend="auto", out_dtype=None):
    return paged_attention_torch(q, q_indptr, q_pos, operands, causal=causal, scale=scale, out_dtype=out_dtype)


def merge_attention_states(outs, lses, *, backend="auto", out_dtype=None):
    return merge_attention_states_torch(outs, lses, out_dtype=out_dtype)


def write_kv(kv, k, v, page_ids, offsets, *, backend="auto"):
    return write_kv_torch(kv, k, v, page_ids, offsets)
