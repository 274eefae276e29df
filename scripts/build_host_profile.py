"""Where `builder.build()`'s host time goes on a decode step (8B attention spec, page 16, array
tables, as the decode loop builds; on CUDA a synchronize after each, as the loop's synced
column): the medians of `build()` alone (what a step replayed as a graph pays: it never reads
the device fields) and of the upload an eager step's first op then makes
(`md.upload_pending()`), both timed on the same builds; then a cProfile of builds and uploads.

    python scripts/build_host_profile.py [--backend FLASHINFER] [--point 1x1024 --point 64x1024]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable

import numpy as np
import torch

import compiled_attn as ca
from compiled_attn.models.llama import LlamaConfig
from compiled_attn.registry import BACKEND_CLASSES


def step_builder(backend: type[ca.AttentionBackend], batch: int, ctx: int,
                 steps: int) -> Callable[[int], ca.AttentionMetadata]:
    """`build(i)`: the decode step of `batch` requests at `ctx` + 1 + i tokens, from one builder
    (as a loop's), over `steps` steps' worth of blocks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pages = -(-(ctx + steps + 1) // 16)
    spec = LlamaConfig.llama3_8b().attention_spec(block_size=16, num_blocks=batch * pages, dtype=torch.bfloat16,
                                                  device=device, max_seq_len_to_capture=ctx + steps + 1)
    builder = backend.get_builder_cls()(spec)
    tables = np.random.default_rng(0).permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    query_lens = np.ones(batch, dtype=np.int64)
    return lambda i: builder.build(np.full(batch, ctx + 1 + i), query_lens, tables)


def timed_steps(build: Callable[[int], ca.AttentionMetadata], steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each step's `build()` and of its upload."""
    builds, uploads = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        md = build(i)
        t1 = time.perf_counter()
        md.upload_pending()
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        uploads.append(t2 - t1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return builds, uploads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="FLASHINFER")
    parser.add_argument("--point", action="append", help="BxCTX (default 1x1024 and 64x1024)")
    parser.add_argument("--builds", type=int, default=300)
    args = parser.parse_args()
    # on CPU: the CUDA backends' host logic (their kernels are not called here)
    backend = ca.get_attn_backend(args.backend) if torch.cuda.is_available() else BACKEND_CLASSES()[args.backend]
    for point in args.point or ["1x1024", "64x1024"]:
        batch, ctx = map(int, point.split("x"))
        build = step_builder(backend, batch, ctx, 3 * args.builds)
        timed_steps(build, args.builds)  # warm-up: first allocations, the builder's kept block check
        builds, uploads = timed_steps(lambda i, build=build: build(args.builds + i), args.builds)
        print(f"{args.backend} {point}: build median {np.median(builds) * 1e6:.1f} us, its upload "
              f"{np.median(uploads) * 1e6:.1f} us", flush=True)
        profiler = cProfile.Profile()
        profiler.runcall(timed_steps, lambda i, build=build: build(2 * args.builds + i), args.builds)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
