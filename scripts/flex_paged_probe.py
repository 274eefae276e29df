"""Gate for a TORCH_SDPA decode that reads the paged cache in place: FlexAttention's decode kernel
(`torch.compile`d `flex_attention`, a block mask over the block tables) against SDPA over a
contiguous cache, in replayed CUDA graphs. Issue 13's TORCH_SDPA goal (0.85x the gpt-fast loop)
leaves about 150 us a layer at B=64 ctx 1024 on an H100; the gather-then-SDPA op takes ~360.

    python scripts/flex_paged_probe.py [--out DIR]

Shapes: Llama-3-8B's attention (32 q / 8 kv heads, head 128, bf16); every request at `ctx` -
PARTIAL tokens over shuffled pages (a partial last page; bandwidth counted at `ctx`). Rows: us
per call, the fraction of nominal HBM bandwidth reading K/V once takes, the largest error
against a float64 reference on two requests, and the seconds of the first call (flex's compile
for that shape: what a graph's warm-up pays per size). Every slot no request holds is NaN: a
kernel that weighted one would fail the error check. Then the kernels of one call at B=1 and
B=64 (ctx 1024, page 16) from a profiled graph replay (`flex-profile.md` under --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from compiled_attn.bench.kernel_table import cuda_kernels, markdown, per_layer_table
from compiled_attn.bench.timing import calls_graph, card_name, graph_time_us, nominal_bandwidth
from compiled_attn.ops.flex_decode import paged_block_mask, paged_decode

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
POINTS = ((1, 1024), (8, 1024), (64, 1024), (256, 1024), (64, 4096))
PAGES = (16, 64)
# flex's split of each request's pages over CTAs, tried at page 16 besides its default (one split
# once batch * kv heads reaches the SM count; no gain from num_warps/num_stages, 2026-11-26)
SPLITS = (2, 4, 8)
# Each request's last page is this many slots short of full, the slots NaN (never to be read)
PARTIAL = 3
MAX_ERROR = 2e-2  # bf16 output against the float64 reference
GATE_US = 150.0  # a layer's attention that keeps the 8B loop at 0.85x the peer (H100, B=64 ctx 1024)


def paged_case(batch: int, ctx: int, page: int, device: str, dtype: torch.dtype, heads=(NUM_HEADS, NUM_KV_HEADS),
               head_size: int = HEAD_SIZE, lens: list[int] | None = None):
    """A cache [2, blocks, page, kv_heads, d] (one spare block per request), shuffled block tables
    [batch, ctx / page], the lengths (`lens`, default ctx each), and the query [batch, heads, d].
    Every slot no request holds is NaN: spare blocks and the table's slots past each length."""
    hq, hkv = heads
    width = -(-ctx // page)
    blocks = batch * width + batch
    cache = torch.randn(2, blocks, page, hkv, head_size, device=device, dtype=dtype)
    perm = torch.randperm(blocks, device=device)
    tables = perm[: batch * width].view(batch, width).to(torch.int32)
    cache[:, perm[batch * width :]] = float("nan")
    seq_lens = torch.tensor(lens or [ctx] * batch, dtype=torch.int32, device=device)
    slots = (tables.long()[:, :, None] * page + torch.arange(page, device=device)).view(batch, -1)
    unwritten = slots[torch.arange(width * page, device=device) >= seq_lens.view(batch, 1).long()]
    cache.view(2, blocks * page, hkv, head_size)[:, unwritten] = float("nan")
    q = torch.randn(batch, hq, head_size, device=device, dtype=dtype)
    return cache, tables, seq_lens, q


def flex_decode(cache, tables, seq_lens, q, kernel_options: dict | None = None) -> Callable[[], torch.Tensor]:
    """TORCH_SDPA's flex decode (`ops/flex_decode.py`) of one step, its mask made once as a
    forward makes it. Returns [batch, heads, d]."""
    mask = paged_block_mask(tables, seq_lens, cache.shape[2], cache.shape[1])
    return lambda: paged_decode(q, cache, mask, q.shape[-1] ** -0.5, kernel_options)


def max_error(out: torch.Tensor, cache, tables, seq_lens, q, rows=(0, -1)) -> float:
    """Largest |out - float64 reference| over `rows` (out: [batch, heads, d])."""
    page, group = cache.shape[2], q.shape[1] // cache.shape[3]
    worst = 0.0
    for i in rows:
        n = int(seq_lens[i])
        pages = tables[i, : -(-n // page)].long()
        k, v = (cache[j][pages].flatten(0, 1)[:n].double().repeat_interleave(group, 1) for j in (0, 1))
        scores = torch.einsum("hd,khd->hk", q[i].double(), k) * q.shape[-1] ** -0.5
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
        err = (out[i].double() - ref).abs().max().item()
        worst = max(worst, err if err == err else math.inf)  # NaN: max() would keep the old value
    return worst


def contiguous_sdpa(batch: int, ctx: int, q: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The peer's attention: SDPA over a static contiguous cache [batch, kv_heads, ctx, d]."""
    k = torch.randn(batch, NUM_KV_HEADS, ctx, HEAD_SIZE, dtype=q.dtype, device=q.device)
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)
    return lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def gpu_rows(quick: bool = False) -> list[dict]:
    """Every point, page and SPLIT_KV option; `quick`: the split_kv rule at page 16 only."""
    peak, rows = nominal_bandwidth(), []

    def add(impl: str, batch: int, ctx: int, page: int | None, us: float, err: float | None = None,
            compile_s: float | None = None) -> None:
        kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * 2
        rows.append({"card": card_name(), "impl": impl, "batch": batch, "ctx": ctx, "page": page, "us": round(us, 2),
                     "hbm_frac": round(kv_bytes / (us * 1e-6) / peak, 3) if peak else None,
                     "max_err": None if err is None else round(err, 5),
                     "first_call_s": None if compile_s is None else round(compile_s, 2)})
        print(rows[-1], flush=True)

    for batch, ctx in POINTS:
        for page in (16,) if quick else PAGES:
            case = paged_case(batch, ctx, page, "cuda", torch.bfloat16, lens=[ctx - PARTIAL] * batch)
            options = [None] + ([{"SPLIT_KV": n} for n in SPLITS] if page == 16 and not quick else [])
            for opts in options:
                fn = flex_decode(*case, kernel_options=opts)
                start = time.perf_counter()
                out = fn()  # a new shape or option set: flex's Inductor compile
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
                err = max_error(out, *case)
                if err > MAX_ERROR:
                    raise SystemExit(f"flex at {batch}x{ctx} page {page} ({opts}) is off the reference by {err}")
                add(f"flex {opts or 'split_kv rule'}", batch, ctx, page, graph_time_us(fn), err, compile_s)
            del case
            torch.cuda.empty_cache()
        q = torch.randn(batch, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
        add("sdpa, contiguous cache", batch, ctx, None, graph_time_us(contiguous_sdpa(batch, ctx, q)))
        torch.cuda.empty_cache()
    gate = next(r["us"] for r in rows
                if r["impl"] == "flex split_kv rule" and (r["batch"], r["ctx"], r["page"]) == (64, 1024, 16))
    verdict = "met" if gate <= GATE_US else "missed"
    print(f"gate (flex split_kv rule, 64x1024, page 16, <= {GATE_US} us): {gate} us, {verdict}", flush=True)
    return rows


def kernel_profile(batch: int, ctx: int, page: int = 16, calls: int = 10, replays: int = 5) -> str:
    """The kernels of one NaN-safe flex decode (flex, the last page's attention, the merge), from
    a torch.profiler trace of a replayed graph of `calls` calls: a markdown table per call."""
    case = paged_case(batch, ctx, page, "cuda", torch.bfloat16, lens=[ctx - PARTIAL] * batch)
    graph = calls_graph(flex_decode(*case), calls)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    table = per_layer_table(cuda_kernels(prof), steps=calls * replays, num_layers=1)
    return markdown(table, f"{card_name()}, flex decode {batch}x{ctx}, page {page}: kernels per call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="no SPLIT_KV sweep, page 16 only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flex_paged_probe: FlexAttention's paged decode runs on CUDA only")
    rows = gpu_rows(args.quick)
    if args.out:  # the timings first: a failed profile keeps them
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "flex-paged-probe.json"), "w") as f:
            json.dump({"card": card_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    profiles = "\n\n".join(kernel_profile(batch, 1024) for batch in (1, 64))
    print(profiles, flush=True)
    if args.out:
        with open(os.path.join(args.out, "flex-profile.md"), "w") as f:
            f.write(profiles + "\n")


if __name__ == "__main__":
    main()
