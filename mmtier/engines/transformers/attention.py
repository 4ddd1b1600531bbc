"""The attention function registered with transformers as ``"mmtier"``.

For a layer backed by an ``MMTierCache`` (``update`` just ran, or its cached cross K/V was
read) it writes the step's fresh K/V of each row into pages (one layer, the row's real tokens
only) and computes the attention of every row in one ``attention_batch`` call. Any other module
that runs with this implementation (an encoder sharing the decoder's config, as Whisper's does)
gets transformers' own sdpa attention; a decoder run without the mmtier cache (it would get a
padding mask sdpa cannot read) raises ``UnsupportedError``.

Masks. Self-attention receives the 2D padding mask (the mask function registered for "mmtier"
is transformers' ``flash_attention_mask``: ``None`` when nothing is padded, else ``[batch,
kv_len]`` booleans): padded tokens are never written, padded query rows come back zero, and
causality holds by position within each row's real tokens, as with a padded dense cache.
Cross-attention receives ``None`` (Whisper) or Mllama's 4D additive mask: the media columns a row
may see are stored; rows that see some other subset raise ``UnsupportedError``.

Sliding windows (Mistral, Qwen2 with ``use_sliding_window``). The paged kernels attend every
earlier position; within the window that is what the window computes, so a step after which
every row holds at most ``sliding_window`` tokens is exact, and a longer one raises
``UnsupportedError`` before anything of it is written.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ...errors import UnsupportedError
from .cache import MMTierLayer, take_active


def mmtier_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: ``query [B, Hq, S, D]``; returns ``([B, S, Hq, D], None)``."""
    layer = take_active(key)
    if layer is None:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            raise UnsupportedError("a decoder layer ran the 'mmtier' attention without the mmtier "
                                   "cache: pass past_key_values=cache_for(model, cache)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    own = getattr(module, "layer_idx", layer.layer_idx)
    if own != layer.layer_idx:
        raise UnsupportedError(f"attention of layer {own} ran with the cache of layer {layer.layer_idx}")
    if kwargs.get("output_attentions"):
        raise UnsupportedError("output_attentions: the mmtier attention returns no weights")
    out = cross_attention(layer, query, attention_mask, scaling) if layer.cross else \
        self_attention(layer, query, attention_mask, scaling, kwargs.get("sliding_window"))
    return out, None


def self_attention(layer: MMTierLayer, query: torch.Tensor, mask, scale, window: int | None = None) -> torch.Tensor:
    rows = layer.rows
    batch, _, q_len, _ = query.shape
    real = None if mask is None else _padding(mask, batch, q_len, query.device)   # None: no padding
    rows.ensure(batch)
    if layer.pending is not None:
        k, v = layer.pending
        layer.pending = None
        if layer.first:
            counts = [q_len] * batch if real is None else real.sum(1).tolist()
            _check_window(rows, rows.layout.sliding_window, counts)     # before anything is written
            rows.begin_self(counts)
        elif window is not None and window < (rows.layout.sliding_window or window + 1):
            _check_window(rows, window, [0] * batch)   # a window the config did not name (its
                                                       # step's tokens are reserved already)
        for b, runs in enumerate(rows.self_res):
            if runs:
                kb, vb = (k[b], v[b]) if real is None else (k[b, :, real[b]], v[b, :, real[b]])
                kb, vb = kb.transpose(0, 1), vb.transpose(0, 1)              # [n, H, D]
                at = 0
                for res in runs:                  # one run, or the step's planned runs in order
                    n = res.num_tokens
                    rows.cache.write_layer(res, layer.pool_layer, kb[at:at + n], vb[at:at + n])
                    at += n
    return _attend(rows.cache, rows.seqs, layer.pool_layer, query, real, True, scale)


def _check_window(rows, window: int | None, counts: list[int]) -> None:
    """Refuse a step after which some row holds more tokens than a sliding window covers: the
    paged kernels attend every earlier position, so a query would see keys the window masks.
    Within the window (``length <= window``) the window masks nothing and the result is exact."""
    if window is None:
        return
    longest = max(rows.cache.sequence(seq).length + n for seq, n in zip(rows.seqs, counts))
    if longest > window:
        raise UnsupportedError(
            f"sliding-window attention (window {window}) over {longest} tokens: the mmtier attention "
            "attends every earlier position, not the last window; keep sequences within the window "
            "(or use a model without a sliding window)")


def cross_attention(layer: MMTierLayer, query: torch.Tensor, mask, scale) -> torch.Tensor:
    rows = layer.rows
    batch, _, q_len, _ = query.shape
    rows.ensure_cross(batch)
    if layer.pending is not None:
        k, v = layer.pending
        layer.pending = None
        cols = _visible_columns(mask, batch, k.shape[2], k.device)
        if layer.first:
            rows.begin_cross(cols.sum(1).tolist())
        for b, res in enumerate(rows.cross_res):
            if res is not None:
                rows.cache.write_layer(res, layer.pool_layer, k[b, :, cols[b]].transpose(0, 1),
                                       v[b, :, cols[b]].transpose(0, 1))
    elif mask is not None:
        _visible_columns(mask, batch, mask.shape[-1], query.device)      # the same checks
    return _attend(rows.cache, rows.cross_seqs, layer.pool_layer, query, None, False, scale)


def _attend(cache, seqs, pool_layer, query, real, causal, scale) -> torch.Tensor:
    """One ``attention_batch`` over the rows' real queries (``real`` None: all of them);
    padded query rows are zero."""
    batch, heads, q_len, dim = query.shape
    q = query.transpose(1, 2)                               # [B, S, Hq, D]
    if real is None:
        flat = cache.attention_batch(seqs, pool_layer, q.reshape(batch * q_len, heads, dim),
                                     range(0, batch * q_len + 1, q_len), causal=causal, scale=scale)
        return flat.view(batch, q_len, heads, dim)
    counts = real.sum(1)
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0).cpu()
    flat = cache.attention_batch(seqs, pool_layer, q[real], indptr, causal=causal, scale=scale)
    if bool(real.all()):
        return flat.view(batch, q_len, heads, dim)
    out = q.new_zeros(batch, q_len, heads, dim)
    out[real] = flat
    return out


