"""The Triton kernels Inductor generates for one decode step: ours against the peer's.

The 8B shape cut to two layers, one batch size; the pointwise kernels' source too.

At batch 1 (H100, thirteenth session) our layer ran one pointwise kernel more than the peer's
besides the cache write (`triton_poi_fused__to_copy_flashinfer_attention_kv_cache_update_mm_s...`,
1.1 us), and not at batch 8. This prints, per side, every generated kernel's name, and the source
of each pointwise kernel whose name mentions our ops, the peer's SDPA / index_put or a `cat` (the
rope kernels: since the ops are `flexible_layout`, ours no longer carry the ops' names). With
--out it also writes our side's whole output code (buffers, launches).

    python scripts/inductor_layer_kernels.py [--batch 1] [--ctx 1024] [--out DIR] [--no-peer] [--peer-sdpa math]

The peer runs PyTorch's SDPA dispatch by default, its faster choice at every point measured (gpt-fast
pins the math kernel, which Inductor decomposes into Triton kernels of its own: `--peer-sdpa math`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

from compiled_attn.bench.decode_loop import FASTER_PEER_SDPA, PEER_SDPA, PagedLoop, peer_compiling, peer_loop
from compiled_attn.models.llama import LlamaConfig, build_model
from compiled_attn.registry import BACKEND_CLASSES

KERNEL_DEF = re.compile(r"^def (triton_\w+)\(", re.MULTILINE)
INTERESTING = ("flashinfer_attention", "kv_cache_update", "scaled_dot_product", "index_put", "_cat_")


def kernels(codes: list[str]) -> dict[str, str]:
    """Every `triton_*` kernel defined in Inductor's output code: name -> its source."""
    found = {}
    for code in codes:
        starts = [(m.start(), m.group(1)) for m in KERNEL_DEF.finditer(code)]
        for (start, name), end in zip(starts, [s for s, _ in starts[1:]] + [len(code)], strict=True):
            found[name] = code[start:end].split("\n\n\n")[0]
    return found


def report(side: str, found: dict[str, str]) -> str:
    lines = [f"== {side}: {len(found)} Triton kernels"] + [f"  {name}" for name in sorted(found)]
    for name in sorted(found):
        if name.startswith("triton_poi") and any(op in name for op in INTERESTING):
            lines += [f"-- {name}", found[name]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-peer", action="store_true", help="ours only (the peer's tuned compile takes a minute)")
    parser.add_argument("--peer-sdpa", choices=tuple(PEER_SDPA), default=FASTER_PEER_SDPA)
    args = parser.parse_args()
    config = dataclasses.replace(LlamaConfig.llama3_8b(), num_layers=2)
    model = build_model(config, seed=0, backend="FLASHINFER", dtype=torch.bfloat16, device="cuda", init_device="cuda")
    backend = BACKEND_CLASSES()["FLASHINFER"]
    _, ours = run_and_get_code(lambda: PagedLoop(model, backend, args.batch, args.ctx, {"compile": True}))
    reports = [report("ours (CUDAGraphRunner compile=True)", kernels(ours))]
    if not args.no_peer:
        with peer_compiling():
            loop = peer_loop(model, args.batch, args.ctx, args.peer_sdpa)
            _, peer = run_and_get_code(lambda: loop(3, True))
        reports.append(report(f"peer (gpt-fast, {args.peer_sdpa} SDPA)", kernels(peer)))
    text = "\n\n".join(reports)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"layer-kernels-b{args.batch}.txt").write_text(text + "\n")
        (args.out / f"ours-output-code-b{args.batch}.py").write_text("\n\n".join(ours))  # buffers, launches


if __name__ == "__main__":
    main()
