"""The transformers integration against its peers, on a Llama-3-8B-shaped model (random bf16 weights
from a `LlamaConfig`, one copy on the card for every side; issue 15's goals).

- **B=1 decode**: `PagedEngine` (compiled, CUDA graphs) against transformers' own fast path,
  `generate(cache_implementation="static")` (which compiles its forward: fullgraph,
  reduce-overhead). Both at `ctx` prompt tokens; per-token decode time = (time of 1 + STEPS new
  tokens - time of 1 new token) / STEPS for transformers, the mean of STEPS engine steps for ours.
  Goal: engine >= 1.0x.
- **B=64 serving**: 64 prompts of `PROMPT` tokens, `NEW` new tokens each, end to end (prefill
  included): the engine's `generate` against transformers' continuous batching, `generate_batch`.
  Goal: engine >= 2x tokens/s.
- **adapter cost**: the engine's decode step against our reference Llama (same shape) through
  `CUDAGraphRunner(compile=True)`, `bench.decode_loop.PagedLoop` with a sync per step (the engine
  needs each step's tokens on the host: EOS, scheduling). Goal: engine >= 0.95x.

    python -m compiled_attn.bench.hf_engine [--quick] [--backend FLASHINFER] [--part b1|b64|adapter] [--out DIR]
        [--profile]   # adapter: per-layer kernel tables of the engine's and the reference's steps

Each part compiles the 8B model two or three times (minutes each): `--part` runs one per process.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from compiled_attn.bench import decode_loop
from compiled_attn.bench.compiles import reset_dynamo
from compiled_attn.bench.kernel_table import cuda_kernels, markdown, per_layer_table
from compiled_attn.bench.report import print_table
from compiled_attn.bench.timing import card_name
from compiled_attn.integrations import hf_random
from compiled_attn.integrations import transformers as ca_hf
from compiled_attn.models.llama import LlamaConfig, build_model

log = logging.getLogger(__name__)

CTX = 1024  # prompt tokens of the decode points
STEPS = 56  # timed decode steps (as decode_loop)
PROFILED_STEPS = 8  # steps in a kernel table (--profile)
WARM_STEPS = 8
PROMPT, NEW = 512, 128  # the B=64 serving point
BLOCK_SIZE = 16


def _model(size: str, device: str) -> torch.nn.Module:
    config = hf_random.random_config("llama", size)
    return hf_random.random_model(config, attn_implementation="sdpa", dtype=torch.bfloat16, device=device)


def _prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _engine(model: torch.nn.Module, backend: str | None, batch: int, longest: int,
            tokens_per_step: int) -> ca_hf.PagedEngine:
    ca_hf.register()
    model.set_attn_implementation(ca_hf.IMPLEMENTATION)
    blocks = batch * -(-longest // BLOCK_SIZE) + 1
    return ca_hf.PagedEngine(model, block_size=BLOCK_SIZE, num_blocks=blocks, backend=backend, compile=True,
                             cuda_graphs=torch.cuda.is_available(), max_batch_size=batch,
                             max_num_batched_tokens=tokens_per_step, capture_sizes=sorted({1, batch}),
                             max_seq_len_to_capture=-(-longest // BLOCK_SIZE) * BLOCK_SIZE)


def kernel_profile(step: Callable[[], object], num_layers: int, title: str, path: str) -> None:
    """The per-layer kernel table of PROFILED_STEPS calls of `step` (a sync after each, as timed),
    appended to the markdown file `path`."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
            torch.cuda.synchronize()
    table = per_layer_table(cuda_kernels(prof), PROFILED_STEPS, num_layers)
    with open(path, "a") as f:
        f.write(markdown(table, f"{title}, {card_name()}") + "\n\n")


