"""Where the piecewise 8B steps' wall time goes beyond their kernels (issue 14's <= 1.10x goal).

The quick runner of `piecewise_bench` (the 8B shape, the buckets its steps take, no decode
graph): its bench rows for the mixed and prefill steps, then per step a `torch.profiler` trace
(CPU and CUDA) of synced piecewise steps, each building its metadata then calling the runner, reduced by
`compiled_attn.bench.gaps` to the GPU's idle time: lead, tail, and the gaps between device events
keyed by their sides, with the part the host was late for.

    python scripts/profile_piecewise_gaps.py [--backend FLASHINFER] [--steps 5] [--out DIR] [--stacks]
        [--model 16-layer]

--stacks adds, for one step traced with Python stacks, the functions the host ran during each
gap; --model 16-layer takes the mixed step (at ctx 512) on the bench's 16-layer model instead,
whose capture is quicker (and whose step is host-bound: its layers are short).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import compiled_attn as ca
from compiled_attn.bench import gaps, graphs_bench
from compiled_attn.bench.piecewise_bench import STEPS, setup_8b, step_builds, step_rows, step_tokens
from compiled_attn.bench.report import print_table
from compiled_attn.bench.timing import card_name
from compiled_attn.capabilities import smallest_block_size
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.models.llama import allocate_kv_caches, build_model

ITERS = 20


def traced_steps(fn, steps: int, with_stack: bool = False) -> list[dict]:
    """The chrome-trace events of `steps` synced calls of `fn`, each in a record_function range."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
        for i in range(steps):
            with record_function(f"step {i}"):
                fn()
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="FLASHINFER")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--stacks", action="store_true", help="also trace with Python stacks: who held each gap")
    parser.add_argument("--model", choices=("8B", "16-layer"), default="8B",
                        help="16-layer: the mixed step only on the bench's 16-layer model (a quicker capture)")
    args = parser.parse_args()
    backend = ca.get_attn_backend(args.backend)
    if args.model == "8B":
        config, spec, make_runner = setup_8b(args.backend, quick=True)
        runner, steps = make_runner(), STEPS
    else:
        config, ctx = graphs_bench.CONFIG, graphs_bench.CONTEXT
        spec = config.attention_spec(block_size=smallest_block_size(backend), num_blocks=64 * (ctx + 1),
                                     dtype=torch.bfloat16, device="cuda", max_seq_len_to_capture=2048)
        model = build_model(config, seed=0, backend=args.backend, dtype=torch.bfloat16, device="cuda",
                            init_device="cuda")
        caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
        runner = CUDAGraphRunner(model, backend, spec, caches, compile=True, capture_sizes=[], piecewise=True,
                                 piecewise_sizes=[320], progress=False)
        steps = [(f"mixed: 63 decodes at ctx {ctx} + a 256-token prompt chunk", [ctx] * 64, [256] + [1] * 63)]
    runner.capture()
    rows, texts = [], [f"card: {card_name()}, backend {args.backend}, {args.model} model"]
    for what, seq_lens, query_lens in steps:
        ids, pos = step_tokens(spec, seq_lens, query_lens, config.vocab_size)
        build = step_builds(backend, spec, seq_lens, query_lens)
        rows += step_rows(runner, args.backend, what, build, ids, pos, ITERS, model=args.model)
        # each call on a build made inside its step's range (what a synced serving loop runs)
        def served(b=build, i=ids, p=pos) -> torch.Tensor:
            return runner.run(b(), i, p)

        table = gaps.gap_table(traced_steps(served, args.steps))
        texts.append(gaps.markdown(table, f"piecewise, build + run, {what}"))
        if args.stacks:
            events = traced_steps(served, 2, with_stack=True)
            texts.append("host during the gaps of a step traced with stacks:\n" +
                         "\n".join(gaps.host_during_gaps(events, step=1)))
    print_table(rows)
    text = "\n\n".join(texts)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "piecewise-gaps.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
