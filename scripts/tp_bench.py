"""Decode tokens/s of the Llama-3-8B-shaped model (bf16, random weights) at TP=1 and TP=2:
the compiled model's captured CUDA graphs (all-reduces inside) at batch 1 and 64, 1024 cached
tokens per request. Rank 0's step time is the step time (every rank runs the same graph).

    python scripts/tp_bench.py --tp 1 2 --batch 1 64 --out $OUT     # writes tp-bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import compiled_attn as ca
from compiled_attn import distributed
from compiled_attn.bench.report import print_table
from compiled_attn.cli import output_dir, positive_int
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.models import tp as tpm
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model

BLOCK_SIZE = 16


def bench_rank(group: dist.ProcessGroup, device: torch.device, batches: list[int], ctx: int, compile_model: bool,
               iters: int) -> list[dict]:
    config = LlamaConfig.llama3_8b()
    tp = tpm.layout_of(group)
    blocks = -(-(ctx + 1) // BLOCK_SIZE)
    spec = config.attention_spec(block_size=BLOCK_SIZE, num_blocks=max(batches) * blocks, dtype=torch.bfloat16,
                                 device=device, tp_size=tp.size, max_seq_len_to_capture=ctx + 1)
    backend = ca.get_attn_backend(None, spec)
    t0 = time.perf_counter()
    model = build_model(config, seed=0, backend=backend.get_name(), dtype=torch.bfloat16, device=device,
                        tp_group=group, init_device=device)  # seconds, not minutes, for 8B
    init_s = time.perf_counter() - t0
    step = torch.compile(model, fullgraph=True, dynamic=True) if compile_model else model
    caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
    builder = backend.get_builder_cls()(spec)
    runner = CUDAGraphRunner(step, backend, spec, caches, capture_sizes=batches, max_batch_size=max(batches),
                             progress=False)
    stats = distributed.capture_sharded(runner, group)
    rows = []
    for batch in batches:
        tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
        md = builder.build([ctx + 1] * batch, [1] * batch, tables)
        ids = torch.randint(config.vocab_size, (batch,), device=device)
        pos = torch.full((batch,), ctx, device=device)
        for _ in range(3):
            runner.run(md, ids, pos)
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            dist.barrier(group)  # start together: a rank waiting in the all-reduce would time the others
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.run(md, ids, pos)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        seconds = statistics.median(times)
        rows.append({
            "card": torch.cuda.get_device_name(device), "tp": tp.size, "backend": backend.get_name(),
            "compiled": compile_model, "batch": batch, "ctx": ctx, "step ms": seconds * 1e3,
            "tok/s": batch / seconds, "capture s": stats["seconds"], "init s": init_s,
            "weights GiB/rank": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 64])
    parser.add_argument("--ctx", type=positive_int, default=1024)
    parser.add_argument("--iters", type=positive_int, default=30)
    parser.add_argument("--eager-model", action="store_true", help="capture the eager model instead of the compiled")
    parser.add_argument("--out", type=output_dir, default=".")
    args = parser.parse_args(argv)
    rows = []
    for tp_size in args.tp:
        batches = sorted(set(args.batch), reverse=True)
        rows += distributed.run_ranks(bench_rank, tp_size, batches, args.ctx, not args.eager_model, args.iters,
                                      device_type="cuda")[0]
        print_table(rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "tp-bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
