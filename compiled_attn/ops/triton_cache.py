"""The CUDA cache write: one Triton program per token, pads (slot -1) return at once.

A pure-torch write would need either a device sync (to drop the pads) or several small
kernels per layer; at batch 1 those launches cost more than the write itself.

Launched as compiled after its first call. Triton's `kernel[grid](...)` binds, specialises and
keys every argument on each call, which took more host time than the launch itself (an H100
profile of a decode forced through the piecewise graphs: 340 against 72 ms over 4800 calls,
BENCHMARKS.md, twenty-third session). So Triton specialises nothing here (no value or alignment
facts of the arguments; the integers fixed at int64, the scales at fp32), and the one fact that
matters, whether every row starts on a 16-byte boundary (then the loads and stores are 16 bytes
wide), is ours to compute: the constexpr ALIGNED. A kernel compiled for (device, dtypes, row
size, ALIGNED) is then valid for every call that has them, and is launched as compiled
(`CompiledKernel[grid]`): 33-37 us less host time a layer in that forced decode on an H200
(twenty-fourth session).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_RUNTIME_INTS = ["key_stride", "value_stride", "v_offset"]
_POINTERS = ["key_ptr", "value_ptr", "cache_ptr", "slot_ptr"]


@triton.jit(do_not_specialize=_RUNTIME_INTS, do_not_specialize_on_alignment=_POINTERS)
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    key_stride: tl.int64, value_stride: tl.int64, v_offset: tl.int64, k_scale: tl.float32, v_scale: tl.float32,
    ROW: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr, ALIGNED: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    dst = slot.to(tl.int64) * ROW + offs  # int64: caches may exceed 2**31 elements
    k_src = key_ptr + token.to(tl.int64) * key_stride + offs
    v_src = value_ptr + token.to(tl.int64) * value_stride + offs
    k_dst = cache_ptr + dst
    v_dst = cache_ptr + v_offset + dst
    if ALIGNED:  # each row's first element on a 16-byte boundary: vector loads and stores
        k_src, v_src = tl.multiple_of(k_src, 16), tl.multiple_of(v_src, 16)
        k_dst, v_dst = tl.multiple_of(k_dst, 16), tl.multiple_of(v_dst, 16)
    k = tl.load(k_src, mask=mask)
    v = tl.load(v_src, mask=mask)
    if SCALE:
        k = k.to(tl.float32) / k_scale
        v = v.to(tl.float32) / v_scale
    tl.store(k_dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


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
    key, value = _rows_contiguous(key, head_size), _rows_contiguous(value, head_size)
    row = num_kv_heads * head_size
    args = (key, value, kv_cache, slot_mapping, key.stride(0), value.stride(0), kv_cache.stride(0),
            float(k_scale), float(v_scale))
    aligned = rows_aligned(key, value, kv_cache, row)
    signature = (key.device, key.dtype, value.dtype, kv_cache.dtype, slot_mapping.dtype, row, aligned)
    compiled = _compiled.get(signature)
    if compiled is not None:
        kernel, constants = compiled
        kernel[(num_tokens, 1, 1)](*args, *constants)
        return
    constants = (row, triton.next_power_of_2(row), kv_cache.dtype.itemsize == 1, aligned)  # the constexprs
    kernel = _write_kv_kernel[(num_tokens,)](*args, *constants)
    if kernel is not None:  # None under TRITON_INTERPRET=1, which runs the kernel as Python every call
        _compiled[signature] = kernel, constants


def rows_aligned(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, row: int) -> bool:
    """Whether every row the kernel reads or writes starts on a 16-byte boundary: the tensors'
    starts, their row strides and the cache's row size, in bytes (their OR is a multiple of 16
    exactly when each is)."""
    cache_item = kv_cache.element_size()
    starts = key.data_ptr() | value.data_ptr() | kv_cache.data_ptr()
    steps = (key.stride(0) * key.element_size() | value.stride(0) * value.element_size()
             | kv_cache.stride(0) * cache_item | row * cache_item)
    return (starts | steps) % 16 == 0


def _rows_contiguous(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """`x` if each token's row is contiguous (a column slice of a fused qkv projection is), else a copy."""
    stride = x.stride()
    return x if stride[2] == 1 and stride[1] == head_size else x.contiguous()


# (device, key / value / cache / slot dtypes, row size, aligned) -> the kernel compiled for them, its constexprs
_compiled: dict[tuple, tuple[Any, tuple[int, int, bool, bool]]] = {}
