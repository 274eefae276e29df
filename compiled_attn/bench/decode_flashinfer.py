"""Decode attention: our FLASHINFER op in a replayed CUDA graph vs FlashInfer called directly vs SDPA.

Shapes: 32 query / 8 KV heads, head_size 128, bf16, block_size 16; every request holds `ctx`
tokens. Each row reports the median time of one decode step (us) and the fraction of the card's
nominal HBM bandwidth that reading the K/V cache once would take in that time. Our graphs decode
through our Triton kernel where the backend picks it (`graph_decode_kernel`; `--variants` times it
beside FlashInfer's and cuDNN's kernels, `--triton-sweep` its launch shapes, with e4m3 caches too).
A page-size sweep (our op only, pages 16 / 32 / 64 / 128) follows at the end-to-end bench's batch
8 / 64, ctx 1024.

    python -m compiled_attn.bench.decode_flashinfer [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import unittest.mock
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import compiled_attn as ca
from compiled_attn.backends.flashinfer import (
    GRAPH_DECODE_ENV,
    FlashInferBackend,
    cudnn_decode_available,
    plan_options,
)
from compiled_attn.bench.timing import card_name, graph_time_us, nominal_bandwidth

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 16384)
SWEEP_PAGES, SWEEP_POINTS = (16, 32, 64, 128), ((8, 1024), (64, 1024))
# FlashInfer's decode kernels and plan options measured against each other at the decode
# loop's points (`variants` table): the data behind the backend's choice per batch size.
VARIANT_POINTS = tuple((b, c) for c in (1024, 4096) for b in (1, 8, 64, 256))
# ... and with e4m3 caches in `--variants`, where the fp8 decode loop runs (bf16 queries)
FP8_VARIANT_POINTS = ((64, 4096),)
XQA_WORKSPACE_BYTES = 64 << 20  # its semaphores (8 MB, zeroed before first use) and scratch


def _spec(batch: int, ctx: int, block_size: int) -> ca.AttentionSpec:
    return ca.AttentionSpec(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=block_size,
        num_blocks=batch * ctx // block_size + 1, dtype=torch.bfloat16, device="cuda",
        max_seq_len_to_capture=ctx,
    )


def _our_op(spec: ca.AttentionSpec, md, q, kv_cache, out, graph_decode: str | None = None) -> Callable[[], None]:
    """Our op over graph metadata of the State (planned for md), as a model step would run it;
    `graph_decode`: the State's kernel choice (default: GRAPH_DECODE_ENV's)."""
    with unittest.mock.patch.dict(os.environ, {GRAPH_DECODE_ENV: graph_decode} if graph_decode else {}):
        state = FlashInferBackend.get_state_cls()(spec)
    batch = q.shape[0]
    with state.graph_capture(batch):
        md_bs = state.graph_capture_get_metadata_for_batch(batch)
        bufs = state.get_graph_input_buffers(md_bs)
        graph_state = state.graph_clone(batch)
    graph_state.prepare_graph_input_buffers(bufs, md)
    graph_state.begin_forward(md)
    impl = FlashInferBackend.get_impl_cls()(NUM_HEADS, HEAD_SIZE, spec.softmax_scale, num_kv_heads=NUM_KV_HEADS,
                                            kv_cache_dtype=spec.kv_cache_dtype)
    name, layer = impl.register(1.0, 1.0, ca.AttentionType.DECODER)

    def step() -> None:
        with ca.set_forward_context(md_bs):
            FlashInferBackend.attention_op(q, None, None, kv_cache, out, name)

    step.keep_alive = (graph_state, layer)  # the graph wrapper, its buffers and the layer record
    return step


def _direct(spec: ca.AttentionSpec, md, q, kv_cache, out, tensor_cores: bool, backend: str = "auto",
            **plan_kw: object) -> Callable[[], object]:
    """FlashInfer's graph decode wrapper, same plan, no op boundary."""
    import flashinfer

    batch, dev = q.shape[0], q.device
    pages = md.paged_kv_indices.shape[0]
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores, backend=backend,
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.empty(pages, dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=dev),
    )
    wrapper.plan(
        md.paged_kv_indptr, md.paged_kv_indices, md.paged_kv_last_page_len, spec.num_heads,
        spec.num_kv_heads, spec.head_size, spec.block_size, **plan_options(spec), **plan_kw,
    )
    cache = (kv_cache[0], kv_cache[1])
    return lambda: wrapper.run(q, cache, out=out)


