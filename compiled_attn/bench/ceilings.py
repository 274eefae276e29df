"""The card's ceilings, measured first in a run: read bandwidth and bf16 matmul rate.

Nominal HBM bandwidth is the denominator of every fraction in the reports; these measured
ceilings say what a kernel really reaches on this card (on an H200 a graph-captured copy moved
less than SDPA decode later read, so the report quotes both).
"""

from __future__ import annotations

import torch

from compiled_attn.bench.timing import card_name, graph_time_us, nominal_bandwidth


def run(quick: bool = False) -> list[dict]:
    gib = 1 if quick else 2
    n = gib * (1 << 30) // 2  # bf16 elements
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    nominal = nominal_bandwidth() or float("nan")
    rows = []
    copy_us = graph_time_us(lambda: dst.copy_(src), graph_iters=5)
    read_us = graph_time_us(lambda: src.amax(), graph_iters=5)
    nbytes = src.nbytes
    src = dst = None  # free 2-4 GiB before the matmul inputs
    for what, moved, us in (("copy_ (read + write)", 2 * nbytes, copy_us), ("amax (read)", nbytes, read_us)):
        bw = moved / (us * 1e-6)
        rows.append({"card": card_name(), "ceiling": what, "GB/s": bw / 1e9, "of nominal": bw / nominal})
    size = 4096 if quick else 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    mm_us = graph_time_us(lambda: a @ b, graph_iters=5)
    rows.append({"card": card_name(), "ceiling": f"bf16 matmul {size}^3 (random data)",
                 "TFLOP/s": 2 * size**3 / (mm_us * 1e-6) / 1e12})
    return rows
