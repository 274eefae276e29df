"""Decode-step latency eager vs compiled vs compiled + CUDA graphs; graph capture time and memory.

Latency: the reference model with 16 layers, hidden 1024 (16 query / 4 KV heads, head 64),
vocab 32000, bf16, every request at `CONTEXT` tokens, batch 1 / 8 / 64, for each backend
available here (quick: the first one). "eager" and "compiled" call the model under `set_forward_context`;
"compiled+graph" is `CUDAGraphRunner.run` (metadata copy into the static buffers, replay and
the logits clone: what a server pays per step); "reduce-overhead" (first backend only) is
`torch.compile(mode="reduce-overhead")`, PyTorch's CUDA graphs between our ops (which it keeps
out, as `cudagraph_unsafe`). Times are host wall time per step, synced.
Capture: `CUDAGraphRunner.capture()` of the compiled 32-layer model at the 35 default sizes
(quick: the eager model, 7 sizes), its wall time and the memory of the shared graph pool;
captured twice: the first capture (reported apart) includes compiling the model and the kernels
this process has not run yet, the second is the capture time.

TORCH_SDPA's graphs read the pages through FlexAttention here (its default on CUDA for this
shape: `torch_sdpa.graph_decode_kernel`), one graph per size; with
COMPILED_ATTN_SDPA_GRAPH_DECODE=gather they gather every row's table instead, captured at table
widths of 256, 512 and 1024 tokens (`MAX_SEQ_LEN_TO_CAPTURE`) per size, the runner replaying
the narrowest that holds the step, and its capture rows then count 3 graphs per size.

    python -m compiled_attn.bench.graphs_bench [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import torch

import compiled_attn as ca
from compiled_attn.bench.compiles import reset_dynamo
from compiled_attn.bench.report import print_table
from compiled_attn.bench.timing import card_name, eager_time_us
from compiled_attn.capabilities import smallest_block_size
from compiled_attn.graphs import DEFAULT_CAPTURE_SIZES, CUDAGraphRunner
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model
from compiled_attn.registry import BACKEND_CLASSES

log = logging.getLogger(__name__)

CONFIG = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=16, num_heads=16,
                     num_kv_heads=4)
CAPTURE_LAYERS = 32
BATCHES = (1, 8, 64)
CONTEXT = 512  # tokens per request in the timed decode step
MAX_SEQ_LEN_TO_CAPTURE = 1024
QUICK_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _spec(backend: type[ca.AttentionBackend], config: LlamaConfig, num_tokens: int) -> ca.AttentionSpec:
    block_size = smallest_block_size(backend)  # 16, or 64 for xFormers' paged decode
    return config.attention_spec(block_size=block_size, num_blocks=-(-num_tokens // block_size) + 1,
                                 dtype=torch.bfloat16, device="cuda", max_seq_len_to_capture=MAX_SEQ_LEN_TO_CAPTURE)


def _can_serve(backend: type[ca.AttentionBackend], spec: ca.AttentionSpec) -> bool:
    """Whether `backend` can serve `spec` here (logged when it cannot)."""
    try:
        ca.get_attn_backend(backend.get_name(), spec)
    except (ca.BackendUnavailableError, NotImplementedError) as e:
        log.info("graphs_bench: skipping %s: %s", backend.get_name(), e)
        return False
    return True


def _decode_step(backend: type[ca.AttentionBackend], spec: ca.AttentionSpec, batch: int):
    """Metadata and inputs of one decode step: `batch` requests of CONTEXT tokens, distinct blocks."""
    blocks = -(-CONTEXT // spec.block_size)
    tables = torch.randperm(spec.num_blocks)[: batch * blocks].view(batch, blocks).tolist()
    md = backend.get_builder_cls()(spec).build([CONTEXT] * batch, [1] * batch, tables)
    ids = torch.randint(CONFIG.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), CONTEXT - 1, device="cuda")
    ca.mark_token_dim(ids, pos)  # one compiled graph for every batch size
    return md, ids, pos


def _latency_rows(backend: type[ca.AttentionBackend], iters: int, with_reduce_overhead: bool) -> list[dict]:
    spec = _spec(backend, CONFIG, max(BATCHES) * CONTEXT)
    if not _can_serve(backend, spec):
        return []
    name = backend.get_name()
    # weights drawn on the device: on the host, the 32-layer capture model's draws take seconds
    model = build_model(CONFIG, seed=0, backend=name, dtype=torch.bfloat16, device="cuda", init_device="cuda")
    caches = [c.normal_() for c in allocate_kv_caches(CONFIG, backend, spec)]
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    runner = CUDAGraphRunner(compiled, backend, spec, caches, capture_sizes=BATCHES, max_batch_size=max(BATCHES),
                             progress=False)
    runner.capture()
    if with_reduce_overhead:
        reduce_overhead = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=True)
    rows = []
    for batch in BATCHES:
        md, ids, pos = _decode_step(backend, spec, batch)

        def direct(fn, md=md, ids=ids, pos=pos):
            with ca.set_forward_context(md):
                return fn(ids, pos, caches)

        def timed(fn) -> float:
            with ca.floats_as_constants():  # a first call may trace: the model's floats as constants
                direct(fn)
            return eager_time_us(lambda: direct(fn), iters=iters)

        times = {
            "eager": timed(model),
            "compiled": timed(compiled),
            "compiled+graph": eager_time_us(lambda md=md, ids=ids, pos=pos: runner.run(md, ids, pos), iters=iters),
        }
        if with_reduce_overhead:  # after the runner: its graphs must survive cudagraph trees' cuBLAS clearing
            times["reduce-overhead"] = timed(reduce_overhead)
        for mode, us in times.items():
            rows.append(_row(name, f"decode {mode}, {CONFIG.num_layers} layers, ctx {CONTEXT}", batch,
                             us=us, x_eager=times["eager"] / us))
    return rows  # the model, caches and graphs go with this frame; the caller empties the cache


def _capture_row(backend: type[ca.AttentionBackend], sizes: tuple[int, ...], compiled: bool) -> list[dict]:
    config = dataclasses.replace(CONFIG, num_layers=CAPTURE_LAYERS)
    spec = _spec(backend, config, 64 * 1024)
    if not _can_serve(backend, spec):
        return []
    name = backend.get_name()
    model = build_model(config, seed=0, backend=name, dtype=torch.bfloat16, device="cuda", init_device="cuda")
    step = torch.compile(model, fullgraph=True, dynamic=True) if compiled else model
    caches = allocate_kv_caches(config, backend, spec)

    def capture() -> dict:
        return CUDAGraphRunner(step, backend, spec, caches, capture_sizes=sizes, max_batch_size=max(sizes),
                               progress=False).capture()

    first = capture()  # compiles the model and the kernels this process has not run yet
    torch.cuda.empty_cache()
    stats = capture()  # what a server restarted on warm compile and kernel caches pays
    what = (f"capture {len(stats['sizes'])} sizes x {len(stats['table_widths'])} table widths, "
            f"{'compiled' if compiled else 'eager'} {CAPTURE_LAYERS} layers")
    return [_row(name, what, max(sizes), capture_s=stats["seconds"], first_capture_s=first["seconds"],
                 pool_mib=None if stats["pool_bytes"] is None else stats["pool_bytes"] / 2**20,
                 reserved_mib=stats["reserved_bytes"] / 2**20)]


def _row(backend: str, what: str, batch: int, **values: float | None) -> dict:
    row = {"card": card_name(), "backend": backend, "what": what, "batch": batch, "us": None, "x_eager": None,
           "capture_s": None, "first_capture_s": None, "pool_mib": None, "reserved_mib": None}
    row.update({k: None if v is None else round(v, 3) for k, v in values.items()})
    log.info("graphs_bench: %s", row)
    return row


def run(quick: bool) -> list[dict]:
    """Latency rows (us per step, speed-up over eager) then capture rows (seconds, pool MiB)."""
    iters = 20 if quick else 100
    sizes = QUICK_CAPTURE_SIZES if quick else DEFAULT_CAPTURE_SIZES
    rows = []
    for backend in BACKEND_CLASSES().values():
        if quick and rows:  # each backend's rows cost two 16-layer compiles; the GPU tests check them all
            break
        # reduce-overhead for the first backend that runs only: one more compile per backend
        rows += _latency_rows(backend, iters, with_reduce_overhead=not rows)
        reset_dynamo()  # drop the compiled graphs (they hold the model)
        torch.cuda.empty_cache()
    for backend in BACKEND_CLASSES().values():
        rows += _capture_row(backend, sizes, compiled=not quick)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print_table(run(parser.parse_args().quick))


if __name__ == "__main__":
    main()