def engine_decode_ms(model: torch.nn.Module, backend: str | None, batch: int, ctx: int, steps: int = STEPS,
                     profile_to: str | None = None) -> float:
    """ms per decode step of `batch` requests from `ctx` tokens on (every request decoding); with
    `profile_to`, then the kernel table of a few more steps (`kernel_profile`)."""
    engine = _engine(model, backend, batch, ctx + WARM_STEPS + steps + PROFILED_STEPS + 2, max(2048, ctx))
    for p in _prompts(model.config.vocab_size, batch, ctx):
        engine.add_request(p, max_new_tokens=WARM_STEPS + steps + PROFILED_STEPS + 1)
    while any(not engine.output(i).output_tokens for i in range(batch)):  # prefill (in chunks)
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    ms = (time.perf_counter() - start) * 1e3 / steps
    if engine.runner is not None and engine.runner.counts["graph"] < steps:
        log.warning("engine: only %d of its decode steps replayed graphs", engine.runner.counts["graph"])
    if profile_to:
        kernel_profile(engine.step, model.config.num_hidden_layers, f"PagedEngine, B={batch}, ctx {ctx}", profile_to)
    return ms


def hf_static_decode_ms(model: torch.nn.Module, ctx: int, steps: int = STEPS) -> float:
    """transformers' static cache + compiled forward: ms per decode token at batch 1."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(_prompts(model.config.vocab_size, 1, ctx), device=model.device)

    def timed(new: int) -> float:
        _sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                       eos_token_id=None, pad_token_id=0)
        _sync()
        return time.perf_counter() - start

    timed(1 + steps)  # compiles and captures
    timed(1 + steps)
    first = min(timed(1) for _ in range(2))
    full = min(timed(1 + steps) for _ in range(2))
    return (full - first) * 1e3 / steps


def hf_generate_batch_tok_s(model: torch.nn.Module, prompts: list[list[int]], new: int) -> float:
    """transformers' continuous batching (`generate_batch`): new tokens per second, end to end."""
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")  # generate_batch switches it to its paged variant
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(prompts[:8], generation_config=config)  # warm-up: its graphs and kernels
    _sync()
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config)
    _sync()
    seconds = time.perf_counter() - start
    return sum(len(o.generated_tokens) for o in out.values()) / seconds


def engine_generate_tok_s(model: torch.nn.Module, backend: str | None, prompts: list[list[int]], new: int) -> float:
    engine = _engine(model, backend, len(prompts), max(len(p) for p in prompts) + new + 1, 4096)
    engine.generate(prompts[:8], max_new_tokens=new)  # warm-up: compile, first-use kernels
    _sync()
    start = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=new)
    _sync()
    return sum(len(o) for o in out) / (time.perf_counter() - start)


def reference_decode_ms(config: object, backend: str, batch: int, ctx: int, profile_to: str | None = None) -> float:
    """Our reference Llama of the transformers `config`'s shape (random weights) through the
    runner, a sync per step (as the engine); `profile_to` as in `engine_decode_ms`."""
    shape = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
                        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads)
    model = build_model(shape, seed=0, backend=backend, dtype=torch.bfloat16, device="cuda", init_device="cuda")
    loop = decode_loop.PagedLoop(model, model.layers[0].attn.backend, batch, ctx, {"compile": True})
    ms = decode_loop.loop_ms(loop.loop, True)
    if profile_to:
        kernel_profile(functools.partial(loop.loop, 1, True), shape.num_layers,
                       f"reference Llama + runner, B={batch}, ctx {ctx}", profile_to)
    del loop, model
    torch.cuda.empty_cache()
    return ms


PARTS = ("b1", "b64", "adapter")


