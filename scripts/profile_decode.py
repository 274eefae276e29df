"""Attribution of the decode loop: a `torch.profiler` trace of pipelined decode steps of ours and
of the gpt-fast peer, reduced to per-layer kernel tables (markdown + JSON under --out).

    python scripts/profile_decode.py --point 1x1024 --point 64x1024 [--backend FLASHINFER]
        [--variant compile|dynamic|feedback] [--no-peer] [--peer-sdpa dispatch|math] [--ab-option KEY=VALUE ...]
        --out DIR

The peer runs PyTorch's SDPA dispatch by default, its faster choice at every point measured
(gpt-fast pins the math kernel: `--peer-sdpa math`; BENCHMARKS.md, thirty-third session).
Each side runs PROFILED_STEPS steps as in the bench's loop (no synchronize inside) after a
warm-up; the trace's kernels give the per-layer table and the GPU-busy fraction of the steps.
Before the trace each side's loop is timed as in the bench (`decode_loop.loop_times`).
`--ab-option` (Inductor options, e.g. combo_kernels=True) runs each variant of ours twice in the
process: as the runner compiles it (`runner.COMPILE_OPTIONS`), then with those options added.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from compiled_attn.bench import decode_loop as dl
from compiled_attn.bench.compiles import reset_dynamo
from compiled_attn.bench.kernel_table import cuda_kernels, markdown, per_layer_table
from compiled_attn.bench.timing import card_name
from compiled_attn.cli import inductor_option, point
from compiled_attn.graphs import runner

PROFILED_STEPS = 8


def trace(loop) -> dict:
    """The per-layer table of PROFILED_STEPS pipelined steps, plus the loop's ms / step
    (pipelined and synced, timed without the profiler) and the GPU-busy fraction of the loop's
    step: the trace's kernel time per step over the pipelined step timed without the profiler,
    whose CPU-side tracing slows the host and so can open gaps the loop itself does not have (the
    table's own "gpu busy" is over the profiled span)."""
    pipelined, synced = dl.loop_times(loop)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loop(PROFILED_STEPS, False)
        torch.cuda.synchronize()
    table = per_layer_table(cuda_kernels(prof), PROFILED_STEPS, dl.LlamaConfig.llama3_8b().num_layers)
    return {"loop ms/step": pipelined, "loop ms/step synced": synced,
            "gpu busy in the loop": table["kernel us/step"] / (pipelined * 1e3), **table}


def host_profile(ours: dl.PagedLoop, path: str, steps: int = 50) -> None:
    """cProfile of `steps` synced steps of ours (build + run), the top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    ours.host_us(steps)
    profiler.disable()
    with open(path, "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", type=point, action="append", required=True, metavar="BxCTX")
    parser.add_argument("--backend", default="FLASHINFER")
    parser.add_argument("--variant", action="append", choices=("compile", "dynamic", "feedback"), default=None)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--peer-sdpa", choices=tuple(dl.PEER_SDPA), default=dl.FASTER_PEER_SDPA)
    parser.add_argument("--ab-option", type=inductor_option, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model = dl.build_8b(args.backend)
    backend = model.layers[0].attn.backend
    results = {"card": card_name()}
    for batch, ctx in args.point:
        sides = {}
        if not args.no_peer:
            with dl.peer_compiling():
                loop = dl.peer_loop(model, batch, ctx, args.peer_sdpa)
                sides[f"peer (gpt-fast, {args.peer_sdpa} SDPA)"] = trace(loop)
                del loop
        options = dict(args.ab_option)
        for variant in args.variant or ("compile",):
            for extra in ({}, options) if options else ({},):
                label = variant + "".join(f", {k}={v}" for k, v in extra.items())
                if options:
                    reset_dynamo()  # each side its own trace and compile
                with mock.patch.dict(runner.COMPILE_OPTIONS, extra):
                    ours = dl.paged_loop(model, batch, ctx, variant)
                side = f"ours {backend.get_name()} ({label})"
                host = ours.host_us()  # before the trace: launches timed after the profiler read several times slower
                sides[side] = {**trace(ours.loop), **host}
                host_profile(ours, os.path.join(args.out, f"host-profile-{batch}x{ctx}-{variant}{len(extra)}.txt"))
                del ours
        torch.cuda.empty_cache()
        for side, table in sides.items():
            text = markdown(table, f"{side}, B={batch}, ctx {ctx}, {card_name()}: loop {table['loop ms/step']:.3f} "
                                   f"ms/step pipelined (GPU busy {table['gpu busy in the loop']:.1%} of the step), "
                                   f"{table['loop ms/step synced']:.3f} synced"
                                   + (f"; host per synced step: build {table['build us']:.0f} us, run "
                                      f"{table['run us']:.0f} us of which the graph launch "
                                      f"{table['replay us']:.0f} us" if "build us" in table else ""))
            print(text, "\n", flush=True)
            results[f"{side} {batch}x{ctx}"] = table
            with open(os.path.join(args.out, "decode-profile.md"), "a") as f:
                f.write(text + "\n\n")
        with open(os.path.join(args.out, "decode-profile.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
