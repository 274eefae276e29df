"""`python -m compiled_attn bench`: every suite in one process, tables printed, JSON written."""

from __future__ import annotations

import json
import logging
import os
import time
from types import ModuleType

import torch
from tqdm import tqdm

from compiled_attn.backends.flashinfer import FlashInferBackend
from compiled_attn.backends.xformers import XFormersBackend
from compiled_attn.bench import (
    ceilings,
    compile_bench,
    decode_flashinfer,
    decode_loop,
    decode_xformers,
    e2e,
    graphs_bench,
    overhead,
    piecewise_bench,
)
from compiled_attn.bench.compiles import compile_counts, compiles_line, counts_since
from compiled_attn.bench.plots import write_plots
from compiled_attn.bench.report import print_table
from compiled_attn.bench.timing import card_name, nominal_bandwidth

log = logging.getLogger(__name__)

# (suite, needs CUDA, name of the backend it measures or None): run in this order
SUITES: list[tuple[ModuleType, bool, str | None]] = [
    (ceilings, True, None),
    (overhead, False, None),
    (compile_bench, False, None),
    (decode_flashinfer, True, FlashInferBackend.get_name()),
    (decode_xformers, True, XFormersBackend.get_name()),
    (graphs_bench, True, None),
    (e2e, True, None),
    (decode_loop, True, None),
    (piecewise_bench, True, None),
]


def suite_name(suite: ModuleType) -> str:
    """What `--suite` calls it: the module's own name (e2e, graphs_bench, ...)."""
    return suite.__name__.rsplit(".", 1)[1]


def suite_names() -> list[str]:
    return [suite_name(s) for s, _, _ in SUITES]


def seconds_line(seconds: dict[str, float]) -> str:
    """`suite seconds: ceilings 0.6, overhead 10.8; total 11.4` from the suites' wall seconds."""
    parts = ", ".join(f"{module.rsplit('.', 1)[-1]} {s:.1f}" for module, s in seconds.items())
    return f"suite seconds: {parts}; total {sum(seconds.values()):.1f}"


def show_rows_as_measured() -> None:
    """The long suites log each row as they measure it, so that a run stopped at its time limit
    shows how far its last suite got: to stderr with the time, unless logging is configured."""
    bench_log = logging.getLogger("compiled_attn.bench")
    if not bench_log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        bench_log.addHandler(handler)
        bench_log.setLevel(logging.INFO)


def chosen_suites(backends: list[str] | None, suites: list[str] | None) -> list:
    """The suite modules a run with these selections measures here: those of the named suites
    (all by default) that run on this machine (some need CUDA) and that are tied to one of the
    named backends or to none (a suite over every backend measures each one available)."""
    cuda = torch.cuda.is_available()
    wanted = {b.upper() for b in backends} if backends else None
    return [s for s, needs_cuda, b in SUITES
            if (cuda or not needs_cuda) and (wanted is None or b is None or b in wanted)
            and (suites is None or suite_name(s) in suites)]


def run_bench(*, backends: list[str] | None, quick: bool, out: str, suites: list[str] | None = None) -> int:
    show_rows_as_measured()
    chosen = chosen_suites(backends, suites)
    seconds: dict[str, float] = {}  # wall time per suite, by its results' key
    compiles: dict[str, dict[str, float]] = {}  # what each suite compiled (bench/compiles.py), by the same key
    results: dict[str, object] = {"card": card_name(), "nominal_bw": nominal_bandwidth() or 0, "suite seconds": seconds,
                                  "suite compiles": compiles}
    failed = 0
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bench-results.json" if suites is None else f"bench-results-{'-'.join(suites)}.json")
    for suite in tqdm(chosen, desc="bench suites"):
        module = suite.__name__  # the results' key
        start, compiled_before = time.perf_counter(), compile_counts()
        rows: list[dict] | str
        try:
            rows = suite.run(quick)
        except Exception as e:  # a broken suite must not hide the others' numbers
            log.exception("suite %s failed", module)
            rows = f"FAILED: {type(e).__name__}: {e}"
            failed += 1
        results[module] = rows
        seconds[module] = round(time.perf_counter() - start, 1)
        compiles[module] = counts_since(compiled_before)
        if isinstance(rows, list):
            print(f"\n== {module} ({card_name()}, {seconds[module]:.0f} s)")
            print_table(rows)
        with open(path, "w") as f:  # after every suite: a run cut off by a timeout keeps what it measured
            json.dump(results, f, indent=1, default=str)
    print(seconds_line(seconds))  # where the run's time went, in one line under the tables
    print(compiles_line(compiles))  # and how much of it compiling (traces) and whether the caches hit
    try:
        for path in write_plots(results, out):
            print(f"plot: {path}")
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install 'compiled_attn[bench]')")
    return 1 if failed else 0
