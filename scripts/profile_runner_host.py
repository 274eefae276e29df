"""Where a served step's host time goes (its `build()`, then `CUDAGraphRunner.run`): the bench's
16-layer model (ctx 512), one runner per backend with decode graphs at batch 1 and 64 and the
piecewise graphs of buckets 1 and 320. Every timed call builds its step first.

    python scripts/profile_runner_host.py [--backend FLASHINFER ...] [--steps 300] [--out DIR]

Per backend and path ("full B": the decode graph of batch B; "forced 1": a batch-1 decode
forced through the piecewise graphs, issue 14's <= 1.5x goal; "mixed": 63 decodes at the
context and a 256-token prompt chunk, 319 tokens in bucket 320, by default one prefill on
FLASHINFER; its "mixed, split": that step with COMPILED_ATTN_FLASHINFER_MIXED=split): the
synced step time, the pipelined time per step (no sync: above the synced figure means the host is the bottleneck),
the forced path's host time per call (from its start on an idle GPU to its return: queued
behind other work, its plan would wait on the fence of the plan two calls before), and a
cProfile of pipelined calls (top functions by own time, then by cumulative time). Everything
is printed and written to DIR/runner-host.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from collections.abc import Callable

import torch

import compiled_attn as ca
from compiled_attn.bench import graphs_bench
from compiled_attn.bench.piecewise_bench import step_builds, step_tokens
from compiled_attn.bench.timing import card_name, eager_time_us
from compiled_attn.capabilities import smallest_block_size
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.models.llama import allocate_kv_caches, build_model

# the mixed step: 63 decodes and a 256-token chunk of a prompt whose first 256 tokens are cached
MIXED_CHUNK, MIXED_BUCKET = 256, 320


def pipelined_us(fn: Callable[[], object], steps: int) -> float:
    """Wall microseconds per call of `steps` calls in a row, one synchronize at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def profile_text(fn: Callable[[], object], steps: int) -> str:
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(25)
    return text.getvalue()


def backend_report(name: str, steps: int) -> list[str]:
    config, ctx = graphs_bench.CONFIG, graphs_bench.CONTEXT
    backend = ca.get_attn_backend(name)
    block_size = smallest_block_size(backend)
    spec = config.attention_spec(block_size=block_size, num_blocks=64 * (-(-ctx // block_size) + 1),
                                 dtype=torch.bfloat16, device="cuda",
                                 max_seq_len_to_capture=graphs_bench.MAX_SEQ_LEN_TO_CAPTURE)
    model = build_model(config, seed=0, backend=name, dtype=torch.bfloat16, device="cuda", init_device="cuda")
    caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
    runner = CUDAGraphRunner(model, backend, spec, caches, compile=True, capture_sizes=[1, 64], max_batch_size=64,
                             piecewise=True, piecewise_sizes=[1, MIXED_BUCKET], progress=False)
    runner.capture()
    paths: dict[str, Callable[[], object]] = {}
    # each call builds its step first (timed with it: the host work of a served step): FlashInfer
    # plans, and a step uploads, once per metadata object (piecewise_bench.step_builds)
    for batch in (1, 64):
        ids, pos = step_tokens(spec, [ctx] * batch, [1] * batch, config.vocab_size)
        build = step_builds(backend, spec, [ctx] * batch, [1] * batch)
        paths[f"full {batch}"] = lambda b=build, ids=ids, pos=pos: runner.run(b(), ids, pos)
    ids, pos = step_tokens(spec, [ctx], [1], config.vocab_size)
    forced = step_builds(backend, spec, [ctx], [1])
    paths["forced 1"] = lambda: runner.piecewise.run(forced(), ids, pos)
    seq_lens, query_lens = [ctx] + [ctx] * 63, [MIXED_CHUNK] + [1] * 63
    ids_m, pos_m = step_tokens(spec, seq_lens, query_lens, config.vocab_size)
    mixed = step_builds(backend, spec, seq_lens, query_lens)
    paths["mixed"] = lambda: runner.run(mixed(), ids_m, pos_m)
    if name == "FLASHINFER":  # the same step split between the prefill and decode wrappers
        split = step_builds(backend, spec, seq_lens, query_lens, mixed="split")
        paths["mixed, split"] = lambda: runner.run(split(), ids_m, pos_m)
    lines = []
    for path, fn in paths.items():
        # host time of a call on an idle GPU (a busy one would hold the plan's fence, `_Slot.plan`)
        alone = eager_time_us(fn, iters=100, launch_only=True) if path.startswith(("forced", "mixed")) else None
        host = "" if alone is None else f", host alone {alone:.0f} us"
        lines.append(f"{card_name()}, {name}, {config.num_layers} layers, ctx {ctx}, {path}: "
                     f"synced {eager_time_us(fn, iters=100):.0f} us, pipelined {pipelined_us(fn, steps):.0f} us{host} "
                     "per step")
    for path in ("full 64", "forced 1", *(p for p in paths if p.startswith("mixed"))):
        lines.append(f"-- {name}, {path}: cProfile of {steps} pipelined calls --\n{profile_text(paths[path], steps)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    lines = []
    for name in args.backend or ["FLASHINFER"]:
        lines += backend_report(name, args.steps)
        torch._dynamo.reset()
    report = "\n".join(lines)
    print(report)
    with open(os.path.join(args.out, "runner-host.txt"), "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
