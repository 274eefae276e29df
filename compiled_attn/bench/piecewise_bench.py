"""Piecewise CUDA graphs (issue 14): prefill and mixed steps through `CUDAGraphRunner(piecewise=True)`
against the compiled model without graphs, each beside the step's summed GPU kernel time.

- 8B shape (`LlamaConfig.llama3_8b()`, bf16, random weights), one runner with `compile=True`
  (decode graphs at the 35 default sizes), `piecewise=True` with the default token buckets plus
  4096 (so that the prefill step below has a bucket), captured into one pool (quick: the two
  buckets the steps take and no decode graph, `capture_sizes=[]`). Steps: *mixed*: 63 decodes at
  ctx 1024 + one 256-token prompt chunk (its first 256 tokens cached), 319 tokens in the 320
  bucket; *prefill*: 8 prompts x 512 new tokens, 4096 tokens. Paths: "compiled" is the runner's
  compiled model called directly under the step's metadata (what the runner runs for these steps
  without piecewise graphs); "piecewise" is `runner.run`. `us`: wall time of the call per step,
  synced, on a build made just before it (as a served step: FlashInfer plans, and so uploads, a step
  holding prefills in build(); FLASHINFER's mixed step also split between its prefill and decode
  wrappers, `MIXED_STEP_ENV=split`, a row of its own); `us_with_build`: the build and the call (what
  a synced loop pays; a loop that builds while the GPU runs the step before hides the build);
  `kernel_us`: the step's device kernels and copies, the build's upload and plan copies included,
  summed from a `torch.profiler` trace of builds and calls; `x_kernel` = us / kernel_us (goal <=
  1.10: GPU >= 90 % busy). Capture rows: that runner's capture (the first, with the compiles) and
  (not quick) a second runner captured after `torch._dynamo.reset()` (Inductor's caches warm, Dynamo
  traces again): total seconds, the piecewise part, the pieces' compile, `graphs_only_s` (inside the
  capture calls of both kinds of graphs: no warm-up, no compile) and the pool.
- The 16-layer bench model (`graphs_bench.CONFIG`) at batch 1, ctx 512: a 1-token decode replayed
  as the full decode graph, forced through the piecewise graphs (bucket 1: every piece replayed,
  the ops eager between them), and compiled without graphs; `x_graph` = us / the full graph's
  (goal for the piecewise row: <= 1.5), `x_graph_with_build` the same with the builds; then that
  runner's capture row (decode size 1 and bucket 1).

    python -m compiled_attn.bench.piecewise_bench [--quick] [--backend FLASHINFER ...]
    python -m compiled_attn.bench.piecewise_bench --capture-only [--backend FLASHINFER]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import unittest.mock
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import compiled_attn as ca
from compiled_attn.backends.flashinfer import MIXED_STEP_ENV
from compiled_attn.bench import graphs_bench
from compiled_attn.bench.compiles import compile_counts, reset_dynamo
from compiled_attn.bench.kernel_table import cuda_kernels
from compiled_attn.bench.models import shared_model
from compiled_attn.bench.report import print_table
from compiled_attn.bench.timing import card_name
from compiled_attn.capabilities import smallest_block_size
from compiled_attn.graphs import DEFAULT_PIECEWISE_SIZES, CUDAGraphRunner
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model

log = logging.getLogger(__name__)

BACKENDS = ("FLASHINFER", "TORCH_SDPA", "XFORMERS")
BENCH_BUCKETS = (*DEFAULT_PIECEWISE_SIZES, 4096)
# (name, seq_lens, query_lens): prefills first, as the builder requires
STEPS = (
    ("mixed: 63 decodes at ctx 1024 + a 256-token prompt chunk", [512] + [1025] * 63, [256] + [1] * 63),
    ("prefill: 8 x 512 new tokens", [512] * 8, [512] * 8),
)
PROFILED_STEPS = 5
# quick: the buckets the STEPS take (319 and 4096 tokens) and no decode graph: no timed step
# replays one, and the decode graphs cost the 8B model a whole-model compile of their own
QUICK_BUCKETS = tuple(sorted({min(b for b in BENCH_BUCKETS if b >= sum(q)) for _, _, q in STEPS}))
QUICK_CAPTURE_SIZES = ()


# A served step builds new metadata: FlashInfer plans its wrappers (in build() for a step holding
# prefills, uploading its device fields there; else at the first attention op) and the step's
# device fields are uploaded at their first read, each once per metadata object. A path timed on
# one object over and over would do none of that after its first call, where the decode graph's
# replay plans and copies its step every time. Each timed call therefore runs on a build made
# just before it, as a synced serving loop makes it (`served_us`): `us` times the call alone,
# `us_with_build` the build and the call.
def step_inputs(backend: type[ca.AttentionBackend], spec: ca.AttentionSpec, seq_lens: list[int],
                query_lens: list[int], vocab: int, seed: int = 0):
    """(metadata, input_ids, positions) of one step: distinct shuffled blocks per request."""
    return step_builds(backend, spec, seq_lens, query_lens, seed)(), *step_tokens(spec, seq_lens, query_lens, vocab)


def step_tokens(spec: ca.AttentionSpec, seq_lens: list[int], query_lens: list[int],
                vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, positions) of one step: random ids, each request's positions after its cached ones."""
    ids = torch.randint(vocab, (sum(query_lens),), device=spec.device)
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)]).to(spec.device)
    return ids, pos