def _sdpa(batch: int, ctx: int, q: torch.Tensor) -> Callable[[], object]:
    """torch SDPA over a static contiguous cache [batch, kv_heads, ctx, head_size]."""
    k = torch.randn(batch, NUM_KV_HEADS, ctx, HEAD_SIZE, dtype=q.dtype, device=q.device)
    v = torch.randn_like(k)
    q4 = q.view(batch, NUM_HEADS, 1, HEAD_SIZE)
    return lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def _xqa(spec: ca.AttentionSpec, md, q, kv_cache, out) -> Callable[[], object]:
    """FlashInfer's XQA decode (TensorRT-LLM's kernels: sm90's fp8 one computes Q.K in fp8) over
    the same pages, as a [batch, pages] table: every request of a case holds ctx / block_size."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    batch = q.shape[0]
    table = md.paged_kv_indices.view(batch, -1)
    seq_lens = md.seq_lens_tensor.view(torch.uint32)  # lengths are positive: the same bits
    workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    cache, max_len = (kv_cache[0], kv_cache[1]), table.shape[1] * spec.block_size
    return lambda: xqa_batch_decode_with_kv_cache(q, cache, workspace, table, seq_lens, max_len,
                                                  bmm1_scale=spec.softmax_scale, out=out)


def _cudnn_own_table(spec: ca.AttentionSpec, md, q, kv_cache, out, widen: int = 1) -> Callable[[], object]:
    """cuDNN over the [batch, pages] table, its width `widen` times the context (what a graph
    captured for longer sequences holds: the extra columns are never read)."""
    table = md.paged_kv_indices.view(q.shape[0], -1)
    table = torch.cat([table, table.new_zeros(table.shape[0], (widen - 1) * table.shape[1])], dim=1)
    return _direct(spec, md, q, kv_cache, out, tensor_cores=True, backend="cudnn", block_tables=table)


def _triton(spec: ca.AttentionSpec, md, q, kv_cache, out, config=None) -> Callable[[], object]:
    """Our split-KV Triton decode (ops/triton_decode.py) over the [batch, pages] table, at
    `config` (default: what the graphs use, `default_config`)."""
    from compiled_attn.ops.triton_decode import PagedDecode, default_config

    batch = q.shape[0]
    table = md.paged_kv_indices.view(batch, -1)
    config = config or default_config(batch, NUM_KV_HEADS, q.device, fp8_cache=kv_cache.element_size() == 1)
    decode = PagedDecode(batch, NUM_HEADS, HEAD_SIZE, config, q.device)
    lens = md.seq_lens_tensor
    return lambda: decode.run(q, kv_cache[0], kv_cache[1], table, lens, out, spec.softmax_scale)


# The Triton kernel's launch shapes timed against each other (`triton_sweep_rows`): splits as a
# multiple of the default's, tile, warps, stages.
TRITON_SWEEP = tuple((mult, block_n, warps, stages) for mult in (0.5, 1, 2) for block_n in (32, 64, 128)
                     for warps, stages in ((4, 2), (4, 3), (8, 3)))


def triton_sweep_rows(replays: int = 20, on_row: Callable[[dict], None] = lambda row: None,
                      caches: Sequence[str] = ("auto", "fp8")) -> list[dict]:
    """Each TRITON_SWEEP launch shape at each VARIANT_POINT (page 16) for each of `caches` ("auto":
    the queries' bf16; "fp8": e4m3, read as `default_config` reads it), checked against torch's
    SDPA over the same pages gathered contiguous before it is timed. Beside them: cuDNN's paged
    decode (bf16), our op on FlashInfer's fp8 decode (GRAPH_DECODE_ENV=flashinfer)."""
    from compiled_attn.ops.triton_decode import DecodeConfig, default_config

    peak, rows = nominal_bandwidth(), []
    for kv_cache_dtype, (batch, ctx) in itertools.product(caches, VARIANT_POINTS):
        spec, md, kv_cache, q, out = _decode_case(batch, ctx, BLOCK_SIZE, kv_cache_dtype)
        cache_bytes = _cache_bytes(batch, ctx, kv_cache.element_size())
        suffix = "" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} cache"
        table = md.paged_kv_indices.view(batch, -1).long()
        # [B, kv_heads, ctx, D], widened to the query's dtype (exact for fp8: scales are 1 here)
        k, v = (kv_cache[i][table].flatten(1, 2).transpose(1, 2).to(q.dtype) for i in (0, 1))
        want = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)
        del k, v
        base = default_config(batch, NUM_KV_HEADS, q.device, fp8_cache=kv_cache_dtype != "auto")
        seen = set()
        for mult, block_n, warps, stages in TRITON_SWEEP:
            splits = max(1, min(64, round(base.num_splits * mult)))
            cfg = DecodeConfig(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
                               fp16_mma=base.fp16_mma)
            if cfg in seen:
                continue
            seen.add(cfg)
            name = f"triton s{splits} n{block_n} w{warps} st{stages}{' fp16' * cfg.fp16_mma}{suffix}"
            try:
                fn = _triton(spec, md, q, kv_cache, out, cfg)
                fn()
                err = (out.float() - want.float()).abs().max().item()
                row = _row("triton_sweep", name, batch, ctx, BLOCK_SIZE, graph_time_us(fn, replays=replays),
                           cache_bytes, peak)
                row["max_err"] = round(err, 4)
            except Exception as e:
                row = _error_row("triton_sweep", name, batch, ctx, BLOCK_SIZE, e)
            rows.append(row)
            on_row(row)
        if kv_cache_dtype != "auto":
            flashinfer_decode = functools.partial(_our_op, graph_decode="flashinfer")
            beside = ("ours (graph, FlashInfer's decode)" + suffix, flashinfer_decode)
        else:
            beside = ("cudnn", _cudnn_own_table) if cudnn_decode_available() else None
        if beside is not None:
            name, make = beside
            try:
                rows.append(_row("triton_sweep", name, batch, ctx, BLOCK_SIZE,
                                 graph_time_us(make(spec, md, q, kv_cache, out), replays=replays), cache_bytes, peak))
            except Exception as e:  # e.g. a GRAPH_DECODE setting that refuses this cache
                rows.append(_error_row("triton_sweep", name, batch, ctx, BLOCK_SIZE, e))
            on_row(rows[-1])
        del kv_cache
        torch.cuda.empty_cache()
    return rows


