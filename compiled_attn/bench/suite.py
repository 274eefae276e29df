"""`python -m compiled_attn bench`: every suite in one process, tables printed, JSON written."""

from __future__ import annotations

import importlib
import json
import logging
import os
import time

import torch
from tqdm import tqdm

from compiled_attn.bench.timing import card_name, nominal_bandwidth

log = logging.getLogger(__name__)

# (module, needs CUDA, backend it measures or None): run in this order
SUITES = [
    ("compiled_attn.bench.ceilings", True, None),
    ("compiled_attn.bench.overhead", False, None),
    ("compiled_attn.bench.compile_bench", False, None),
    ("compiled_attn.bench.decode_flashinfer", True, "FLASHINFER"),
    ("compiled_attn.bench.decode_xformers", True, "XFORMERS"),
    ("compiled_attn.bench.graphs_bench", True, None),
    ("compiled_attn.bench.e2e", True, None),
    ("compiled_attn.bench.decode_loop", True, None),
]


def run_bench(*, backends: list[str] | None, quick: bool, out: str, suites: list[str] | None = None) -> int:
    from compiled_attn.__main__ import print_table

    cuda = torch.cuda.is_available()
    wanted = {b.upper() for b in backends} if backends else None
    chosen = [(m, b) for m, needs_cuda, b in SUITES
              if (cuda or not needs_cuda) and (wanted is None or b is None or b in wanted)
              and (suites is None or m.rsplit(".", 1)[1] in suites)]
    results: dict[str, list[dict] | str] = {"card": card_name(), "nominal_bw": nominal_bandwidth() or 0}
    failed = 0
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bench-results.json" if suites is None else f"bench-results-{'-'.join(suites)}.json")
    for module, _ in tqdm(chosen, desc="bench suites"):
        start = time.perf_counter()
        try:
            results[module] = importlib.import_module(module).run(quick)
        except Exception as e:  # a broken suite must not hide the others' numbers
            log.exception("suite %s failed", module)
            results[module] = f"FAILED: {type(e).__name__}: {e}"
            failed += 1
        results.setdefault("suite seconds", {})[module] = seconds = round(time.perf_counter() - start, 1)
        if isinstance(results[module], list):
            print(f"\n== {module} ({card_name()}, {seconds:.0f} s)")
            print_table(results[module])
        with open(path, "w") as f:  # after every suite: a run cut off by a timeout keeps what it measured
            json.dump(results, f, indent=1, default=str)
    try:
        from compiled_attn.bench.plots import write_plots

        for path in write_plots(results, out):
            print(f"plot: {path}")
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install 'compiled_attn[bench]')")
    return 1 if failed else 0
