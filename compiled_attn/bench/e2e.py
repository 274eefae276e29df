"""End-to-end decode of a Llama-3-8B-shaped model: ours eager / compiled / compiled+graphs, and
the gpt-fast-style peer (the decode loop's `GptFastDecoder`: static contiguous cache, SDPA,
`mode="reduce-overhead"`; compiled here without the loop's coordinate-descent tuning).

MBU (model bandwidth utilisation) = (weight bytes + KV bytes read per step) / step time /
nominal HBM bandwidth; tokens/s = batch / step time. Weights are random: speed does not care.

    python -m compiled_attn.bench.e2e [--quick] [--block-size 16] [--point 64x1024 ...]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch

import compiled_attn as ca
from compiled_attn.bench.decode_loop import GptFastDecoder
from compiled_attn.bench.models import shared_model
from compiled_attn.bench.report import print_table
from compiled_attn.bench.timing import card_name, nominal_bandwidth
from compiled_attn.cli import backend_name, point, positive_int
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.models.llama import Llama, LlamaConfig, allocate_kv_caches

BLOCK_SIZE = 16
GRID = tuple((b, c) for c in (1024, 4096) for b in (1, 8, 64))
# Batch 1 and 64 at ctx 1024, without this suite's peer: the decode loop's faithful (tuned) peer
# is measured at these two points in the same run, and each peer point costs an 8B compile.
QUICK_POINTS = ((1, 1024), (64, 1024))


def step_seconds(step, iters: int = 20) -> float:
    """Median seconds of `step()` over `iters` runs, events around each (after 3 warm-ups)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def decode_inputs(config: LlamaConfig, backend, batch: int, ctx: int, dtype: torch.dtype, block_size: int):
    """A decode step of `batch` requests with `ctx` cached tokens each, caches of random values."""
    blocks = -(-(ctx + 1) // block_size)
    spec = config.attention_spec(block_size=block_size, num_blocks=batch * blocks, dtype=dtype, device="cuda",
                                 max_seq_len_to_capture=ctx + 1)
    caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    md = backend.get_builder_cls()(spec).build([ctx + 1] * batch, [1] * batch, tables)
    ids = torch.randint(config.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), ctx, device="cuda")
    return spec, caches, md, ids, pos


def measure_point(model: Llama, compiled, backend, batch: int, ctx: int, weight_bytes: int, block_size: int,
                  with_peer: bool = True) -> dict:
    """One (batch, ctx) point: ours eager / compiled / compiled+graphs, then (with_peer) the gpt-fast peer."""
    config = model.config
    kv_bytes = 2 * batch * ctx * config.num_layers * config.num_kv_heads * config.head_size * 2
    bw = nominal_bandwidth() or float("nan")
    row = {"card": card_name(), "backend": backend.get_name(), "batch": batch, "ctx": ctx, "page": block_size}

    def record(label: str, seconds: float) -> None:
        row[f"{label} ms"] = seconds * 1e3
        row[f"{label} tok/s"] = batch / seconds
        row[f"{label} MBU"] = (weight_bytes + kv_bytes) / seconds / bw

    spec, caches, md, ids, pos = decode_inputs(config, backend, batch, ctx, model.embed.weight.dtype, block_size)
    ca.mark_token_dim(ids, pos)
    for label, fn, iters in (("eager", model, 5), ("compiled", compiled, 20)):
        def step(fn=fn) -> None:
            with ca.set_forward_context(md):
                fn(ids, pos, caches)
        with ca.floats_as_constants():  # the compiled model's first call traces (the eager one's: no effect)
            step()
        record(label, step_seconds(step, iters))
    runner = CUDAGraphRunner(compiled, backend, spec, caches, max_batch_size=batch, capture_sizes=[batch],
                             progress=False)
    runner.capture()
    record("graphs", step_seconds(lambda: runner.run(md, ids, pos)))
    if not with_peer:
        return row
    runner = caches = None  # free the paged caches before the peer allocates its own
    torch.cuda.empty_cache()
    # dynamic=False: a static graph per point, as gpt-fast's one batch size per process (Dynamo's
    # automatic dynamic shapes would otherwise make the second point's batch symbolic)
    peer = torch.compile(GptFastDecoder(model, batch, ctx + 16), mode="reduce-overhead", fullgraph=True,
                         dynamic=False)
    input_pos = torch.tensor([ctx], device="cuda")
    peer_ids = ids.clone().view(batch, 1)  # a fresh tensor: `ids` carries our unbacked-size marks, the peer is static
    record("gpt-fast", step_seconds(lambda: peer(peer_ids, input_pos)))
    row["graphs / gpt-fast speed"] = row["gpt-fast ms"] / row["graphs ms"]
    return row


def run(quick: bool = False, backend_name: str | None = None, block_size: int = BLOCK_SIZE,
        points: Sequence[tuple[int, int]] | None = None) -> list[dict]:
    """One row per (batch, ctx) point; `points` replaces the default grid (GRID, quick: QUICK_POINTS,
    without the peer's columns)."""
    config = LlamaConfig.llama3_8b()
    if points is None:
        points = QUICK_POINTS if quick else GRID
    probe = config.attention_spec(block_size=block_size, num_blocks=1, dtype=torch.bfloat16, device="cuda")
    backend = ca.get_attn_backend(backend_name, probe)
    model = shared_model(config, backend.get_name())  # the decode loop and piecewise suites time it too
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    rows = []
    for batch, ctx in points:
        rows.append(measure_point(model, compiled, backend, batch, ctx, weight_bytes, block_size, with_peer=not quick))
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", type=backend_name, default=None)
    parser.add_argument("--block-size", type=positive_int, default=BLOCK_SIZE, help="KV-cache page size (tokens)")
    parser.add_argument("--point", type=point, action="append", metavar="BxCTX", help="e.g. 64x1024 (repeatable)")
    args = parser.parse_args(argv)
    print_table(run(args.quick, args.backend, args.block_size, args.point))


if __name__ == "__main__":
    main()