def run(quick: bool = False, backend: str | None = None, size: str = "llama3-8b",
        parts: tuple[str, ...] = PARTS, profile_to: str | None = None) -> list[dict]:
    """Rows of the selected parts; `profile_to`: a markdown file for the adapter part's kernel
    tables (engine and reference, B=1 and B=64: where the engine's step differs on the GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = 16 if quick else STEPS
    rows: list[dict] = []
    model = _model(size, device)

    def row(point: str, side: str, **values: float | str) -> dict:
        rows.append({"card": card_name(), "point": point, "side": side, **values})
        return rows[-1]

    def attempt(fn, *args):  # a failing peer must not hide the other numbers
        try:
            return fn(*args)
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            return f"FAILED: {type(e).__name__}: {e}"

    engine_ms: dict[int, float] = {}
    if "b1" in parts:  # B=1 decode against transformers' static cache + compile
        engine_ms[1] = engine_decode_ms(model, backend, 1, CTX, steps)
        reset_dynamo()
        peer = attempt(hf_static_decode_ms, model, CTX, steps)
        point = f"B=1 decode, ctx {CTX}"
        row(point, "transformers static cache + compile", **_speed(peer, 1))
        row(point, "PagedEngine", **_speed(engine_ms[1], 1), **_ratio(peer, engine_ms[1]))
    if "b64" in parts:  # B=64 serving against transformers' continuous batching
        reset_dynamo()
        prompts = _prompts(model.config.vocab_size, 64, PROMPT, seed=1)
        new = 32 if quick else NEW
        peer_tok_s = attempt(hf_generate_batch_tok_s, model, prompts, new)
        reset_dynamo()
        ours_tok_s = engine_generate_tok_s(model, backend, prompts, new)
        point = f"B=64 serving, prompt {PROMPT}, {new} new"
        row(point, "transformers generate_batch", **{"tok/s": peer_tok_s})
        vs = {"vs peer": ours_tok_s / peer_tok_s} if isinstance(peer_tok_s, float) else {}
        row(point, "PagedEngine", **{"tok/s": ours_tok_s}, **vs)
    if "adapter" in parts:  # the engine against our reference model through the runner
        for b in (1, 64):
            if b not in engine_ms or profile_to:
                reset_dynamo()
                engine_ms[b] = engine_decode_ms(model, backend, b, CTX, steps, profile_to)
        engine_backend = _engine_backend_name(model, backend)
        config = model.config
        del model
        torch.cuda.empty_cache()
        reset_dynamo()
        for b in (1, 64):
            ref_ms = attempt(reference_decode_ms, config, engine_backend, b, CTX, profile_to)
            point = f"B={b} decode, ctx {CTX} (synced)"
            row(point, f"reference Llama + runner ({engine_backend})", **_speed(ref_ms, b))
            row(point, "PagedEngine", **_speed(engine_ms[b], b), **_ratio(ref_ms, engine_ms[b]))
    return rows


def _engine_backend_name(model: torch.nn.Module, backend: str | None) -> str:
    return ca_hf.attention_modules(model)[0].compiled_attn.backend.get_name() if backend is None else backend


def _speed(ms: float | str, batch: int) -> dict:
    if isinstance(ms, str):
        return {"ms/step": ms}
    return {"ms/step": ms, "tok/s": batch / ms * 1e3}


def _ratio(peer_ms: float | str, ours_ms: float) -> dict:
    """Speed relative to the peer (> 1: ours is faster), where the peer ran."""
    return {"vs peer": peer_ms / ours_ms} if isinstance(peer_ms, float) else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--size", default="llama3-8b", help="hf_random size (tiny / small for a smoke run)")
    parser.add_argument("--part", action="append", choices=PARTS, default=None, help="repeat to select several")
    parser.add_argument("--out", default=None, help="folder for hf-engine[-PART].json")
    parser.add_argument("--profile", action="store_true",
                        help="adapter part: kernel tables of both sides into --out/hf-engine-adapter-profile.md")
    args = parser.parse_args()
    parts = tuple(args.part or PARTS)
    if args.profile and not args.out:
        parser.error("--profile writes into --out: name the folder")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    profile_to = os.path.join(args.out, "hf-engine-adapter-profile.md") if args.profile else None
    rows = run(args.quick, args.backend, args.size, parts, profile_to)
    print_table(rows)
    if args.out:
        name = "hf-engine.json" if args.part is None else f"hf-engine-{'-'.join(parts)}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
