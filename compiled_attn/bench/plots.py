"""PNG plots of a bench run: decode latency vs batch, and achieved fraction of nominal HBM bandwidth.

    python -m compiled_attn.bench.plots RESULTS.json [RESULTS.json ...] --out docs/
"""

from __future__ import annotations

import argparse
import json
import os

from compiled_attn.cli import output_dir

DECODE_SUITES = ("compiled_attn.bench.decode_flashinfer", "compiled_attn.bench.decode_xformers")


def decode_series(results: dict) -> dict[str, list[tuple[int, int, float, float]]]:
    """label -> [(batch, ctx, us, hbm_frac)] for every decode-kernel row in `results`."""
    series: dict[str, list[tuple[int, int, float, float]]] = {}
    for suite in DECODE_SUITES:
        rows = results.get(suite)
        if not isinstance(rows, list):
            continue
        for r in rows:
            # prefill rows and the page-size sweep are tables, not curves over the decode grid
            if "batch" not in r or "ctx" not in r or not str(r.get("suite", "decode")).startswith("decode"):
                continue
            backend = "FlashInfer" if "flashinfer" in suite else "xFormers"
            label = r.get("impl") or r.get("variant")
            label = f"{backend}: {label}" if "sdpa" not in label else "torch SDPA, static cache"
            us = r.get("us", r.get("time_us"))
            series.setdefault(label, []).append((r["batch"], r["ctx"], us, r.get("hbm_frac")))
    return series


def write_plots(results: dict, out: str) -> list[str]:
    """Write decode-latency.png and decode-bandwidth.png under `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = decode_series(results)
    if not series:
        return []
    os.makedirs(out, exist_ok=True)
    card = results.get("card", "")
    contexts = sorted({ctx for pts in series.values() for _, ctx, _, _ in pts})
    paths = []
    for name, index, ylabel, log in (("decode-latency.png", 2, "time per decode step (us)", True),
                                     ("decode-bandwidth.png", 3, "KV bytes / time / nominal HBM", False)):
        fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
        for ax, ctx in zip(axes[0], contexts, strict=True):
            for label, pts in sorted(series.items()):
                xs = [(p[0], p[index]) for p in pts if p[1] == ctx and p[index] is not None]
                if xs:
                    ax.plot([b for b, _ in xs], [y for _, y in xs], marker="o", label=label)
            ax.set_xscale("log", base=2)
            if log:
                ax.set_yscale("log")
            else:
                ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
                ax.set_ylim(0, 1.05)
            ax.set_title(f"ctx {ctx}, 32 q / 8 kv heads, d 128, bf16")
            ax.set_xlabel("batch")
            ax.set_ylabel(ylabel)
        labelled = {}
        for ax in axes[0]:  # some series appear at one context only: merge every panel's entries
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                labelled.setdefault(label, handle)
        axes[0][0].legend(list(labelled.values()), list(labelled), fontsize=7)
        fig.suptitle(f"decode attention, CUDA-graph replay ({card})")
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+", type=argparse.FileType("r"))
    parser.add_argument("--out", type=output_dir, default="docs")
    args = parser.parse_args()
    merged: dict = {}
    for f in args.results:
        with f:
            merged.update(json.load(f))
    for path in write_plots(merged, args.out):
        print(path)


if __name__ == "__main__":
    main()
