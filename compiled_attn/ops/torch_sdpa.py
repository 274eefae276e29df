"""The TORCH_SDPA attention op: padded-batch SDPA over the paged cache, fake kernel beside it.

Requests are gathered into a padded batch (queries by request, keys token by token through the
block tables, at slots computed once per forward) and attended with one
`scaled_dot_product_attention` call per group (prefills, decodes); the query heads of a KV head
share one SDPA head, so K/V are never repeated. Logits soft-cap has no SDPA form: that path
computes the scores explicitly, in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
import torch.nn.functional as F

from compiled_attn.abstract import AttentionMetadata, AttentionType
from compiled_attn.forward_context import get_forward_context
from compiled_attn.ops.common import alibi_bias, checked_step
from compiled_attn.ops.flex_decode import paged_block_mask, paged_decode
from compiled_attn.ops.library import define_attention_op, register_fake

T = TypeVar("T")


def valid_keys(kv_len: torch.Tensor, first_q_pos: torch.Tensor, width: int, sliding_window: int) -> torch.Tensor:
    """bool [B, width]: key j of request b may be seen iff j < kv_len[b] and (with a window) j lies
    after the start of the window of the request's first query, at first_q_pos[b] (int64 [B])."""
    pos = torch.arange(width, device=kv_len.device)
    valid = pos[None, :] < kv_len[:, None].to(torch.int64)
    if sliding_window > 0:  # keys before every query's window: rolled-away blocks (read as block 0)
        valid = valid & (pos[None, :] > first_q_pos[:, None] - sliding_window)
    return valid


def key_slots(
    tables: torch.Tensor, kv_len: torch.Tensor, first_q_pos: torch.Tensor, block_size: int, sliding_window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each request's keys sit in the flattened cache, and which of them its queries may see.

    tables: int32 [B, n] block tables. Returns (slot int64 [B, n * block_size], `valid_keys`).
    Invalid keys point at the request's newest key (written, this step or earlier) instead of
    their own slot: the gathered K/V are then finite wherever the cache holds garbage (it comes
    from torch.empty, NaN included, which survives a -inf mask as 0 * NaN), with no zeroing pass
    over K and V after the gather.
    """
    width = tables.shape[1] * block_size
    valid = valid_keys(kv_len, first_q_pos, width, sliding_window)
    pos = torch.arange(width, device=tables.device)
    slot = tables.to(torch.int64).repeat_interleave(block_size, dim=1) * block_size + pos % block_size
    newest = slot.gather(1, kv_len.to(torch.int64)[:, None] - 1)
    return torch.where(valid, slot, newest), valid


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool `valid` [B, Lk] as SDPA's additive mask [B, 1, 1, Lk]: 0 where valid, -inf elsewhere
    (what SDPA would make of the bool mask itself, in every layer)."""
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))
    return bias[:, None, None]


