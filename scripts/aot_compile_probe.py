"""Probe for issue 14's warm-capture goal: can the reference Llama (our ops, the forward context)
be compiled ahead of time with `torch.compile(...).aot_compile` (experimental in torch), saved,
and loaded in a fresh process without Dynamo tracing it again?

    python scripts/aot_compile_probe.py [--layers 32] [--backend inductor] [--device cpu]
    python scripts/aot_compile_probe.py --config 8b --device cuda --attn FLASHINFER --tuned   # the device

--config 8b: the 8B shape in bf16 (`--layers` still sets the depth; 32 is the real model's);
--tuned: Inductor with the runner's COMPILE_OPTIONS (coordinate-descent tuning), as its compiles.

Three fresh processes, one after another:
- save: compiles with `aot_compile` and saves the artifact;
- load: loads it, runs one decode step of two requests and prints the largest absolute difference
  from the eager model's step on the same random caches;
- jit: what a new process pays today, the first call of `torch.compile` (Dynamo traces the model
  again; Inductor's caches are warm from the first process).
The model's token count is a backed dynamic size, as `CUDAGraphRunner(compile=True)` compiles its
shared graph. Batch 1 would need an artifact of its own: Dynamo specialises sizes 0 and 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import compiled_attn as ca
from compiled_attn.graphs.compiler import COMPILE_OPTIONS
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=32, num_heads=4, num_kv_heads=2)


def setup(args: argparse.Namespace, requests: int = 3, model: torch.nn.Module | None = None) -> tuple:
    """The model, the inputs of a decode step of `requests` requests (one block each), its
    metadata, and random caches (seed 0). The example step has 3 requests: with 2, Dynamo's duck
    sizing gives the token count the symbol of the caches' K/V dimension (also 2), and the
    artifact then serves 2 tokens only. `model`: reuse this one (a second model's layers get
    other names, which the artifact's guards refuse)."""
    device = args.device
    base = LlamaConfig.llama3_8b() if args.config == "8b" else TINY
    cfg = dataclasses.replace(base, num_layers=args.layers)
    dtype = torch.bfloat16 if args.config == "8b" else torch.float32
    backend = ca.get_attn_backend(args.attn)
    spec = cfg.attention_spec(block_size=16, num_blocks=64, dtype=dtype, device=device, max_seq_len_to_capture=256)
    if model is None:
        model = build_model(cfg, seed=0, backend=args.attn, dtype=dtype, device=device, init_device=device)
    gen = torch.Generator(device).manual_seed(0)
    caches = [c.copy_(torch.randn(c.shape, generator=gen, device=device))
              for c in allocate_kv_caches(cfg, backend, spec)]
    seq_lens = [5 + 2 * i for i in range(requests)]  # within one block of 16
    md = backend.get_builder_cls()(spec).build(seq_lens, [1] * requests, [[i + 1] for i in range(requests)])
    ids = torch.arange(3, 3 + requests, device=device)
    pos = torch.tensor(seq_lens, device=device) - 1
    return model, md, ids, pos, caches


def compile_options(args: argparse.Namespace) -> dict:
    return {"options": COMPILE_OPTIONS} if args.tuned else {}


def save(args: argparse.Namespace) -> None:
    model, md, ids, pos, caches = setup(args)
    with ca.set_forward_context(md), torch.no_grad(), ca.floats_as_constants():
        start = time.perf_counter()
        compiled = torch.compile(model.forward, fullgraph=True, dynamic=True, backend=args.backend,
                                 **compile_options(args))
        artifact = compiled.aot_compile(((ids, pos, caches), {}))
        compile_s = time.perf_counter() - start
        artifact.save_compiled_function(args.path)
    print(f"aot_compile ({args.backend}{', tuned' if args.tuned else ''}, {args.config} x {args.layers} layers, "
          f"{args.attn}, {args.device}): {compile_s:.2f} s", flush=True)


def load(args: argparse.Namespace) -> None:
    model, md, ids, pos, caches = setup(args)
    with ca.set_forward_context(md), torch.no_grad(), ca.floats_as_constants():
        start = time.perf_counter()
        with open(args.path, "rb") as f:
            step = torch.compiler.load_compiled_function(f, f_globals=model.forward.__globals__)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        got = step(model, ids, pos, [c.clone() for c in caches])
        call_s = time.perf_counter() - start
        want = model(ids, pos, caches)
    print(f"load {load_s:.2f} s, first call {call_s:.2f} s, largest difference from eager "
          f"{(got - want).abs().max().item():.2e}", flush=True)
    for requests in (5, 1):  # another size the shared graph serves, and batch 1, which it must refuse
        _, md, ids, pos, caches = setup(args, requests, model)
        with ca.set_forward_context(md), torch.no_grad(), ca.floats_as_constants():
            try:
                got = step(model, ids, pos, [c.clone() for c in caches])
                diff = f"served, largest difference {(got - model(ids, pos, caches)).abs().max().item():.2e}"
            except RuntimeError as e:  # the artifact's guards
                diff = f"refused: {str(e).splitlines()[0]}"
        print(f"{requests} requests: {diff}", flush=True)


def jit(args: argparse.Namespace) -> None:
    model, md, ids, pos, caches = setup(args)
    with ca.set_forward_context(md), torch.no_grad(), ca.floats_as_constants():
        start = time.perf_counter()
        torch.compile(model, fullgraph=True, dynamic=True, backend=args.backend, **compile_options(args))(
            ids, pos, caches)
    print(f"torch.compile's first call in a new process: {time.perf_counter() - start:.2f} s", flush=True)


STAGES = {"save": save, "load": load, "jit": jit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", choices=("tiny", "8b"), default="tiny")
    parser.add_argument("--attn", default="TORCH_SDPA", help="the attention backend")
    parser.add_argument("--tuned", action="store_true", help="Inductor with COMPILE_OPTIONS")
    parser.add_argument("--stage", choices=tuple(STAGES), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        STAGES[args.stage](args)
        return
    if not hasattr(torch.compiler, "load_compiled_function"):
        sys.exit(f"torch {torch.__version__} has no torch.compiler.load_compiled_function (aot_compile)")
    with tempfile.TemporaryDirectory() as tmp:
        common = [sys.executable, __file__, "--layers", str(args.layers), "--backend", args.backend,
                  "--device", args.device, "--config", args.config, "--attn", args.attn,
                  *(["--tuned"] if args.tuned else []), "--path", str(Path(tmp) / "step.bin")]
        for stage in STAGES:  # each in a fresh process
            subprocess.run([*common, "--stage", stage], check=True)


if __name__ == "__main__":
    main()
