"""Split-KV paged decode in Triton: one query token per request, GQA groups read their KV head once.

A CUDA graph fixes the launch grid, so the split count is chosen per captured batch size (enough
programs to fill the card twice over) and each program takes its share of the request's live
tiles at run time: a replay reads what is live, never the capture's maximum. Programs past the
end of a request write an empty partial (lse -inf) that the merge weighs at zero.

    grid (batch, kv_heads, splits): q rows of the group [BLOCK_H, D] against BLOCK_N cache rows
    at a time, gathered through the block table; online softmax in fp32, exp2 domain. An fp8
    cache is read as stored and widened to the query's dtype (exact for e4m3 and e5m2), its
    k_scale folded into the score scale and its v_scale into the output's normalization. With
    `fp16_mma` (`_pairs_kernel`, sm89 and later) an fp8 cache is read two bytes at a time, the
    head dimension's even and odd elements widened to fp16 apart (exact, `cvt` in registers)
    for two products each, and both products run in fp16: each query row is scaled into fp16's
    range by a power of two (exact for entries within 2^28 of the row's largest; folded back
    into the score scale) and the probabilities are rounded to fp16 (11 bits, where bf16 has 8).
    Triton's own widening reads the tile back from shared memory byte by byte
    (`scripts/triton_decode_ptx.py`).
    merge (batch, heads): the splits' partial outputs weighed by their log-sum-exp.

One split writes the output directly (no partials, no merge launch).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # widened exactly to 16 bits
FP16_MMA_CAPABILITY = (8, 9)  # `fp16_mma`'s cvt.rn.f16x2.{e4m3,e5m2}x2


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of one captured batch size: splits per (request, KV head), tile, warps, stages,
    and how an fp8 cache is read."""

    num_splits: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    fp16_mma: bool = False  # fp8 caches only: byte pairs widened to fp16 in registers, fp16 products


# `prmt` selectors gathering two uint16 fp8 pairs' low bytes (element 2j of the head dimension) or
# high bytes (element 2j + 1) into one 16-bit half for `cvt`
EVEN: tl.constexpr = tl.constexpr("0x0020")
ODD: tl.constexpr = tl.constexpr("0x0031")


@triton.jit
def _widen_half(pairs, BYTES: tl.constexpr, E5M2: tl.constexpr):
    """uint16 fp8 pairs -> fp16 of their EVEN or ODD elements, exact: a `prmt` and one
    `cvt.rn.f16x2.{e4m3,e5m2}x2` for two pairs. One input and one output, so Triton widens in the
    MMA operand's own layout (see `_pairs_kernel`)."""
    if E5M2:
        cvt: tl.constexpr = tl.constexpr("cvt.rn.f16x2.e5m2x2")
    else:
        cvt: tl.constexpr = tl.constexpr("cvt.rn.f16x2.e4m3x2")
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $1, 0, " + BYTES + "; mov.b32 {lo, hi}, t; " + cvt + " $0, lo; }",
        "=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _split_span(lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr):
    """The tokens [start, end) of the request `seq` that split `split` of `num_splits` reads: an
    equal share of its live tiles (none past its end)."""
    seq_len = tl.load(lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    return start, tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)