def gather_keys(cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, H, D] read at `slot` [B, L] -> [B, L, H, D]."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat.index_select(0, slot.view(-1)).view(*slot.shape, *cache.shape[2:])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    q_pos: torch.Tensor,
    causal: bool,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
    alibi_slopes: torch.Tensor | None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a padded batch.

    q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D], finite everywhere; valid: bool [B, Lk], the keys
    each request may see (`key_slots`); q_pos: int64 [B, Lq] query positions in the key sequence.
    key_bias: `valid` as an additive mask in q's dtype (`additive_mask`), made once per forward,
    which the one-query SDPA path (no ALiBi, no soft-cap) takes instead of converting `valid`.
    Returns [B, Lq, Hq, D].

    The query heads of one KV head go in as rows of one SDPA head ([B, Hkv, G * Lq, D]): K/V
    are never repeated per query head, and any fused SDPA kernel that takes a mask can serve
    the call (no `enable_gqa` needed).
    """
    batch, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    decode = lq == 1 and (causal or sliding_window <= 0)
    if decode and alibi_slopes is None:
        # One query at q_pos = kv_len - 1 (self) or anywhere (cross): causality adds nothing to
        # `valid`, nor does the window (its start is in `valid`).
        mask = valid[:, None, None, None, :]  # [B, 1, 1, 1, Lk]
        rel = None
    else:
        kpos = torch.arange(lk, device=q.device)
        rel = kpos[None, None, :] - q_pos[:, :, None]  # [B, Lq, Lk] key pos - query pos
        mask = valid[:, None, :]
        if causal:
            mask = mask & (rel <= 0)
        if sliding_window > 0:
            mask = mask & (rel > -sliding_window)
        mask = mask[:, None, None]  # [B, 1, 1, Lq, Lk]
    # [B, Lq, Hkv, G, D] -> [B, Hkv, G, Lq, D]: the G query heads of a KV head side by side.
    qg = q.view(batch, lq, hkv, group, d).permute(0, 2, 3, 1, 4)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, Lk, D]
    if logits_soft_cap <= 0:
        if rel is None:
            # [B, 1, 1, Lk]: the same keys for every row
            attn_mask = mask[:, :, 0] if key_bias is None else key_bias
        else:
            attn_mask = mask.expand(batch, 1, group, lq, lk)
            if alibi_slopes is not None:
                slopes = alibi_slopes.view(1, hkv, group, 1, 1)
                attn_mask = alibi_bias(slopes, rel[:, None, None], attn_mask).to(q.dtype)
            attn_mask = attn_mask.reshape(batch, -1, group * lq, lk)
        out = F.scaled_dot_product_attention(qg.reshape(batch, hkv, group * lq, d), kt, vt,
                                             attn_mask=attn_mask, scale=scale)
        return out.view(batch, hkv, group, lq, d).permute(0, 3, 1, 2, 4).reshape(batch, lq, hq, d)
    # Soft-cap has no SDPA form: explicit scores, in fp32.
    scores = (qg.float() @ kt[:, :, None].float().transpose(-1, -2)) * scale  # [B, Hkv, G, Lq, Lk]
    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.float32).view(hkv, group)[None, :, :, None, None]
        scores = scores + slopes * rel[:, None, None].to(torch.float32)
    scores = scores.masked_fill(~mask, float("-inf"))
    out = scores.softmax(-1) @ vt[:, :, None].float()  # [B, Hkv, G, Lq, D]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, lq, hq, d).to(q.dtype)


@define_attention_op("torch_sdpa_attention")
def torch_sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """Attention for the forward context's batch, written into `output`.

    query/output: [num_tokens, num_heads, head_size]; key/value: [num_tokens (encoder tokens
    for cross attention), num_kv_heads, head_size] or None; kv_cache: [2, num_blocks,
    block_size, num_kv_heads, head_size] (already holding this step's K/V) or None.
    Scale, window, soft-cap and ALiBi come from the layer `layer_name`.
    """
    call, md = checked_step(layer_name, query, key, value, kv_cache, output)
    impl, kind = call.impl, call.attn_type
    window = impl.sliding_window or 0
    opts = dict(scale=impl.scale, sliding_window=window, logits_soft_cap=impl.logits_soft_cap or 0.0,
                alibi_slopes=impl.alibi_on(query.device))
    if kind in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
        encoder = kind == AttentionType.ENCODER
        lens = md.encoder_seq_lens_tensor if encoder else md.seq_lens_tensor
        index = md.encoder_token_index if encoder else md.prefill_token_index
        q_pos = md.encoder_q_pos if encoder else md.prefill_q_pos
        flat = md.encoder_flat_index if encoder else md.prefill_flat_index
        # Pad rows of `index` repeat a request's first token: key and value are finite everywhere.
        valid = once_per_forward(md, kind.value, False, window, query.is_cuda,
                                 lambda: valid_keys(lens, q_pos[:, 0], index.shape[1], window))
        out = attend(query[index], key[index], value[index], valid, q_pos, False, **opts)
        output.copy_(out.flatten(0, 1)[flat])
        return
    cross = kind == AttentionType.ENCODER_DECODER
    tables = md.cross_block_tables if cross else md.block_tables
    kv_lens = md.encoder_seq_lens_tensor if cross else md.seq_lens_tensor
    p, n_pre = md.num_prefills, md.num_prefill_tokens
    if p:
        slot, valid = once_per_forward(md, "prefill", cross, window, query.is_cuda, lambda: key_slots(
            tables[:p], kv_lens[:p], md.prefill_q_pos[:, 0], md.block_size, window))
        q = query[md.prefill_token_index]
        out = attend(q, gather_keys(kv_cache[0], slot), gather_keys(kv_cache[1], slot), valid,
                     md.prefill_q_pos, not cross, **opts)
        output[:n_pre] = out.flatten(0, 1)[md.prefill_flat_index]
    plain = not window and not opts["logits_soft_cap"] and opts["alibi_slopes"] is None
    if md.num_decodes and md.flex_decode and plain:  # a graph step of a State on flex: decodes only
        mask = once_per_forward(md, "flex decode", cross, window, query.is_cuda, lambda: paged_block_mask(
            tables, kv_lens, md.block_size, kv_cache.shape[1]))
        output.copy_(paged_decode(query, kv_cache, mask, opts["scale"]))
    elif md.num_decodes:
        q_pos = (md.seq_lens_tensor[p:, None] - 1).to(torch.int64)
        slot, valid = once_per_forward(md, "decode", cross, window, query.is_cuda, lambda: key_slots(
            tables[p:], kv_lens[p:], q_pos[:, 0], md.block_size, window))
        bias = None
        if opts["alibi_slopes"] is None and not opts["logits_soft_cap"]:
            bias = once_per_forward(md, ("decode bias", query.dtype), cross, window, query.is_cuda,
                              lambda: additive_mask(valid, query.dtype))
        q = query[n_pre:, None]  # [num_decodes, 1, H, D]
        out = attend(q, gather_keys(kv_cache[0], slot), gather_keys(kv_cache[1], slot), valid, q_pos,
                     not cross, **opts, key_bias=bias)
        output[n_pre:] = out[:, 0]


def once_per_forward(md: AttentionMetadata, part: Hashable, cross: bool, window: int, cuda: bool,
                     make: Callable[[], T]) -> T:
    """What `make` derives from one part of the step (`key_slots` of the prefills or decodes, the
    decodes' `additive_mask`, the encoder tokens' `valid_keys`), made by the first layer that
    needs it in this forward and shared by the others (layers of another window or attention
    type make their own). A CUDA graph captured inside the forward context makes its own: its
    kernels must be in the graph, not read from a tensor computed before the capture.
    """
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    return get_forward_context().derived(("torch_sdpa", id(md), part, cross, window, capturing), make)


@register_fake("torch_sdpa_attention")
def _(query, key, value, kv_cache, output, layer_name):
    return None
