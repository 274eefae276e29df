"""The TORCH_SDPA attention op: padded-batch SDPA over the paged cache, fake kernel beside it.

Requests are gathered into a padded batch (queries by request, keys through the block tables)
and attended with one `scaled_dot_product_attention` call per group (prefills, decodes); GQA
goes through `enable_gqa`, so K/V are never repeated. Logits soft-cap has no SDPA form: that
path computes the scores explicitly, in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_attn.abstract import AttentionType
from compiled_attn.ops.common import alibi_bias, checked_step
from compiled_attn.ops.library import define_attention_op, register_fake


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, H, D] gathered through tables [B, n] -> [B, n * block_size, H, D]."""
    b, n = block_tables.shape
    return cache[block_tables].view(b, n * cache.shape[1], *cache.shape[2:])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor,
    q_pos: torch.Tensor,
    causal: bool,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of a padded batch.

    q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] (key j of request b is valid iff j < kv_len[b]);
    q_pos: int64 [B, Lq] query positions in the key sequence. Returns [B, Lq, Hq, D].
    """
    batch, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    kpos = torch.arange(lk, device=q.device)
    valid = kpos[None, :] < kv_len[:, None].to(torch.int64)  # [B, Lk]
    if sliding_window > 0:  # keys before every query's window: rolled-away blocks read as block 0
        valid = valid & (kpos[None, :] > q_pos[:, :1] - sliding_window)
    # Caches come from torch.empty: zero what lies beyond each length (and window) so that
    # garbage (even NaN, which survives a -inf mask as 0 * NaN) never reaches an output.
    k = torch.where(valid[:, :, None, None], k, 0)
    v = torch.where(valid[:, :, None, None], v, 0)
    rel = kpos[None, None, :] - q_pos[:, :, None]  # [B, Lq, Lk] key pos - query pos
    mask = valid[:, None, :].expand(batch, lq, lk)
    if causal:
        mask = mask & (rel <= 0)
    if sliding_window > 0:
        mask = mask & (rel > -sliding_window)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D]
    if logits_soft_cap <= 0:
        attn_mask: torch.Tensor = mask[:, None]  # [B, 1, Lq, Lk]
        if alibi_slopes is not None:
            attn_mask = alibi_bias(alibi_slopes[None, :, None, None], rel[:, None], attn_mask).to(q.dtype)
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=attn_mask, scale=scale, enable_gqa=hq != hkv
        )
        return out.transpose(1, 2)
    # Soft-cap: explicit scores in fp32, queries grouped over their KV head (no K/V repeat).
    group = hq // hkv
    qg = qt.reshape(batch, hkv, group, lq, d).float()
    scores = (qg @ kt[:, :, None].float().transpose(-1, -2)) * scale  # [B, Hkv, G, Lq, Lk]
    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.float32).view(hkv, group)[None, :, :, None, None]
        scores = scores + slopes * rel[:, None, None].to(torch.float32)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    out = scores.softmax(-1) @ vt[:, :, None].float()  # [B, Hkv, G, Lq, D]
    return out.reshape(batch, hq, lq, d).transpose(1, 2).to(q.dtype)


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
    opts = dict(scale=impl.scale, sliding_window=impl.sliding_window or 0,
                logits_soft_cap=impl.logits_soft_cap or 0.0, alibi_slopes=impl.alibi_on(query.device))
    if kind in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
        encoder = kind == AttentionType.ENCODER
        lens = md.encoder_seq_lens_tensor if encoder else md.seq_lens_tensor
        index = md.encoder_token_index if encoder else md.prefill_token_index
        q_pos = md.encoder_q_pos if encoder else md.prefill_q_pos
        flat = md.encoder_flat_index if encoder else md.prefill_flat_index
        out = attend(query[index], key[index], value[index], lens, q_pos, False, **opts)
        output.copy_(out.flatten(0, 1)[flat])
        return
    cross = kind == AttentionType.ENCODER_DECODER
    tables = md.cross_block_tables if cross else md.block_tables
    kv_lens = md.encoder_seq_lens_tensor if cross else md.seq_lens_tensor
    p, n_pre = md.num_prefills, md.num_prefill_tokens
    if p:
        k = gather_blocks(kv_cache[0], tables[:p])
        v = gather_blocks(kv_cache[1], tables[:p])
        q = query[md.prefill_token_index]
        out = attend(q, k, v, kv_lens[:p], md.prefill_q_pos, not cross, **opts)
        output[:n_pre] = out.flatten(0, 1)[md.prefill_flat_index]
    if md.num_decodes:
        k = gather_blocks(kv_cache[0], tables[p:])
        v = gather_blocks(kv_cache[1], tables[p:])
        q = query[n_pre:, None]  # [num_decodes, 1, H, D]
        q_pos = (md.seq_lens_tensor[p:, None] - 1).to(torch.int64)
        out = attend(q, k, v, kv_lens[p:], q_pos, not cross, **opts)
        output[n_pre:] = out[:, 0]


@register_fake("torch_sdpa_attention")
def _(query, key, value, kv_cache, output, layer_name):
    return None
