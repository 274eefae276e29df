"""How closely each graphed decode kernel follows eager and an fp32 model: the GPU test's
teacher-forced steps (tests/test_graphs.py `decode_teacher_forced`), every engine fed the same
tokens (the bf16 eager TORCH_SDPA model's greedy ones).

Per engine: top-1 agreement with bf16 eager and with the fp32 model (the bf16 weights upcast,
TORCH_SDPA in fp32), the logits' relative error against each, and at each disagreement with eager
the reference logits' top-1 minus top-2 gap (how near a tie it was; the reference is bf16 eager
TORCH_SDPA, or FlashInfer's eager in the row that says so). "flex-all" is a diagnostic, not a
product path: FlexAttention over every page, the last one masked by mask_mod, on a zeroed cache
(it would carry NaN from unwritten slots), to tell the NaN-safe path's merge from flex's kernel.

    python3 scripts/decode_agreement.py [--out DIR]      (CUDA; FLASHINFER rows where installed)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import unittest.mock
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# the GPU test's model, sizes, steps and engines, as `scripts/fault_hunt.py` takes its cases
sys.path[:0] = [str(Path(__file__).parent.parent / "tests")]
from test_graphs import (  # noqa: E402
    DECODE_STEPS,
    GPU_CONFIG,
    GPU_SIZES,
    Engine,
    direct,
    gpu_spec,
    prompts,
    rel_err,
)

import compiled_attn as ca  # noqa: E402
from compiled_attn.backends.torch_sdpa import GRAPH_DECODE_ENV  # noqa: E402
from compiled_attn.graphs import CUDAGraphRunner  # noqa: E402
from compiled_attn.models.llama import allocate_kv_caches, build_model  # noqa: E402
from compiled_attn.ops import flex_decode  # noqa: E402

BATCHES = (1, 3, 8, 13)  # test_graph_decode_matches_eager_teacher_forced's


def teacher_steps(engine: Engine) -> tuple[list[dict[str, list[int]]], list[torch.Tensor]]:
    """The reference's steps (prompts, then DECODE_STEPS decodes fed its own greedy tokens) and
    logits (fp32)."""
    steps, logits = [], []
    for batch in BATCHES:
        step = prompts(batch, seed=batch, vocab=GPU_CONFIG.vocab_size, hi=40)
        for _ in range(DECODE_STEPS + 1):
            out = engine.step(step).float()
            steps.append(step)
            logits.append(out)
            step = {name: [tok] for name, tok in zip(step, out.argmax(-1).tolist(), strict=True)}
    return steps, logits


def replay(engine: Engine, steps: list[dict[str, list[int]]]) -> list[torch.Tensor]:
    return [engine.step(step).float() for step in steps]


def attend_all_pages(query, kv_cache, mask, scale, kernel_options):
    """Diagnostic: flex over every page, the last one masked to its live keys (NaN-unsafe)."""
    n, heads, head_size = query.shape
    blocks, block_size, kv_heads, _ = kv_cache.shape[1:]
    k, v = (kv_cache[i].view(1, blocks * block_size, kv_heads, head_size).transpose(1, 2) for i in (0, 1))
    last_len = mask.last_len

    def live(b, h, q_idx, kv_idx):
        return kv_idx % block_size < last_len[b]

    last = F.pad(mask.last_page.to(torch.int32).view(n, 1, 1, 1), (0, blocks - 1))
    full = mask.blocks.kv_num_blocks
    bm = BlockMask.from_kv_blocks(torch.ones_like(full), last, full, mask.blocks.kv_indices,
                                  BLOCK_SIZE=(flex_decode.Q_BLOCK, block_size), mask_mod=live,
                                  seq_lengths=(1, blocks * block_size), compute_q_blocks=False)
    out = flex_attention(query.unsqueeze(2), k, v, block_mask=bm, scale=scale, enable_gqa=True,
                         kernel_options=kernel_options)
    return out.squeeze(2)


def graphed(name: str, model: torch.nn.Module, spec: ca.AttentionSpec, zero: bool = False) -> Engine:
    caches = allocate_kv_caches(GPU_CONFIG, ca.get_attn_backend(name, spec), spec)
    if zero:
        for c in caches:
            c.zero_()
    runner = CUDAGraphRunner(model, ca.get_attn_backend(name, spec), spec, caches, capture_sizes=GPU_SIZES,
                             max_batch_size=max(GPU_SIZES), progress=False)
    runner.capture()
    return Engine(spec, runner.run, backend_name=name)


def summary(name: str, got: list[torch.Tensor], eager: list[torch.Tensor], fp32: list[torch.Tensor]) -> str:
    agree_e = agree_f = total = 0
    gaps: list[float] = []
    err_e = err_f = 0.0
    per_batch = DECODE_STEPS + 1
    for i, (g, e, f) in enumerate(zip(got, eager, fp32, strict=True)):
        err_e, err_f = max(err_e, rel_err(g, e)), max(err_f, rel_err(g, f))
        if i % per_batch == 0:  # the prompt step: not counted, as in the test
            continue
        ge, ee, fe = g.argmax(-1), e.argmax(-1), f.argmax(-1)
        agree_e += (ge == ee).sum().item()
        agree_f += (ge == fe).sum().item()
        total += len(ge)
        top2 = e.topk(2, dim=-1).values
        gaps += (top2[:, 0] - top2[:, 1])[ge != ee].tolist()
    gap_text = f"{len(gaps)} flips, largest {max(gaps):.4f}" if gaps else "none"
    return (f"| {name} | {agree_e}/{total} | {agree_f}/{total} | {err_e:.2e} | {err_f:.2e} | {gap_text} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sdpa = "TORCH_SDPA"
    spec = gpu_spec(sdpa)
    spec32 = dataclasses.replace(spec, dtype=torch.float32)
    model = build_model(GPU_CONFIG, seed=0, backend=sdpa, dtype=torch.bfloat16, device="cuda")
    model32 = build_model(GPU_CONFIG, seed=0, backend=sdpa, dtype=torch.float32, device="cuda")
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    backend = ca.get_attn_backend(sdpa)
    steps, eager = teacher_steps(Engine(spec, direct(model, allocate_kv_caches(GPU_CONFIG, backend, spec))))
    fp32 = replay(Engine(spec32, direct(model32, allocate_kv_caches(GPU_CONFIG, backend, spec32))), steps)
    rows = [summary("eager bf16 (TORCH_SDPA)", eager, eager, fp32)]
    with unittest.mock.patch.dict(os.environ, {GRAPH_DECODE_ENV: "gather"}):
        rows.append(summary("graph, gather", replay(graphed(sdpa, model, spec), steps), eager, fp32))
    with unittest.mock.patch.dict(os.environ, {GRAPH_DECODE_ENV: "flex"}):
        rows.append(summary("graph, flex (NaN-safe)", replay(graphed(sdpa, model, spec), steps), eager, fp32))
        nan_safe = flex_decode.attend
        flex_decode.attend = attend_all_pages
        flex_decode.compiled_attend.cache_clear()
        try:
            rows.append(summary("graph, flex-all (zeroed cache)",
                                replay(graphed(sdpa, model, spec, zero=True), steps), eager, fp32))
        finally:  # later flex compiles in this process get the product path back
            flex_decode.attend = nan_safe
            flex_decode.compiled_attend.cache_clear()
    fi_spec = gpu_spec("FLASHINFER")
    try:
        ca.get_attn_backend("FLASHINFER", fi_spec)
    except (ca.BackendUnavailableError, NotImplementedError) as e:
        rows.append(f"| FLASHINFER | unavailable: {e} | | | | |")
    else:
        fi_model = build_model(GPU_CONFIG, seed=0, backend="FLASHINFER", dtype=torch.bfloat16, device="cuda")
        fi_caches = allocate_kv_caches(GPU_CONFIG, ca.get_attn_backend("FLASHINFER", fi_spec), fi_spec)
        fi_eager = replay(Engine(fi_spec, direct(fi_model, fi_caches), backend_name="FLASHINFER"), steps)
        rows.append(summary("FLASHINFER eager", fi_eager, eager, fp32))
        fi_graph = replay(graphed("FLASHINFER", fi_model, fi_spec), steps)
        rows.append(summary("FLASHINFER graph", fi_graph, eager, fp32))
        rows.append(summary("FLASHINFER graph vs its eager", fi_graph, fi_eager, fp32))
    table = "\n".join(["| engine | top-1 = eager bf16 | top-1 = fp32 | max rel err vs eager | vs fp32 | "
                       "the reference's top-1 - top-2 gap at the disagreements |", "|---|---|---|---|---|---|", *rows])
    print(table)
    if args.out:
        with open(os.path.join(args.out, "decode-agreement.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
