"""The CUDA cache write: one Triton program per token, pads (slot -1) return at once.

A pure-torch write would need either a device sync (to drop the pads) or several small
kernels per layer; at batch 1 those launches cost more than the write itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    key_stride, value_stride, v_offset, k_scale, v_scale,
    ROW: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    dst = slot.to(tl.int64) * ROW + offs  # int64: caches may exceed 2**31 elements
    k = tl.load(key_ptr + token.to(tl.int64) * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * value_stride + offs, mask=mask)
    if SCALE:
        k = k.to(tl.float32) / k_scale
        v = v.to(tl.float32) / v_scale
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + v_offset + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_cuda(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_size
    # rows of key/value must be contiguous (a column slice of a fused qkv projection is fine)
    key = key if key.stride(2) == 1 and key.stride(1) == head_size else key.contiguous()
    value = value if value.stride(2) == 1 and value.stride(1) == head_size else value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), value.stride(0), kv_cache.stride(0),
        k_scale, v_scale,
        ROW=row, BLOCK=triton.next_power_of_2(row), SCALE=kv_cache.dtype.itemsize == 1,
    )