@triton.jit
def _tile_rows(tok0, end, table, kv_head, kv_stride_blk, kv_stride_tok, kv_stride_h,
               PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache rows (element offsets) of tokens tok0 .. tok0 + BLOCK_N through the block table,
    and which of them are live (< end)."""
    tok = tok0 + tl.arange(0, BLOCK_N)
    live = tok < end
    block = tl.load(table + tok // PAGE, mask=live, other=0)
    return block.to(tl.int64) * kv_stride_blk + (tok % PAGE) * kv_stride_tok + kv_head * kv_stride_h, live


@triton.jit
def _softmax_step(s, live, m, lsum):
    """One tile of the online softmax (exp2 domain): its probabilities, the factor that rescales
    what came before, and the running max and sum."""
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, lsum * alpha + tl.sum(p, 1)


@triton.jit
def _finish(acc, m, lsum, v_scale, seq, split, num_splits, heads, h_mask, out_ptr, part_ptr, lse_ptr,
            out_stride_t, out_stride_h, GROUP: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr):
    """Normalize and store a program's [BLOCK_H, D] rows: the output itself with one split, else
    the split's partial and its log-sum-exp (a split with no tokens: zeros, lse -inf)."""
    d = tl.arange(0, D)
    safe = tl.where(lsum > 0.0, lsum, 1.0)
    acc = acc * (v_scale / safe)[:, None]
    if DIRECT:
        dst = out_ptr + seq.to(tl.int64) * out_stride_t + heads[:, None] * out_stride_h + d[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        row_id = (seq.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [B, H, S]
        tl.store(part_ptr + row_id[:, None] * D + d[None, :], acc, mask=h_mask[:, None])
        tl.store(lse_ptr + row_id, m + tl.log2(lsum), mask=h_mask)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    q_stride_t, q_stride_h, kv_stride_blk, kv_stride_tok, kv_stride_h, table_stride,
    out_stride_t, out_stride_h, qk_scale, v_scale,
    num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_span(lens_ptr, seq, split, num_splits, BLOCK_N)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + h
    h_mask = h < GROUP
    q = tl.load(q_ptr + seq.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=h_mask[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    table = table_ptr + seq.to(tl.int64) * table_stride
    for tok0 in range(start, end, BLOCK_N):
        row, live = _tile_rows(tok0, end, table, kv_head, kv_stride_blk, kv_stride_tok, kv_stride_h, PAGE, BLOCK_N)
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        p, alpha, m, lsum = _softmax_step(s, live, m, lsum)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    _finish(acc, m, lsum, v_scale, seq, split, num_splits, heads, h_mask, out_ptr, part_ptr, lse_ptr,
            out_stride_t, out_stride_h, GROUP, D, DIRECT)


@triton.jit
def _pairs_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    q_stride_t, q_stride_h, kv_stride_blk, kv_stride_tok, kv_stride_h, table_stride,
    out_stride_t, out_stride_h, qk_scale, v_scale,
    num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, E5M2: tl.constexpr,
):
    """`_split_kernel` over an fp8 cache read as uint16 byte pairs (`fp16_mma`), with fp16
    products split by the parity of the head dimension: q K^T = q_even K_even^T + q_odd K_odd^T,
    and P V = [P V_even, P V_odd] interleaved at the end. Each half is an elementwise function of
    the pair tile, so Triton moves the widening after the tile's load from shared memory into
    the MMA operand's layout (ldmatrix of 16-bit pairs): no round trip of the widened fp16 tile
    through shared memory, which held this kernel at about 55 % of the HBM bandwidth."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_span(lens_ptr, seq, split, num_splits, BLOCK_N)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    j = tl.arange(0, D // 2)
    heads = kv_head * GROUP + h
    h_mask = h < GROUP
    q = tl.load(q_ptr + seq.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=h_mask[:, None], other=0.0).to(tl.float32)
    # fp16 products: each query row times 2^-shift, its largest entry in [2^13, 2^14]
    largest = tl.max(tl.abs(q), 1)
    shift = tl.where(largest > 0.0, tl.ceil(tl.log2(largest)) - 14.0, 0.0)
    q_even, q_odd = tl.split(tl.reshape((q * tl.exp2(-shift)[:, None]).to(tl.float16), [BLOCK_H, D // 2, 2]))
    row_scale = qk_scale * tl.exp2(shift)  # [BLOCK_H]: the shift folded back into the scores
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc_even = tl.zeros([BLOCK_H, D // 2], tl.float32)
    acc_odd = tl.zeros([BLOCK_H, D // 2], tl.float32)
    table = table_ptr + seq.to(tl.int64) * table_stride
    k_pairs = k_ptr.to(tl.pointer_type(tl.uint16))
    v_pairs = v_ptr.to(tl.pointer_type(tl.uint16))
    for tok0 in range(start, end, BLOCK_N):
        row, live = _tile_rows(tok0, end, table, kv_head, kv_stride_blk, kv_stride_tok, kv_stride_h, PAGE, BLOCK_N)
        pair = (row // 2)[:, None] + j[None, :]
        k = tl.trans(tl.load(k_pairs + pair, mask=live[:, None], other=0))  # [D // 2, BLOCK_N]
        s = tl.dot(q_odd, _widen_half(k, ODD, E5M2), tl.dot(q_even, _widen_half(k, EVEN, E5M2))) * row_scale[:, None]
        p, alpha, m, lsum = _softmax_step(s, live, m, lsum)
        p = p.to(tl.float16)  # 11 bits, where bf16 has 8
        v = tl.load(v_pairs + pair, mask=live[:, None], other=0)
        acc_even = tl.dot(p, _widen_half(v, EVEN, E5M2), acc_even * alpha[:, None])
        acc_odd = tl.dot(p, _widen_half(v, ODD, E5M2), acc_odd * alpha[:, None])
    _finish(tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_H, D]), m, lsum, v_scale, seq, split, num_splits, heads,
            h_mask, out_ptr, part_ptr, lse_ptr, out_stride_t, out_stride_h, GROUP, D, DIRECT)


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, out_ptr, out_stride_t, out_stride_h, num_splits,
    D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    first = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    s_mask = s < num_splits
    lse = tl.load(lse_ptr + first + s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(s_mask & (lse > float("-inf")), w, 0.0)
    part = tl.load(part_ptr + (first + s)[:, None] * D + d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # no live token: zeros, as one split
    tl.store(out_ptr + seq.to(tl.int64) * out_stride_t + head * out_stride_h + d, o.to(out_ptr.dtype.element_ty))


def default_config(batch_size: int, num_kv_heads: int, device: torch.device, *,
                   fp8_cache: bool = False) -> DecodeConfig:
    """Splits enough for two programs per SM over the graph's (request, KV head) pairs (at most
    32); tiles of 128 tokens between 3 and 31 splits, else 64; 4 warps, 3 stages. The fastest of
    the 27 launch shapes timed on an H200 (`decode_flashinfer --triton-sweep`: splits x {1/2, 1,
    2}, tiles {32, 64, 128}, warps/stages {4/2, 4/3, 8/3}) at B=8 and B=64 (ctx 1024 and 4096) and
    at B=256 ctx 1024; 0.4 / 0.7 us from it at B=1 (ctx 1024 / 4096), 2.5 us at B=256 ctx 4096.
    Other batch sizes were not timed (32 q / 8 kv heads). An `fp8_cache` is read by `fp16_mma`
    (`_pairs_kernel`) where the card has sm89's conversions: 161.3 us at B=64 ctx 4096 (e4m3,
    H200, this launch shape; 212.3 when the widened tile went through shared memory, 293.9 for
    Triton's own widening). fp8 keeps the bf16 rule: within 8 % of the best of the 27 shapes at
    each point from B=8 up, 0.2 / 0.8 us from it at B=1 (`--sweep-caches fp8`, twenty-fifth
    session).
    Products transposed (K q^T, V^T P: the cache
    tile as the MMAs' rows, Hopper's warpgroup MMA) were slower at each of the 9 points timed (1.6
    to 17 %) and are gone."""
    props = torch.cuda.get_device_properties(device)
    splits = max(1, min(32, math.ceil(2 * props.multi_processor_count / (batch_size * num_kv_heads))))
    return DecodeConfig(num_splits=splits, block_n=128 if 2 < splits < 32 else 64, num_stages=3,
                        fp16_mma=fp8_cache and (props.major, props.minor) >= FP16_MMA_CAPABILITY)


class PagedDecode:
    """One batch size's decode: the split buffers it owns and its launch, over any cache of the
    shape it was made for. Capturable once it has run (Triton compiles at the first launch): two
    launches (one without splits), no allocation."""

    def __init__(self, batch_size: int, num_heads: int, head_size: int, config: DecodeConfig,
                 device: torch.device | str) -> None:
        if head_size < 16 or head_size & (head_size - 1):
            raise ValueError(f"the Triton decode takes a power-of-two head size >= 16, not {head_size}")
        if config.fp16_mma and head_size < 32:
            raise ValueError(f"fp16_mma splits the head dimension into even and odd halves, each the depth of an MMA "
                             f"(>= 16): head sizes >= 32, not {head_size} (DecodeConfig(fp16_mma=False) reads an fp8 "
                             "cache widened to the queries' dtype)")
        self.config = config
        self._rows = (batch_size, num_heads, head_size)
        self._launched = False
        shape = (batch_size, num_heads, config.num_splits)
        direct = config.num_splits == 1
        self._lse = None if direct else torch.empty(shape, dtype=torch.float32, device=device)
        self._partials = None if direct else torch.empty(*shape, head_size, dtype=torch.float32, device=device)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, scale: float, k_scale: float = 1.0,
            v_scale: float = 1.0) -> None:
        """q/out [batch, num_heads, head_size] (head_size contiguous); caches [num_blocks, page,
        num_kv_heads, head_size] with equal strides, of q's dtype or fp8 (storing K / k_scale and
        V / v_scale); block_tables int32 [batch, >= pages]; seq_lens int32 [batch] (a row of
        length 0 gets zeros)."""
        self._check(q, k_cache, v_cache, out)
        if not self._launched and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the Triton decode compiles at its first launch: run it once before capturing it")
        batch, num_heads, head_size = q.shape
        page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        cfg = self.config
        direct = cfg.num_splits == 1
        pairs = self._pairs(k_cache)
        kernel = _pairs_kernel if pairs else _split_kernel
        fp8_format = {"E5M2": k_cache.dtype == torch.float8_e5m2} if pairs else {}
        kernel[(batch, num_kv_heads, cfg.num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out,
            out if direct else self._partials, out if direct else self._lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1), scale * k_scale * LOG2E, v_scale, cfg.num_splits,
            GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=head_size, PAGE=page,
            BLOCK_N=cfg.block_n, DIRECT=direct, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **fp8_format,
        )
        if not direct:
            _merge_kernel[(batch, num_heads)](
                self._partials, self._lse, out, out.stride(0), out.stride(1), cfg.num_splits,
                D=head_size, BLOCK_S=triton.next_power_of_2(cfg.num_splits), num_warps=4,
            )
        self._launched = True

    def _pairs(self, k_cache: torch.Tensor) -> bool:
        """Whether this launch widens fp8 byte pairs to fp16 (`fp16_mma` over an fp8 cache)."""
        return self.config.fp16_mma and k_cache.dtype in FP8_CACHE_DTYPES

    def _check(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
        """What the kernel's addressing assumes (it runs at warm-up and capture, not per replay)."""
        batch, num_heads, head_size = self._rows
        if q.shape != out.shape or q.shape[0] > batch or q.shape[1:] != (num_heads, head_size):
            raise ValueError(f"query {tuple(q.shape)} / output {tuple(out.shape)}: this decode was made for "
                             f"up to {batch} rows of {num_heads} heads x {head_size}")
        if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.shape[3] != head_size:
            raise ValueError("the key and value caches must be [num_blocks, page, num_kv_heads, head_size] "
                             "views of one layout")
        if k_cache.dtype not in (q.dtype, *FP8_CACHE_DTYPES) or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"{k_cache.dtype} / {v_cache.dtype} caches for {q.dtype} queries: both hold the "
                             "queries' dtype or one fp8 format")
        if num_heads % k_cache.shape[2]:
            raise ValueError(f"{num_heads} query heads are not a multiple of {k_cache.shape[2]} KV heads")
        if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1:
            raise ValueError("query, output and caches need a contiguous head dimension")
        if self._pairs(k_cache):
            if any(n % 2 for n in (*k_cache.stride()[:3], k_cache.data_ptr(), v_cache.data_ptr())):
                raise ValueError("fp16_mma reads an fp8 cache two bytes at a time: its strides and start must be even")
            if not q.is_cuda or torch.cuda.get_device_capability(q.device) < FP16_MMA_CAPABILITY:
                raise ValueError(f"fp16_mma widens fp8 pairs with sm89's cvt: a CUDA device of compute capability "
                                 f">= 8.9, not {q.device}")