VARIANTS: dict[str, Callable[..., Callable[[], object]]] = {
    "triton": _triton,
    "tensor-core": functools.partial(_direct, tensor_cores=True),
    "tensor-core, no split-kv": functools.partial(_direct, tensor_cores=True, disable_split_kv=True),
    "cuda-core": functools.partial(_direct, tensor_cores=False),
    # sm90's FA3 kernels behind the same wrapper (a JIT build of a minute or more at first use)
    "tensor-core, fa3": functools.partial(_direct, tensor_cores=True, backend="fa3"),
    # its sources are not in the device's trimmed FlashInfer: scripts/gpu_check.sh adds them
    "xqa": _xqa,
    # cuDNN's paged SDPA graph (needs the cudnn-frontend package; without it FlashInfer fetches
    # prebuilt cubins over the network, which the device machine cannot reach): once with the
    # wrapper's own table (widened to 2048 tokens), once with the [batch, pages] table
    "cudnn": functools.partial(_direct, tensor_cores=True, backend="cudnn"),
    "cudnn, [batch, pages] table": _cudnn_own_table,
    "cudnn, table 8x the context": functools.partial(_cudnn_own_table, widen=8),
}
FP8_VARIANTS = ("tensor-core, no split-kv", "xqa", "triton")


def variant_rows(replays: int = 20, on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Each of VARIANTS at each of VARIANT_POINTS (page 16), plus SDPA over a contiguous cache,
    then FP8_VARIANTS with e4m3 caches at FP8_VARIANT_POINTS; a variant this FlashInfer build or
    machine lacks gets a row saying why. `on_row` sees each row as it is measured (a run cut
    short keeps what it printed)."""
    peak, rows = nominal_bandwidth(), []
    cases = [(batch, ctx, "auto", tuple(VARIANTS)) for batch, ctx in VARIANT_POINTS]
    cases += [(batch, ctx, "fp8", FP8_VARIANTS) for batch, ctx in FP8_VARIANT_POINTS]
    for batch, ctx, kv_cache_dtype, names in cases:
        spec, md, kv_cache, q, out = _decode_case(batch, ctx, BLOCK_SIZE, kv_cache_dtype)
        cache_bytes = _cache_bytes(batch, ctx, kv_cache.element_size())
        suffix = "" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} cache"
        for name in names:
            try:
                fn = VARIANTS[name](spec, md, q, kv_cache, out)
                rows.append(_row("decode_variants", name + suffix, batch, ctx, BLOCK_SIZE,
                                 graph_time_us(fn, replays=replays), cache_bytes, peak))
            except Exception as e:  # a backend this machine lacks (cuDNN frontend, ...) is a result too
                rows.append(_error_row("decode_variants", name + suffix, batch, ctx, BLOCK_SIZE, e))
            fn = None
            on_row(rows[-1])
        del kv_cache
        torch.cuda.empty_cache()
        if kv_cache_dtype == "auto":
            rows.append(_row("decode_variants", "torch sdpa", batch, ctx, None,
                             graph_time_us(_sdpa(batch, ctx, q), replays=replays), cache_bytes, peak))
            on_row(rows[-1])
            torch.cuda.empty_cache()
    return rows


def run(quick: bool) -> list[dict]:
    """One row per (implementation, batch, ctx[, page]): time in us and fraction of nominal HBM bandwidth."""
    replays = 10 if quick else 50
    rows = []
    for ctx in CONTEXTS:
        for batch in BATCHES:
            rows += _point_rows(batch, ctx, BLOCK_SIZE, replays, with_peers=True)
    for batch, ctx in SWEEP_POINTS:
        for block_size in SWEEP_PAGES:
            rows += _point_rows(batch, ctx, block_size, replays, with_peers=False)
    if not quick:
        rows += variant_rows()
    return rows


def _point_rows(batch: int, ctx: int, block_size: int, replays: int, with_peers: bool) -> list[dict]:
    """Our op (and with_peers: FlashInfer's own calls and SDPA) at one point, pages of block_size."""
    peak = nominal_bandwidth()
    spec, md, kv_cache, q, out = _decode_case(batch, ctx, block_size)
    cases = {"ours (graph)": _our_op(spec, md, q, kv_cache, out)}  # on Triton where `graph_decode_kernel` picks it
    if with_peers:
        cases["flashinfer cuda-core"] = _direct(spec, md, q, kv_cache, out, False)
        cases["flashinfer tensor-core"] = _direct(spec, md, q, kv_cache, out, True)
        if cudnn_decode_available():  # without it FlashInfer fetches cubins over the network
            cases["flashinfer cudnn"] = _cudnn_own_table(spec, md, q, kv_cache, out)
    del kv_cache  # the closures hold it; SDPA gets its own contiguous copy below
    cache_bytes = _cache_bytes(batch, ctx, spec.dtype.itemsize)
    suite = "decode_flashinfer" if with_peers else "page_sweep_flashinfer"
    rows = [_row(suite, impl, batch, ctx, block_size, graph_time_us(fn, replays=replays), cache_bytes, peak)
            for impl, fn in cases.items()]
    cases.clear()
    torch.cuda.empty_cache()
    if with_peers:
        rows.append(_row(suite, "torch sdpa", batch, ctx, None, graph_time_us(_sdpa(batch, ctx, q), replays=replays),
                         cache_bytes, peak))
        torch.cuda.empty_cache()
    return rows


def _decode_case(batch: int, ctx: int, block_size: int, kv_cache_dtype: str = "auto"):
    """A decode step of `batch` requests at `ctx` tokens over shuffled blocks: spec, metadata,
    a random cache (drawn in the spec's dtype, stored in its cache dtype), the query and an
    output buffer."""
    spec = dataclasses.replace(_spec(batch, ctx, block_size), kv_cache_dtype=kv_cache_dtype)
    blocks = ctx // block_size
    tables = torch.randperm(spec.num_blocks - 1)[: batch * blocks].add_(1).view(batch, blocks).tolist()
    md = FlashInferBackend.get_builder_cls()(spec).build([ctx] * batch, [1] * batch, tables)
    kv_cache = torch.randn(
        FlashInferBackend.get_kv_cache_shape(spec.num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE),
        dtype=spec.dtype, device="cuda",
    ).to(spec.cache_dtype)
    q = torch.randn(batch, NUM_HEADS, HEAD_SIZE, dtype=spec.dtype, device="cuda")
    return spec, md, kv_cache, q, torch.empty_like(q)


def _cache_bytes(batch: int, ctx: int, itemsize: int) -> int:
    """Bytes of K and V a decode step of `batch` requests at `ctx` tokens reads once."""
    return 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * itemsize


def _error_row(suite: str, impl: str, batch: int, ctx: int, page: int, e: Exception) -> dict:
    """The row of a variant this build or machine cannot run: why, in place of a time."""
    return {"suite": suite, "card": card_name(), "impl": impl, "batch": batch, "ctx": ctx, "page": page,
            "error": f"{type(e).__name__}: {str(e)[:120]}"}


def _row(suite: str, impl: str, batch: int, ctx: int, page: int | None, us: float, cache_bytes: int,
         peak: float | None) -> dict:
    frac = None if peak is None else cache_bytes / (us * 1e-6) / peak
    return {"suite": suite, "card": card_name(), "impl": impl, "batch": batch, "ctx": ctx,
            "page": page, "us": round(us, 2), "hbm_frac": None if frac is None else round(frac, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--variants", action="store_true", help="only the kernel / plan-option table")
    parser.add_argument("--triton-sweep", action="store_true", help="only the Triton kernel's launch shapes")
    parser.add_argument("--sweep-caches", nargs="+", choices=("auto", "fp8"), default=["auto", "fp8"],
                        help="the caches --triton-sweep times: the queries' dtype (auto), e4m3 (fp8)")
    args = parser.parse_args()
    print(f"{'impl':<26}{'batch':>6}{'ctx':>7}{'page':>5}{'us':>10}{'HBM frac':>10}  ({card_name()})", flush=True)
    if args.triton_sweep:
        triton_sweep_rows(on_row=_print_row, caches=args.sweep_caches)
    elif args.variants:
        variant_rows(on_row=_print_row)
    else:
        for r in run(args.quick):
            _print_row(r)


def _print_row(r: dict) -> None:
    head = f"{r['impl']:<26}{r['batch']:>6}{r['ctx']:>7}{r['page'] or '':>5}"
    if "error" in r:
        print(f"{head}  {r['error']}", flush=True)
    else:
        err = f"  max_err {r['max_err']}" if "max_err" in r else ""
        print(f"{head}{r['us']:>10.1f}{r['hbm_frac'] or 0:>10.3f}{err}", flush=True)


if __name__ == "__main__":
    main()