def _padding(mask, batch: int, q_len: int, device) -> torch.Tensor:
    """``[B, q_len]`` booleans: which new tokens are real (not padding)."""
    if mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < q_len:
        raise UnsupportedError(
            f"self-attention mask of shape {getattr(mask, 'shape', type(mask).__name__)}: the mmtier "
            "attention takes a 2D padding mask (custom 4D masks are not supported)")
    return mask[:, -q_len:].to(torch.bool)


def _visible_columns(mask, batch: int, n_kv: int, device) -> torch.Tensor:
    """``[B, n_kv]`` booleans: the cross-attention columns each row sees. Query rows that see
    some columns must all see the same ones (one media span per row)."""
    if mask is None:
        return torch.ones(batch, n_kv, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != n_kv:
        raise UnsupportedError(f"cross-attention mask of shape {tuple(getattr(mask, 'shape', ()))} "
                               f"for {n_kv} media tokens is not supported")
    m = mask[:, 0]
    if m.dtype == torch.bool:
        seen = m
    else:
        seen = m > torch.finfo(m.dtype).min / 2
    partial = ~seen.all(-1)                               # query rows with a masked column
    cols = torch.ones(batch, n_kv, dtype=torch.bool, device=m.device)
    for b in range(batch):
        rows = seen[b][partial[b]]
        if rows.shape[0]:
            cols[b] = rows[0]
            if not bool((rows == rows[0]).all()) or not bool(rows[0].any()):
                raise UnsupportedError("cross-attention rows that see different media columns "
                                       "(several images per sequence) are not supported")
    return cols
