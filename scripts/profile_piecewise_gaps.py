"""Where the piecewise 8B steps' wall time goes beyond their kernels (issue 14's <= 1.10x goal).

The quick runner of `piecewise_bench` (the 8B shape, the buckets its steps take, no decode
graph): its bench rows for the mixed and prefill steps, then per step a `torch.profiler` trace
(CPU and CUDA) of synced piecewise calls, each on a build of its own, reduced by
`compiled_attn.bench.gaps` to the GPU's idle time: lead, tail, and the gaps between device events
keyed by their sides, with the part the host was late for.

    python scripts/profile_piecewise_gaps.py [--backend FLASHINFER] [--steps 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import compiled_attn as ca
from compiled_attn.bench import gaps
from compiled_attn.bench.piecewise_bench import STEPS, calls_per_path, fresh_metadata, setup_8b, step_rows, step_tokens
from compiled_attn.bench.report import print_table
from compiled_attn.bench.timing import card_name

ITERS = 20


def traced_steps(fn, steps: int) -> list[dict]:
    """The chrome-trace events of `steps` synced calls of `fn`, each in a record_function range."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
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
    args = parser.parse_args()
    config, spec, make_runner = setup_8b(args.backend, quick=True)
    backend = ca.get_attn_backend(args.backend)
    runner = make_runner()
    runner.capture()
    rows, texts = [], [f"card: {card_name()}, backend {args.backend}"]
    for what, seq_lens, query_lens in STEPS:
        ids, pos = step_tokens(spec, seq_lens, query_lens, config.vocab_size)
        mds = fresh_metadata(backend, spec, seq_lens, query_lens, 1 + 2 * calls_per_path(ITERS))
        rows += step_rows(runner, args.backend, what, mds, ids, pos, ITERS)
        served = fresh_metadata(backend, spec, seq_lens, query_lens, 1 + args.steps)
        table = gaps.gap_table(traced_steps(lambda s=served, i=ids, p=pos: runner.run(s(), i, p), args.steps))
        texts.append(gaps.markdown(table, f"piecewise, {what}"))
    print_table(rows)
    text = "\n\n".join(texts)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "piecewise-gaps.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
