"""XFORMERS decode and prefill: our op in a replayed CUDA graph vs xFormers called directly.

Decode: B in {1, 16, 64, 256} x context {512, 4096, 16384}, 32 query / 8 KV heads, head 128,
bf16, page 64. "ours" is `compiled_attn::xformers_attention` (bias from the builder, metadata
from the forward context); "direct" is `memory_efficient_attention_forward` with the same bias
and `op=triton_splitk.FwOp`; "gathered" is the alternative for pages that triton cannot read
(copy each request's keys into a padded layout, `BlockDiagonalCausalWithOffsetPaddedKeysMask`).
Bandwidth: K and V bytes read / time, as a fraction of the card's nominal HBM bandwidth.
Prefill: tokens/s at 8 x 2048 prompts (fresh) and 8 x (1024 cached + 1024 new) (chunked).
"""

from __future__ import annotations

import torch

from compiled_attn.abstract import AttentionSpec, AttentionType
from compiled_attn.backends.xformers import XFormersBackend
from compiled_attn.bench.timing import card_name, eager_time_us, graph_time_us, nominal_bandwidth
from compiled_attn.forward_context import set_forward_context
from compiled_attn.ops import xformers as xops

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 64
DTYPE = torch.bfloat16


def _spec(num_blocks: int) -> AttentionSpec:
    return AttentionSpec(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                         block_size=BLOCK_SIZE, num_blocks=num_blocks, dtype=DTYPE, device="cuda")


def _paged_step(seq_lens: list[int], query_lens: list[int]):
    """A cache with distinct random blocks per request and its metadata (bias included)."""
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    spec = _spec(sum(need))
    perm = torch.randperm(sum(need)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    kv_cache = torch.randn(2, spec.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    md = XFormersBackend.get_builder_cls()(spec).build(seq_lens, query_lens, tables)
    return spec, kv_cache, md


def _direct(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, scale: float) -> torch.Tensor:
    """The public API; where its op check refuses (C++ extension not loadable), the op's apply."""
    f = xops.fmha()
    try:
        return f.memory_efficient_attention_forward(q5, k, v, attn_bias=bias, scale=scale, op=f.triton_splitk.FwOp)
    except ValueError:
        inp = f.Inputs(query=q5, key=k, value=v, attn_bias=bias, scale=scale)
        return f.triton_splitk.FwOp.apply(inp, needs_gradient=False)[0]


def _gathered(q5, kv_cache, md, scale: float):
    """Decode over keys copied into a padded layout: what a non-paged kernel would need per layer."""
    f = xops.fmha()
    b = md.num_decodes
    pad = md.block_tables.shape[1] * BLOCK_SIZE
    bias = f.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        q_seqlen=[1] * b, kv_padding=pad, kv_seqlen=md.seq_lens, device=q5.device
    )
    hpg = NUM_HEADS // NUM_KV_HEADS

    def step() -> torch.Tensor:
        k = kv_cache[0][md.block_tables].view(1, b * pad, NUM_KV_HEADS, HEAD_SIZE)
        v = kv_cache[1][md.block_tables].view(1, b * pad, NUM_KV_HEADS, HEAD_SIZE)
        return xops.run_xformers(q5, xops.expanded(k[0], hpg), xops.expanded(v[0], hpg), bias, scale, ("splitk",))

    return step


def decode_rows(batch: int, ctx: int, *, replays: int, with_gathered: bool) -> list[dict]:
    spec, kv_cache, md = _paged_step([ctx] * batch, [1] * batch)
    scale = spec.softmax_scale
    q = torch.randn(batch, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    q5 = xops.grouped(q, NUM_KV_HEADS)
    k, v = xops.paged_kv(kv_cache, NUM_HEADS // NUM_KV_HEADS)
    bias = md.biases["decode"]
    bw = nominal_bandwidth()
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * DTYPE.itemsize

    impl = XFormersBackend.get_impl_cls()(NUM_HEADS, HEAD_SIZE, scale, num_kv_heads=NUM_KV_HEADS)
    layer_name, _call = impl.register(1.0, 1.0, AttentionType.DECODER)  # _call keeps the name alive

    def ours() -> None:
        XFormersBackend.attention_op(q, None, None, kv_cache, out, layer_name)

    variants = {"ours": ours, "direct": lambda: _direct(q5, k, v, bias, scale)}
    if with_gathered:
        variants["gathered"] = _gathered(q5, kv_cache, md, scale)
    rows = []
    with set_forward_context(md):
        for name, fn in variants.items():
            us = graph_time_us(fn, replays=replays)
            rows.append({"suite": "decode_xformers", "variant": name, "batch": batch, "ctx": ctx,
                         "time_us": round(us, 2), "GB/s": round(kv_bytes / us / 1e3, 1),
                         "hbm_frac": round(kv_bytes / (us * 1e-6) / bw, 3) if bw else None, "card": card_name()})
    return rows


def prefill_rows(num_prompts: int, prompt_len: int, cached: int) -> dict:
    seq_lens = [prompt_len] * num_prompts
    query_lens = [prompt_len - cached] * num_prompts
    spec, kv_cache, md = _paged_step(seq_lens, query_lens)
    impl = XFormersBackend.get_impl_cls()(NUM_HEADS, HEAD_SIZE, spec.softmax_scale, num_kv_heads=NUM_KV_HEADS)
    tokens = sum(query_lens)
    q = torch.randn(tokens, NUM_HEADS * HEAD_SIZE, dtype=DTYPE, device="cuda")
    k = torch.randn(tokens, NUM_KV_HEADS * HEAD_SIZE, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    us = eager_time_us(lambda: impl.forward(q, k, v, kv_cache, md), iters=20)
    return {"suite": "prefill_xformers", "variant": "cached" if cached else "fresh", "batch": num_prompts,
            "ctx": prompt_len, "new_tokens": tokens, "time_us": round(us, 1),
            "tokens/s": round(tokens / (us * 1e-6)), "card": card_name()}


def run(quick: bool) -> list[dict]:
    """Every row of the suite (quick: fewer replays, the gathered variant at two shapes only)."""
    replays = 20 if quick else 50
    rows = []
    for batch in (1, 16, 64, 256):
        for ctx in (512, 4096, 16384):
            gathered = ctx == 4096 and (batch in (16, 64) or not quick)
            rows += decode_rows(batch, ctx, replays=replays, with_gathered=gathered)
    rows.append(prefill_rows(8, 2048, 0))
    rows.append(prefill_rows(8, 2048, 1024))
    return rows


if __name__ == "__main__":
    import json
    import sys

    for row in run(quick="--quick" in sys.argv):
        sys.stdout.write(json.dumps(row) + "\n")
