"""KV-cache ops shared by every backend: write new K/V at their slots, copy and swap blocks.

Every backend lays a layer's cache out as `[2, num_blocks, block_size, num_kv_heads, head_size]`
(keys, then values; NHD within a block), so one set of cache ops serves all three. FlashInfer
takes the `(kv_cache[0], kv_cache[1])` pair, xFormers views each half as one long sequence.
"""

from __future__ import annotations

import torch

from compiled_attn.abstract import AttentionType
from compiled_attn.forward_context import PieceCapture, get_forward_context, get_layer
from compiled_attn.ops.common import checked_step
from compiled_attn.ops.library import define_op, register_fake
from compiled_attn.validation import CACHE_WRITING_TYPES, check_block_cache, check_block_pairs


def _to_cache_dtype(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    # fp8 caches store x / scale, saturated to the format's finite range (torch's cast alone
    # gives inf for e5m2 but saturates e4m3fn; one rule for both); other caches store x as is
    # (the scale is an fp8 notion).
    if cache_dtype.itemsize == 1:
        most = torch.finfo(cache_dtype).max
        return (x.float() / scale).clamp(-most, most).to(cache_dtype)
    return x.to(cache_dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_size] at `slot_mapping` (-1: skip).

    Capturable on CUDA (one Triton launch, no sync); on CPU a masked index_put.
    """
    if kv_cache.is_cuda:
        from compiled_attn.ops.triton_cache import write_kv_cache_cuda

        write_kv_cache_cuda(key, value, kv_cache, slot_mapping, k_scale, v_scale)
        return
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for half, x, scale in ((0, key, k_scale), (1, value, v_scale)):
        flat = kv_cache[half].view(-1, *kv_cache.shape[3:])  # [num_blocks * block_size, H, D]
        flat[slots] = _to_cache_dtype(x[valid], scale, kv_cache.dtype)


@define_op("kv_cache_update(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, str layer_name) -> ()",
           reads_forward_context=True)
def kv_cache_update(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer_name: str
) -> None:
    """Write this step's new K/V into `kv_cache` at the forward context's slots.

    query: [num_tokens, num_heads, head_size], read for nothing but the checks (its rows and
    device, so that a call the attention op would refuse writes nothing); key/value:
    [num_tokens, num_kv_heads, head_size]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_size]. A cross-attention layer (ENCODER_DECODER) writes the encoder tokens at the cross
    slots. k/v scales come from the layer. Capturable: one kernel, no sync.

    Inside a piecewise capture (`forward_context.PieceCapture`) there is no step to check: the
    write is recorded over the bucket's static slot buffer, all pads, which the piecewise graphs
    fill before each replay after checking the step (`validation.check_captured_writes`).
    """
    context_md = get_forward_context().attn_metadata
    if type(context_md) is PieceCapture:
        call = get_layer(layer_name)
        write_kv_cache(key, value, kv_cache, context_md.slot_mapping, call.k_scale, call.v_scale)
        return
    call, md = checked_step(layer_name, query, key, value, kv_cache)
    if call.attn_type not in CACHE_WRITING_TYPES:  # its checks covered no cache: it must not write one
        raise ValueError(f"layer {layer_name!r} is {call.attn_type.name} attention, which has no KV cache: "
                         "kv_cache_update serves DECODER and ENCODER_DECODER layers")
    cross = call.attn_type == AttentionType.ENCODER_DECODER
    slot_mapping = md.cross_slot_mapping if cross else md.slot_mapping
    write_kv_cache(key, value, kv_cache, slot_mapping, call.k_scale, call.v_scale)


@register_fake("kv_cache_update")
def _(query, key, value, kv_cache, layer_name) -> None:
    return None


@define_op("copy_blocks(Tensor(a!)[] kv_caches, Tensor src_to_dists) -> ()", reads_forward_context=False)
def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
    """Copy whole blocks src -> dst inside each cache (all layers at once).

    kv_caches: list of [2, num_blocks, block_size, num_kv_heads, head_size]; src_to_dists: int64
    [N, 2]. Every source of every cache is read before any destination is written, so a list
    naming one cache twice (or a chain like 1->2, 2->3) copies what the blocks held before the call.
    """
    for i, cache in enumerate(kv_caches):
        check_block_pairs(src_to_dists, check_block_cache(cache, f"kv_caches[{i}]"), cache)
    pairs = [src_to_dists.to(cache.device, non_blocking=True) for cache in kv_caches]
    sources = [cache[:, p[:, 0]] for cache, p in zip(kv_caches, pairs, strict=True)]  # copies
    for cache, p, src in zip(kv_caches, pairs, sources, strict=True):
        cache[:, p[:, 1]] = src


@register_fake("copy_blocks")
def _(kv_caches, src_to_dists) -> None:
    return None


@define_op("swap_blocks(Tensor src_kv_cache, Tensor(a!) dst_kv_cache, Tensor src_to_dst) -> ()",
           reads_forward_context=False)
def swap_blocks(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Copy blocks from one cache into another, across devices too (CPU <-> CUDA offload).

    Both caches: [2, num_blocks, block_size, num_kv_heads, head_size] (block counts may differ);
    src_to_dst: int64 [N, 2] of (src block, dst block).
    """
    check_block_cache(src_kv_cache, "src_kv_cache")
    check_block_cache(dst_kv_cache, "dst_kv_cache")
    if src_kv_cache.shape[:1] + src_kv_cache.shape[2:] != dst_kv_cache.shape[:1] + dst_kv_cache.shape[2:]:
        raise ValueError(
            f"caches differ beyond the block count: {tuple(src_kv_cache.shape)} vs {tuple(dst_kv_cache.shape)}"
        )
    if src_kv_cache.dtype != dst_kv_cache.dtype:
        raise ValueError(f"cache dtypes differ: {src_kv_cache.dtype} vs {dst_kv_cache.dtype}")
    check_block_pairs(src_to_dst, src_kv_cache, dst_kv_cache)
    src_idx = src_to_dst[:, 0].to(src_kv_cache.device)
    dst_idx = src_to_dst[:, 1].to(dst_kv_cache.device)
    dst_kv_cache[:, dst_idx] = src_kv_cache[:, src_idx].to(dst_kv_cache.device)


@register_fake("swap_blocks")
def _(src_kv_cache, dst_kv_cache, src_to_dst) -> None:
    return None
