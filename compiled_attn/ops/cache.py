"""KV-cache ops shared by every backend: write new K/V at their slots, copy and swap blocks.

Every backend lays a layer's cache out as `[2, num_blocks, block_size, num_kv_heads, head_size]`
(keys, then values; NHD within a block), so one set of cache ops serves all three. FlashInfer
takes the `(kv_cache[0], kv_cache[1])` pair, xFormers views each half as one long sequence.
"""

from __future__ import annotations

import torch

from compiled_attn.abstract import AttentionType
from compiled_attn.forward_context import get_layer
from compiled_attn.ops.common import current_metadata
from compiled_attn.ops.library import define_op, register_fake

KV_CACHE_DIMS = ("kv", "num_blocks", "block_size", "num_kv_heads", "head_size")
BLOCK_DIM = 1  # blocks are indexed along dim 1 of every cache


def check_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_blocks: int,
    block_size: int,
) -> None:
    """Host-side checks before anything is written (shapes only: no device sync)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_size], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    want = (2, num_blocks, block_size, key.shape[1], key.shape[2])
    if tuple(kv_cache.shape) != want:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}, expected {want} "
            f"({', '.join(KV_CACHE_DIMS)}) for this spec and these keys: allocate it with "
            "backend.get_kv_cache_shape(...)"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocate it with torch.empty(shape))")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"key has {key.shape[0]} tokens but the metadata's slot_mapping has "
            f"{slot_mapping.shape[0]}: build the metadata for this batch"
        )
    if key.device != kv_cache.device or slot_mapping.device != kv_cache.device:
        raise ValueError(
            f"key ({key.device}), kv_cache ({kv_cache.device}) and metadata "
            f"({slot_mapping.device}) must be on one device"
        )
    if key.dtype != value.dtype or not key.dtype.is_floating_point:
        raise ValueError(f"key/value dtypes {key.dtype}/{value.dtype} must be one float dtype")


def _to_cache_dtype(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    # fp8 caches store x / scale; other caches store x as is (the scale is an fp8 notion).
    if cache_dtype.itemsize == 1:
        return (x.float() / scale).to(cache_dtype)
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


@define_op("kv_cache_update(Tensor key, Tensor value, Tensor(a!) kv_cache, str layer_name) -> ()",
           reads_forward_context=True)
def kv_cache_update(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer_name: str) -> None:
    """Write this step's new K/V into `kv_cache` at the forward context's slots.

    key/value: [num_tokens, num_kv_heads, head_size]; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_size]. A cross-attention layer (ENCODER_DECODER) writes the encoder
    tokens at the cross slots. k/v scales come from the layer. Capturable: one kernel, no sync.
    """
    call = get_layer(layer_name)
    # the attention op's backend check, made here too so that foreign metadata writes nothing
    md = current_metadata(call.impl.backend_cls.get_name())
    call.impl.check_matches_metadata(key, kv_cache, md, call.attn_type)
    cross = call.attn_type == AttentionType.ENCODER_DECODER
    slot_mapping = md.cross_slot_mapping if cross else md.slot_mapping
    if slot_mapping is None:
        raise ValueError("cross-attention K/V given but the metadata has no cross_block_tables")
    check_cache_write(key, value, kv_cache, slot_mapping, md.num_blocks, md.block_size)
    write_kv_cache(key, value, kv_cache, slot_mapping, call.k_scale, call.v_scale)


@register_fake("kv_cache_update")
def _(key, value, kv_cache, layer_name) -> None:
    return None


def _check_block_pairs(pairs: torch.Tensor, src_cache: torch.Tensor, dst_cache: torch.Tensor) -> None:
    if pairs.dtype != torch.int64 or pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(
            f"block pairs must be int64 [N, 2] of (src, dst), got {pairs.dtype} {tuple(pairs.shape)}"
        )
    if pairs.device.type != "cpu" or not pairs.numel():
        return  # checking pairs that live on the GPU would sync the device
    for col, cache in ((0, src_cache), (1, dst_cache)):
        ids = pairs[:, col]
        if int(ids.min()) < 0 or int(ids.max()) >= cache.shape[BLOCK_DIM]:
            raise ValueError(
                f"{('src', 'dst')[col]} block ids {ids.tolist()} outside the cache's "
                f"0..{cache.shape[BLOCK_DIM] - 1}"
            )


@define_op("copy_blocks(Tensor(a!)[] kv_caches, Tensor src_to_dists) -> ()", reads_forward_context=False)
def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
    """Copy whole blocks src -> dst inside each cache (all layers at once).

    kv_caches: list of [2, num_blocks, block_size, num_kv_heads, head_size]; src_to_dists: int64
    [N, 2]. Sources are read before any destination is written.
    """
    for cache in kv_caches:
        _check_block_pairs(src_to_dists, cache, cache)
    for cache in kv_caches:
        pairs = src_to_dists.to(cache.device, non_blocking=True)
        cache[:, pairs[:, 1]] = cache[:, pairs[:, 0]]


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
    if src_kv_cache.shape[:1] + src_kv_cache.shape[2:] != dst_kv_cache.shape[:1] + dst_kv_cache.shape[2:]:
        raise ValueError(
            f"caches differ beyond the block count: {tuple(src_kv_cache.shape)} vs {tuple(dst_kv_cache.shape)}"
        )
    if src_kv_cache.dtype != dst_kv_cache.dtype:
        raise ValueError(f"cache dtypes differ: {src_kv_cache.dtype} vs {dst_kv_cache.dtype}")
    _check_block_pairs(src_to_dst, src_kv_cache, dst_kv_cache)
    src_idx = src_to_dst[:, 0].to(src_kv_cache.device)
    dst_idx = src_to_dst[:, 1].to(dst_kv_cache.device)
    dst_kv_cache[:, dst_idx] = src_kv_cache[:, src_idx].to(dst_kv_cache.device)


@register_fake("swap_blocks")
def _(src_kv_cache, dst_kv_cache, src_to_dst) -> None:
    return None
