"""What the bench compiled, from torch's process-wide compile counters: a suite's share is the
difference across it. Dynamo's counters survive `torch._dynamo.reset()`, its compile times do not:
the bench resets through `reset_dynamo`, which keeps them.

A warm Inductor cache saves Inductor's work only: every graph is still traced by Dynamo (and,
where AOTAutograd's cache misses, by AOTAutograd), so `graphs` and `compile s` say where a
`--quick` run's time goes, and the caches' outcomes say whether "warm" was warm. The compile
seconds are split into phases (PHASES) so that a warm run's remaining compile time can be put
on the trace, the backend's codegen or loading what the caches held.
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import compilation_time_metrics, counters

# name -> (counter group, key prefix) of the caches Inductor's compiles go through
CACHES = {"fx cache": ("inductor", "fxgraph_cache_"), "aot cache": ("aot_autograd", "autograd_cache_")}
OUTCOMES = ("hit", "miss", "bypass")
COMPILE_KEY = "_compile.compile_inner"
# column -> Dynamo's timing keys (`compilation_time_metrics`), summed: the whole compile, of it the
# backend (AOTAutograd and Inductor: the rest is Dynamo's trace and guards), of that Inductor's
# codegen (a cache miss) and the loading of compiled modules and waiting for their kernels (hit or
# miss); and, outside the compiles, Inductor's runtime autotuning (a kernel's configs benchmarked,
# coordinate descent included, at its first launch where no cached choice fits: a warm H100 run's
# profile had 14 s of it)
PHASES = {"compile s": (COMPILE_KEY,), "backend s": ("OutputGraph.call_user_compiler",),
          "codegen s": ("fx_codegen_and_compile",), "load s": ("PyCodeCache.load_by_key_path",),
          "kernel wait s": ("async_compile.wait",),
          "autotune s": ("CachingAutotuner.benchmark_all_configs", "CachingAutotuner.coordinate_descent_tuning",
                         "CachingAutotuner.combo_sequential_autotune")}
_seconds_before_resets = dict.fromkeys(PHASES, 0.0)  # what torch._dynamo.reset() cleared, by column


def _phase_seconds(column: str) -> float:
    return sum(sum(compilation_time_metrics.get(key, ())) for key in PHASES[column])


def reset_dynamo() -> None:
    """`torch._dynamo.reset()` (as a fresh process: no compiled code, no traces), keeping the
    compile seconds that it clears."""
    for column in PHASES:
        _seconds_before_resets[column] += _phase_seconds(column)
    torch._dynamo.reset()


def compile_counts() -> dict[str, float]:
    """Totals so far in this process: `graphs` Dynamo compiled (one trace of the step each), the
    seconds of each of PHASES (`compile s`: Dynamo's compiles, trace and backend), and each
    cache's hits, misses and bypasses."""
    counts = {"graphs": counters["stats"]["unique_graphs"]}
    counts |= {column: _seconds_before_resets[column] + _phase_seconds(column) for column in PHASES}
    for cache, (group, prefix) in CACHES.items():
        for outcome in OUTCOMES:
            counts[f"{cache} {outcome}"] = counters[group][prefix + outcome]
    return counts


def counts_since(before: dict[str, float]) -> dict[str, float]:
    """`compile_counts()` minus `before` (an earlier `compile_counts()`)."""
    return {name: round(n - before[name], 1) for name, n in compile_counts().items()}


def compiles_line(compiles: dict[str, dict[str, float]]) -> str:
    """`suite compiles: e2e 1 graphs 61 s (trace 9 s; fx cache 1 hit, 0 miss, 0 bypass) then
    autotune 2 s, ...` for the suites that compiled, from their `counts_since`: trace = compile s -
    backend s; autotune: Inductor's runtime autotuning, outside the compiles."""
    parts = [f"{module.rsplit('.', 1)[-1]} {c['graphs']:.0f} graphs {c['compile s']:.0f} s "
             f"(trace {c['compile s'] - c['backend s']:.0f} s; "
             f"fx cache {c['fx cache hit']:.0f} hit, "
             f"{c['fx cache miss']:.0f} miss, {c['fx cache bypass']:.0f} bypass) then autotune {c['autotune s']:.0f} s"
             for module, c in compiles.items() if c["graphs"]]
    return f"suite compiles: {', '.join(parts) or 'none'}"
