"""Where `builder.build()`'s host time goes on a decode step (8B attention spec, page 16, array
tables, as the decode loop builds; on CUDA a synchronize after each, as the loop's synced
column): the medians of `build()` alone (what a step replayed as a graph pays: it never reads
the device fields) and of the upload an eager step's first op then makes
(`md.upload_pending()`), both timed on the same builds, and of the positions' copy the loop
makes beside them; then a cProfile of builds and uploads.

--after-wait-ms W (CUDA; repeatable): each step first waits W ms for the GPU (a sleep kernel,
then the synchronize), as the loop's synced steps wait for the previous replay. The same host
work then takes longer the longer the wait (twice as long after 6 ms on an H100's host in the
thirty-first session), which is why the loop's synced host columns exceed this script's.

    python scripts/build_host_profile.py [--backend FLASHINFER] [--point 1x1024 --point 64x1024]
                                         [--after-wait-ms 0 --after-wait-ms 6]
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


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of `torch.cuda._sleep` per ms, timed once with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def timed_steps(build: Callable[[int], ca.AttentionMetadata], steps: int,
                wait_cycles: int = 0) -> dict[str, list[float]]:
    """Seconds of each step's `build()`, its upload and the positions' copy (the loop's), each
    step after a GPU wait of `wait_cycles` (none: after a synchronize that finds nothing queued)."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    times: dict[str, list[float]] = {"build": [], "upload": [], "positions' copy": []}
    for i in range(steps):
        if wait_cycles:
            torch.cuda._sleep(wait_cycles)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        md = build(i)
        t1 = time.perf_counter()
        md.upload_pending()
        t2 = time.perf_counter()
        torch.from_numpy(np.full(md.num_seqs, 1024, dtype=np.int64)).to(device, non_blocking=True)
        t3 = time.perf_counter()
        for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[name].append(seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="FLASHINFER")
    parser.add_argument("--point", action="append", help="BxCTX (default 1x1024 and 64x1024)")
    parser.add_argument("--builds", type=int, default=300)
    parser.add_argument("--after-wait-ms", type=float, action="append",
                        help="GPU wait before each step, ms (CUDA; default 0: none)")
    args = parser.parse_args()
    waits = args.after_wait_ms or [0.0]
    if any(waits) and not torch.cuda.is_available():
        parser.error("--after-wait-ms needs CUDA (the wait is a GPU sleep kernel)")
    cycles_per_ms = sleep_cycles_per_ms() if any(waits) else 0.0
    # on CPU: the CUDA backends' host logic (their kernels are not called here)
    backend = ca.get_attn_backend(args.backend) if torch.cuda.is_available() else BACKEND_CLASSES()[args.backend]
    for point in args.point or ["1x1024", "64x1024"]:
        batch, ctx = map(int, point.split("x"))
        build = step_builder(backend, batch, ctx, (len(waits) + 2) * args.builds)
        timed_steps(build, args.builds)  # warm-up: first allocations, the builder's kept block check
        for k, wait in enumerate(waits, start=1):
            times = timed_steps(lambda i, k=k, build=build: build(k * args.builds + i), args.builds,
                                int(wait * cycles_per_ms))
            medians = ", ".join(f"{name} {np.median(t) * 1e6:.1f} us" for name, t in times.items())
            print(f"{args.backend} {point}, after a {wait:g} ms GPU wait: medians {medians}", flush=True)
        profiler = cProfile.Profile()
        profiler.runcall(timed_steps, lambda i, build=build: build((len(waits) + 1) * args.builds + i), args.builds)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
