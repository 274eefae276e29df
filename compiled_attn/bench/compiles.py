"""What the bench compiled, from torch's process-wide compile counters (never reset, not even by
`torch._dynamo.reset()`): a suite's share is the difference across it.

A warm Inductor cache saves Inductor's work only: every graph is still traced by Dynamo (and,
where AOTAutograd's cache misses, by AOTAutograd), so `graphs` and `compile s` say where a
`--quick` run's time goes, and the caches' outcomes say whether "warm" was warm.
"""

from __future__ import annotations

from torch._dynamo.utils import compilation_time_metrics, counters

# name -> (counter group, key prefix) of the caches Inductor's compiles go through
CACHES = {"fx cache": ("inductor", "fxgraph_cache_"), "aot cache": ("aot_autograd", "autograd_cache_")}
OUTCOMES = ("hit", "miss", "bypass")


def compile_counts() -> dict[str, float]:
    """Totals so far in this process: `graphs` Dynamo compiled (one trace of the step each),
    `compile s` spent in Dynamo's compiles (trace and backend), and each cache's hits, misses and
    bypasses."""
    counts = {"graphs": counters["stats"]["unique_graphs"],
              "compile s": sum(compilation_time_metrics.get("_compile.compile_inner", ()))}
    for cache, (group, prefix) in CACHES.items():
        for outcome in OUTCOMES:
            counts[f"{cache} {outcome}"] = counters[group][prefix + outcome]
    return counts


def counts_since(before: dict[str, float]) -> dict[str, float]:
    """`compile_counts()` minus `before` (an earlier `compile_counts()`)."""
    return {name: round(n - before[name], 1) for name, n in compile_counts().items()}


def compiles_line(compiles: dict[str, dict[str, float]]) -> str:
    """`suite compiles: e2e 1 graphs 61 s (fx cache 1 hit, 0 miss, 0 bypass), ...` for the suites
    that compiled, from their `counts_since`."""
    parts = [f"{module.rsplit('.', 1)[-1]} {c['graphs']:.0f} graphs {c['compile s']:.0f} s "
             f"(fx cache {c['fx cache hit']:.0f} hit, {c['fx cache miss']:.0f} miss, {c['fx cache bypass']:.0f} bypass)"
             for module, c in compiles.items() if c["graphs"]]
    return f"suite compiles: {', '.join(parts) or 'none'}"
