"""Reduce a profiler's kernel records of a few decode steps to a per-layer table.

A kernel belongs to the layers when it runs at least once per layer per step, or (with several
layers) more than once per step: at batch 1 Inductor compiles one layer's reduction under
several names, each serving some of the layers (16 + 16 of 32, or 15 + 1 + 16). The rest
(embedding, final norm, LM head, sampling) and the copies and fills (`Memcpy` / `Memset`: the
step's metadata, however many) are per-step work.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float


def cuda_kernels(prof) -> list[Kernel]:
    """The device kernels (and memcpy / memset) a `torch.profiler.profile` recorded, in start order."""
    from torch.autograd import DeviceType

    out = [Kernel(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == DeviceType.CUDA]
    return sorted(out, key=lambda k: k.start_us)


def per_layer_table(kernels: list[Kernel], steps: int, num_layers: int) -> dict:
    """rows: per kernel name its calls per step, mean us per call, us per layer (its us per step
    over `num_layers`; None for per-step kernels); totals: kernel us per layer and per step, the
    span of the steps and the GPU-busy fraction (summed kernel time / span from the first kernel
    start to the last end).
    """
    if not kernels:
        raise ValueError("no CUDA kernels were recorded (profiler without CUPTI?)")
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k.name].append(k.end_us - k.start_us)
    rows = []
    for name, times in by_name.items():
        calls = len(times) / steps
        per_call = sum(times) / len(times)
        copy = name.startswith(("Memcpy", "Memset"))
        in_layers = not copy and (calls >= num_layers or (num_layers > 1 and round(calls) >= 2))
        rows.append({
            "kernel": name,
            "where": "layer" if in_layers else "step",
            "calls/step": calls,
            "us/call": per_call,
            "us/layer": per_call * calls / num_layers if in_layers else None,
            "us/step": per_call * calls,
        })
    rows.sort(key=lambda r: (r["where"] != "layer", -r["us/step"]))
    span = max(k.end_us for k in kernels) - kernels[0].start_us
    busy = sum(k.end_us - k.start_us for k in kernels)
    layer_us = sum(r["us/layer"] for r in rows if r["us/layer"] is not None)
    return {
        "rows": rows,
        "kernels/layer": sum(r["calls/step"] for r in rows if r["where"] == "layer") / num_layers,
        "us/layer": layer_us,
        "kernel us/step": busy / steps,
        "span us/step": span / steps,
        "gpu busy": busy / span,
    }


def markdown(table: dict, title: str, width: int = 70) -> str:
    """The table as markdown: per-layer kernels, then per-step ones, then the totals."""
    lines = [f"**{title}**: {table['kernels/layer']:.0f} kernels / layer, {table['us/layer']:.1f} us / layer; "
             f"{table['kernel us/step']:.0f} us of kernels / step in a {table['span us/step']:.0f} us step "
             f"(GPU busy {table['gpu busy']:.1%} of the profiled span)", "",
             "| kernel | where | calls / step | us / call | us / layer |", "|---|---|---|---|---|"]
    for r in table["rows"]:
        name = r["kernel"] if len(r["kernel"]) <= width else r["kernel"][: width - 3] + "..."
        per_layer = f"{r['us/layer']:.2f}" if r["us/layer"] is not None else f"({r['us/step']:.1f} / step)"
        lines.append(f"| `{name}` | {r['where']} | {r['calls/step']:.0f} | {r['us/call']:.2f} | {per_layer} |")
    return "\n".join(lines)
