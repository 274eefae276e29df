"""Where `builder.build()`'s host time goes on a decode step (8B attention spec, page 16, array
tables, as the decode loop builds; on CUDA a synchronize after each, as the loop's synced
column): the median per build, alone (what a step replayed as a graph pays: its device fields
are never read) and with the upload an eager step's first op makes (`md.upload_pending()`),
then a cProfile of the builds with the upload.

    python scripts/build_host_profile.py [--backend FLASHINFER] [--point 1x1024 --point 64x1024]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

import compiled_attn as ca
from compiled_attn.models.llama import LlamaConfig
from compiled_attn.registry import BACKEND_CLASSES


def build_times(backend: type[ca.AttentionBackend], batch: int, ctx: int, builds: int,
                upload: bool = True) -> list[float]:
    """Seconds per `build()` (and its upload) of `builds` decode steps of `batch` requests from
    `ctx` + 1 tokens on."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pages = -(-(ctx + builds + 1) // 16)
    spec = LlamaConfig.llama3_8b().attention_spec(block_size=16, num_blocks=batch * pages, dtype=torch.bfloat16,
                                                  device=device, max_seq_len_to_capture=ctx + builds + 1)
    builder = backend.get_builder_cls()(spec)
    tables = np.random.default_rng(0).permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    query_lens = np.ones(batch, dtype=np.int64)
    times = []
    for i in range(builds):
        t = time.perf_counter()
        md = builder.build(np.full(batch, ctx + 1 + i), query_lens, tables)
        if upload:
            md.upload_pending()
        times.append(time.perf_counter() - t)
        if device == "cuda":
            torch.cuda.synchronize()
    return times


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
        build_times(backend, batch, ctx, args.builds)  # warm-up: first allocations, imports
        alone, uploaded = (np.median(build_times(backend, batch, ctx, args.builds, upload)) * 1e6
                           for upload in (False, True))
        print(f"{args.backend} {point}: build median {alone:.1f} us, with the upload {uploaded:.1f} us", flush=True)
        profiler = cProfile.Profile()
        profiler.runcall(build_times, backend, batch, ctx, args.builds)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
