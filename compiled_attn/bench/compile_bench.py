"""Compile time and recompile count of the reference model across batch mixes, per backend.

Runs on CPU too (the reduced suite: TORCH_SDPA, a tiny model): the first call's compile time,
then decode-step times eager vs compiled, and how many recompiles the batch mixes caused (0 is
the contract: the token dimension is unbacked, metadata never reaches Dynamo).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import compiled_attn as ca
from compiled_attn.bench.compiles import reset_dynamo
from compiled_attn.bench.timing import card_name, eager_time_us
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model
from compiled_attn.paging import BlockAllocator, Request, schedule
from compiled_attn.registry import BACKEND_CLASSES

# (new prompt lengths, decode context lengths); one of them a 1-token batch
MIXES = [([7, 3], []), ([5], [9, 4, 12]), ([], [6]), ([1], []), ([], [3, 8, 2, 17, 5]), ([2, 11, 4], [10])]


def _step(config: LlamaConfig, backend: type[ca.AttentionBackend], spec: ca.AttentionSpec, mix, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts, contexts = mix
    reqs = [Request(tokens=torch.randint(config.vocab_size, (n,), generator=g).tolist()) for n in prompts]
    reqs += [Request(tokens=torch.randint(config.vocab_size, (n + 1,), generator=g).tolist(), num_computed=n)
             for n in contexts]
    seq_lens, query_lens, tables, ids, pos = schedule(reqs, BlockAllocator(spec.num_blocks, spec.block_size),
                                                      spec.device)
    md = backend.get_builder_cls()(spec).build(seq_lens, query_lens, tables)
    ca.mark_token_dim(ids, pos)
    return md, ids, pos


def run(quick: bool = False) -> list[dict]:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    config = (LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                          num_kv_heads=4) if cuda else
              LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                          num_kv_heads=2))
    if quick:  # compile time grows with the layers; the recompile count (the contract) does not
        config = dataclasses.replace(config, num_layers=2)
    rows = []
    for name, backend in BACKEND_CLASSES().items():
        if backend.unavailable_reason() is None:
            rows.append(measure_backend(config, name, backend, device, dtype, iters=10 if quick else 50))
    return rows


def measure_backend(config: LlamaConfig, name: str, backend: type[ca.AttentionBackend], device: str,
                    dtype: torch.dtype, iters: int) -> dict:
    block_size = next(b for b in (16, 64) if backend.supports_block_size(b))
    spec = config.attention_spec(block_size=block_size, num_blocks=64, dtype=dtype, device=device)
    model = build_model(config, seed=0, backend=name, dtype=dtype, device=device, init_device=device)
    caches = allocate_kv_caches(config, backend, spec)
    reset_dynamo()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    md, ids, pos = _step(config, backend, spec, MIXES[0], seed=0)
    start = time.perf_counter()
    with ca.floats_as_constants(), ca.set_forward_context(md):
        compiled(ids, pos, caches)
    compile_s = time.perf_counter() - start
    first = counter.frame_count
    for i, mix in enumerate(MIXES[1:], 1):
        md, ids, pos = _step(config, backend, spec, mix, seed=i)
        with ca.floats_as_constants(), ca.set_forward_context(md):
            compiled(ids, pos, caches)
    recompiles = counter.frame_count - first
    md, ids, pos = _step(config, backend, spec, ([], [40] * 8), seed=99)  # 8 decodes

    def decode(fn) -> None:
        with ca.set_forward_context(md):
            fn(ids, pos, caches)

    with ca.floats_as_constants():  # the 8-decode step may trace: the model's floats as constants
        decode(compiled)

    return {
        "card": card_name(), "backend": name, "layers": config.num_layers, "compile s": compile_s,
        "batch mixes": len(MIXES), "recompiles": recompiles,
        "eager decode us (B=8)": eager_time_us(lambda: decode(model), iters=iters),
        "compiled decode us (B=8)": eager_time_us(lambda: decode(compiled), iters=iters),
    }
