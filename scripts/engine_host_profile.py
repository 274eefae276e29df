"""Host time of `PagedEngine.step()` in steady decode on the CPU, split by phase, against the
reference path's `builder.build(...)` for the same batch (what `bench.decode_loop.PagedLoop` pays).

    python scripts/engine_host_profile.py [--batch 1 --batch 64] [--ctx 1024] [--family llama]
        [--steps 200] [--cuda-graphs] [--real-model] [--profile FILE]

A tiny random transformers model (`hf_random`, TORCH_SDPA, no compile) stands for the 8B one, and
its forward is replaced by a stub that returns zero logits at once (--real-model keeps it): on the
GPU the host waits out the forward idle, while a CPU forward would evict the host code's caches
and make its timings noisy. The engine's own code runs unchanged around the stub. Phases:
scheduler (`Scheduler.schedule`), build (every group's `builder.build`), model (the step function,
or `runner.run` with --cuda-graphs), update (`Scheduler.update`), record (`_record`), and engine
(the rest of `step()`: the inputs' tensors, picking the sampled rows, readback, glue). Medians in
us per step; "engine overhead" is step minus model minus build, what the reference path does not
pay. --profile writes a cProfile of the timed steps (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import time
import types
from collections.abc import Callable

import numpy as np
import torch

from compiled_attn.integrations import hf_random
from compiled_attn.integrations import transformers as ca_hf

BLOCK_SIZE = 16
PHASES = ("scheduler", "build", "model", "update", "record")


class PhaseClock:
    """Per-step seconds spent inside wrapped callables, summed by phase."""

    def __init__(self) -> None:
        self.now = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        out, self.now = self.now, dict.fromkeys(PHASES, 0.0)
        return out


def stub_forward(vocab: int) -> Callable:
    """A transformers forward that returns zero logits [1, num_tokens, vocab] (greedy token 0)."""

    def forward(input_ids: torch.Tensor, **kwargs: object) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], vocab))

    return forward


def steady_engine(batch: int, ctx: int, steps: int, family: str, cuda_graphs: bool,
                  real_model: bool) -> ca_hf.PagedEngine:
    """An engine whose `batch` requests all decode from `ctx` tokens on (prefilled, one warm step)."""
    ca_hf.register()
    model = hf_random.random_model(hf_random.random_config(family), seed=0)
    if not real_model:
        model.forward = stub_forward(model.config.vocab_size)
    longest = ctx + steps + 8
    engine = ca_hf.PagedEngine(model, block_size=BLOCK_SIZE, num_blocks=batch * -(-longest // BLOCK_SIZE) + 1,
                               backend="TORCH_SDPA", compile=False, cuda_graphs=cuda_graphs, max_batch_size=batch,
                               max_num_batched_tokens=max(2048, ctx), capture_sizes=[batch] if cuda_graphs else None,
                               max_seq_len_to_capture=-(-longest // BLOCK_SIZE) * BLOCK_SIZE)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(1, vocab, (ctx - 1,), generator=g).tolist(), max_new_tokens=steps + 4)
    while any(not engine.output(i).output_tokens for i in range(batch)):  # prefill, in chunks
        engine.step()
    engine.step()
    return engine


def instrument(engine: ca_hf.PagedEngine) -> PhaseClock:
    """Wrap the engine's parts (instance attributes: the engine's own code runs unchanged)."""
    clock = PhaseClock()
    engine.scheduler.schedule = clock.wrap("scheduler", engine.scheduler.schedule)
    engine.scheduler.update = clock.wrap("update", engine.scheduler.update)
    engine._record = clock.wrap("record", engine._record)
    for builder in engine.builders.values():
        builder.build = clock.wrap("build", builder.build)
    if engine.runner is not None:
        engine.runner.run = clock.wrap("model", engine.runner.run)
    else:
        engine._step_fn = clock.wrap("model", engine._step_fn)
    return clock


def engine_us(engine: ca_hf.PagedEngine, steps: int, profiler: cProfile.Profile | None) -> dict[str, float]:
    """Median us per step of each phase over `steps` decode steps."""
    clock = instrument(engine)
    rows = []
    for _ in range(steps):
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        phases = clock.take()
        rows.append({**phases, "engine": total - sum(phases.values()), "step": total,
                     "engine overhead": total - phases["model"] - phases["build"]})
    return {k: float(np.median([r[k] for r in rows])) * 1e6 for k in rows[0]}


def reference_build_us(engine: ca_hf.PagedEngine, batch: int, ctx: int, steps: int) -> float:
    """Median us of the reference path's host work for the same batch: one `build()` per group from
    arrays (lengths, a persistent 2-D table of shuffled blocks), as `PagedLoop.inputs` does."""
    pages = -(-(ctx + steps + 1) // BLOCK_SIZE)
    times = []
    builders = {g.name: type(engine.builders[g.name])(g.spec, rolling_tables=engine.builders[g.name].rolling_tables)
                for g in engine.groups}
    spec = engine.groups[0].spec
    tables = (np.random.default_rng(0).permutation(spec.num_blocks - 1)[: batch * pages] + 1)
    tables = tables.astype(np.int32).reshape(batch, pages)
    query_lens = np.ones(batch, dtype=np.int64)
    for i in range(steps):
        t0 = time.perf_counter()
        seq_lens = np.full(batch, ctx + 1 + i)
        for builder in builders.values():
            builder.build(seq_lens, query_lens, tables)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append", default=None)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--family", default="llama", choices=hf_random.FAMILIES)
    parser.add_argument("--cuda-graphs", action="store_true", help="serve through the runner (no capture on CPU)")
    parser.add_argument("--real-model", action="store_true", help="run the model's forward (not the stub)")
    parser.add_argument("--profile", default=None, help="write a cProfile of the timed steps here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the model's CPU kernels stay out of the host code's way
    for batch in args.batch or [1, 64]:
        engine = steady_engine(batch, args.ctx, args.steps, args.family, args.cuda_graphs, args.real_model)
        profiler = cProfile.Profile() if args.profile else None
        us = engine_us(engine, args.steps, profiler)
        ref = reference_build_us(engine, batch, args.ctx, args.steps)
        print(f"B={batch} ctx {args.ctx} {args.family} ({len(engine.groups)} group(s)), us/step (median): "
              + ", ".join(f"{k} {v:.0f}" for k, v in us.items()) + f"; reference build {ref:.0f}")
        if profiler is not None:
            with open(f"{args.profile}.B{batch}.txt", "w") as f:
                pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