def step_builds(backend: type[ca.AttentionBackend], spec: ca.AttentionSpec, seq_lens: list[int],
                query_lens: list[int], seed: int = 0, mixed: str | None = None) -> Callable[[], ca.AttentionMetadata]:
    """A callable that builds the step (the same blocks every time) with one builder, a new
    metadata object at each call: each plans and uploads as a served step does. `mixed`: the
    builder's MIXED_STEP_ENV choice (FLASHINFER; read when the builder is made), else the default."""
    rng = np.random.default_rng(seed)
    need = [-(-s // spec.block_size) for s in seq_lens]
    blocks = rng.permutation(spec.num_blocks)[: sum(need)].astype(np.int32)
    tables = np.zeros((len(seq_lens), max(need)), dtype=np.int32)
    for i, start in enumerate(np.cumsum([0] + need[:-1])):
        tables[i, : need[i]] = blocks[start: start + need[i]]
    with unittest.mock.patch.dict(os.environ, {} if mixed is None else {MIXED_STEP_ENV: mixed}):
        builder = backend.get_builder_cls()(spec)
    seq_lens_np, query_lens_np = np.array(seq_lens), np.array(query_lens)
    return lambda: builder.build(seq_lens_np, query_lens_np, tables)


def served_us(build: Callable[[], ca.AttentionMetadata], run: Callable[[ca.AttentionMetadata], object],
              iters: int) -> tuple[float, float]:
    """Median microseconds of `run(md)` on a build made just before it, synced after each call:
    (the call alone, the build and the call). 3 warm-up calls first."""
    for _ in range(3):
        run(build())
    torch.cuda.synchronize()
    alone, whole = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        md = build()
        t1 = time.perf_counter()
        run(md)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        alone.append((t2 - t1) * 1e6)
        whole.append((t2 - t0) * 1e6)
    return statistics.median(alone), statistics.median(whole)


def kernel_us(fn: Callable[[], object], steps: int = PROFILED_STEPS) -> float:
    """Summed device time (kernels, copies, memsets) of one `fn()` from a profiler trace."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return sum(k.end_us - k.start_us for k in cuda_kernels(prof)) / steps


def _row(backend: str, model: str, what: str, **values: object) -> dict:
    row = {"card": card_name(), "backend": backend, "model": model, "what": what}
    row.update({k: round(v, 3) if isinstance(v, float) else v for k, v in values.items()})
    log.info("piecewise_bench: %s", row)  # a run cut off by its timeout keeps the rows measured so far
    return row


def _spec(backend: type[ca.AttentionBackend], config: LlamaConfig, num_tokens: int,
          max_seq_len_to_capture: int) -> ca.AttentionSpec:
    block_size = smallest_block_size(backend)
    return config.attention_spec(block_size=block_size, num_blocks=-(-num_tokens // block_size) + 64,
                                 dtype=torch.bfloat16, device="cuda", max_seq_len_to_capture=max_seq_len_to_capture)


def setup_8b(name: str, quick: bool) -> tuple[LlamaConfig, ca.AttentionSpec, Callable[[], CUDAGraphRunner]]:
    """The 8B shape's config, spec and a maker of its (uncaptured) runners, all on one model and caches."""
    config = LlamaConfig.llama3_8b()
    backend = ca.get_attn_backend(name)
    spec = _spec(backend, config, 64 * 1100 + 8 * 512, max_seq_len_to_capture=2048)
    model = shared_model(config, name)  # the one e2e and the decode loop timed
    caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
    capture_sizes, buckets = (QUICK_CAPTURE_SIZES, QUICK_BUCKETS) if quick else (None, BENCH_BUCKETS)

    def runner() -> CUDAGraphRunner:
        return CUDAGraphRunner(model, backend, spec, caches, compile=True, capture_sizes=capture_sizes,
                               piecewise=True, piecewise_sizes=buckets, progress=False)

    return config, spec, runner


def rows_8b(name: str, iters: int, quick: bool) -> list[dict]:
    config, spec, runner = setup_8b(name, quick)
    backend = ca.get_attn_backend(name)
    first = runner()
    stats, traced = _capture_with_compiles(first)
    steps = [(what, step_builds(backend, spec, seq_lens, query_lens), seq_lens, query_lens)
             for what, seq_lens, query_lens in STEPS]
    if name == "FLASHINFER":  # the mixed step split between two wrappers (MIXED_STEP_ENV), same runner
        what, seq_lens, query_lens = STEPS[0]
        steps.insert(1, (f"{what}, {MIXED_STEP_ENV}=split",
                         step_builds(backend, spec, seq_lens, query_lens, mixed="split"), seq_lens, query_lens))
    rows = [row for what, build, seq_lens, query_lens in steps
            for row in step_rows(first, name, what, build, *step_tokens(spec, seq_lens, query_lens,
                                                                         config.vocab_size), iters)]
    if first.counts["piecewise"] == 0:
        raise RuntimeError("the piecewise rows did not take the piecewise path")
    rows.append(_capture_row(name, "8B", "first capture (compiles included)", stats, traced))
    if quick:  # two buckets say nothing of issue 14's goal (every bucket, warm): the full run times it
        return rows
    del first
    return rows + [warm_capture_row(name, runner)]


def warm_capture_row(name: str, runner: Callable[[], CUDAGraphRunner]) -> dict:
    """A new runner captured after `reset_dynamo()` with Inductor's caches warm (issue 14's goal:
    every bucket and decode size of the 8B model in <= 10 s): Dynamo traces again, as in a new
    process. The runners made before must be gone (their pieces, graphs and pool)."""
    reset_dynamo()
    torch.cuda.empty_cache()
    return _capture_row(name, "8B", "second capture (warm compile caches)", *_capture_with_compiles(runner()))


def capture_rows(name: str) -> list[dict]:
    """The 8B runner's captures alone (every bucket and decode size): the first, with its
    compiles, then a warm one (`warm_capture_row`); no step is timed."""
    _, _, runner = setup_8b(name, quick=False)
    rows = [_capture_row(name, "8B", "first capture (compiles included)", *_capture_with_compiles(runner()))]
    return rows + [warm_capture_row(name, runner)]


def _capture_with_compiles(runner: CUDAGraphRunner) -> tuple[dict, dict[str, float]]:
    """runner.capture()'s stats, and what its compiles took: the graphs Dynamo traced, the seconds
    of its compiles and, of those, Dynamo's own (the trace and guards: the rest is the backend's),
    where issue 14's warm capture goes."""
    before = compile_counts()
    stats = runner.capture()
    after = compile_counts()
    spent = {name: after[name] - before[name] for name in ("graphs", "compile s", "backend s")}
    return stats, {"traces": spent["graphs"], "compile_s": spent["compile s"],
                   "dynamo_s": spent["compile s"] - spent["backend s"]}


def step_rows(runner: CUDAGraphRunner, name: str, what: str, build: Callable[[], ca.AttentionMetadata],
              ids: torch.Tensor, pos: torch.Tensor, iters: int, model: str = "8B") -> list[dict]:
    """The step through the runner's compiled model without graphs, then through runner.run, each
    call on a build made just before it (`served_us`)."""

    def compiled(md: ca.AttentionMetadata) -> torch.Tensor:
        with ca.set_forward_context(md):
            return runner.model(ids, pos, runner.kv_caches)

    with ca.floats_as_constants():  # the first call traces the runner's compiled model at this size
        compiled(build())
    rows = []
    for path, run in (("compiled", compiled), ("piecewise", lambda md: runner.run(md, ids, pos))):
        us, with_build = served_us(build, run, iters)
        kernels = kernel_us(lambda run=run: run(build()))
        rows.append(_row(name, model, what, path=path, tokens=ids.shape[0], us=us, kernel_us=kernels,
                         x_kernel=us / kernels, us_with_build=with_build, x_kernel_with_build=with_build / kernels))
    return rows


def _capture_row(name: str, model: str, what: str, stats: dict, compiles: dict[str, float] | None = None) -> dict:
    pw = stats["piecewise"]
    return _row(name, model, what, path="capture", capture_s=stats["seconds"], **(compiles or {}),
                piecewise_s=pw["seconds"],
                piece_compile_s=pw["compile_seconds"],
                graphs_only_s=stats["graph_seconds"] + pw["graph_seconds"], decode_graphs=stats["num_graphs"],
                piecewise_graphs=pw["num_graphs"], pool_mib=_mib(stats["pool_bytes"]),
                piecewise_pool_mib=_mib(pw["pool_bytes"]))


def _mib(n: int | None) -> float | None:
    return None if n is None else n / 2**20


def rows_small_decode(name: str, iters: int) -> list[dict]:
    """The 16-layer model, batch 1: full decode graph vs the same decode forced through the pieces."""
    config, ctx = graphs_bench.CONFIG, graphs_bench.CONTEXT
    backend = ca.get_attn_backend(name)
    spec = _spec(backend, config, ctx, max_seq_len_to_capture=graphs_bench.MAX_SEQ_LEN_TO_CAPTURE)
    model = build_model(config, seed=0, backend=name, dtype=torch.bfloat16, device="cuda", init_device="cuda")
    caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
    runner = CUDAGraphRunner(model, backend, spec, caches, compile=True, capture_sizes=[1], max_batch_size=1,
                             piecewise=True, piecewise_sizes=[1], progress=False)
    stats = runner.capture()
    ids, pos = step_tokens(spec, [ctx], [1], config.vocab_size)
    build = step_builds(backend, spec, [ctx], [1])

    def compiled(md: ca.AttentionMetadata) -> torch.Tensor:
        with ca.set_forward_context(md):
            return runner.model(ids, pos, caches)  # batch 1: the compile the full graph was captured from

    paths = {  # each call on a build made just before it: every path plans and uploads as a served step does
        "full graph": lambda md: runner.run(md, ids, pos),
        "piecewise (forced)": lambda md: runner.piecewise.run(md, ids, pos),
        "compiled, no graphs": compiled,
    }
    with ca.floats_as_constants():  # a first call may trace (the capture traced size 1 already)
        compiled(build())
    times = {path: served_us(build, run, iters) for path, run in paths.items()}
    what = f"decode B=1, ctx {ctx}, {config.num_layers} layers"
    kept = stats["one_token"]["compile"]  # batch 1's compile (the pieces: cuBLAS's GEMMs, a symbolic token count)
    full, full_with_build = times["full graph"]
    rows = [_row(name, "16-layer", what, path=path, tokens=1, us=us, kernel_us=kernel_us(lambda r=run: r(build())),
                 x_graph=us / full, us_with_build=with_build, x_graph_with_build=with_build / full_with_build,
                 one_token=kept)
            for (path, run), (us, with_build) in zip(paths.items(), times.values(), strict=True)]
    return rows + [_capture_row(name, "16-layer", f"capture: decode size 1 and bucket 1, {config.num_layers} layers",
                                stats)]


def run(quick: bool, backends: tuple[str, ...] | None = None) -> list[dict]:
    """Rows of the 8B steps and captures, then the 16-layer decode comparison, per backend (quick:
    the first available of BACKENDS only, fewer graphs captured: QUICK_CAPTURE_SIZES, QUICK_BUCKETS)."""
    iters = 20 if quick else 50
    rows = []
    for name in backends or BACKENDS:
        try:
            ca.get_attn_backend(name)
        except (ca.BackendUnavailableError, NotImplementedError) as e:
            log.info("piecewise_bench: skipping %s: %s", name, e)
            continue
        rows += rows_8b(name, iters, quick)  # first: the 8B model the bench's earlier suites built is still there
        reset_dynamo()
        torch.cuda.empty_cache()
        rows += rows_small_decode(name, iters)
        reset_dynamo()
        torch.cuda.empty_cache()
        if quick:
            break
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--capture-only", action="store_true",
                        help="the 8B runner's first and warm captures only (one backend: the first given or available)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.capture_only:
        name = args.backend[0] if args.backend else ca.get_attn_backend(None).get_name()
        print_table(capture_rows(name))
        return
    print_table(run(args.quick, tuple(args.backend) if args.backend else None))


if __name__ == "__main__":
    main()
