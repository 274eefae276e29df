"""Coordinate-descent results kept across processes on torch 2.11.

Inductor's FX graph cache stores a compiled graph's Triton kernels as static launchers, and a
later process that loads them asks the autotune cache for each kernel's best config
(`CachingAutotuner.recheck_autotune_cache`). torch 2.11 uses the answer only for a kernel that
had several heuristic configs, and where the best is one of the configs it loaded, leaves that
config without its "found by coordinate descent" mark (a Triton `Config` forgets attributes of
its own when unpickled). So nearly every kernel that coordinate descent tuned is tuned again
at its first launch in every new process: 30-99 s of warm decode-loop benches on an H100
(BENCHMARKS.md, twenty-second session), and a new draw of kernel timings each start. PyTorch
issue 172819; torch 2.12 applies the cached config for any number of configs and marks it.
`keep_tuned_configs` gives torch 2.11 that behaviour.

Left as torch has them (a review against 2.11's source; not yet measured which matter): kernels
compiled in worker processes come back unpickled and unmarked (an FX-cache miss, or a kernel
that cannot launch statically); an FX entry written while the autotune cache already held the
kernel's best stores that config alone, whose hash then misses; a reduction that gains a
halved-block config at load (`_dynamic_scale_rblock`) picks between two configs and saves the
winner unmarked, so the next process tunes it again. `scripts/autotune_probe.py` lists what a
warm process still tunes and what the autotune cache said for each.
"""

from __future__ import annotations

from typing import Any

import torch

_FIXED_IN = (2, 12)


def keep_tuned_configs(torch_version: str = torch.__version__) -> bool:
    """Make this process's Inductor reuse cached coordinate-descent results when it loads a
    graph from the FX cache (torch < 2.12; nothing to do on later versions). Idempotent;
    returns whether torch needed it. Called by `CUDAGraphRunner(compile=True)` and the decode-
    loop bench's peer; call it before loading a graph compiled with
    `options={"coordinate_descent_tuning": True}` yourself."""
    if torch.torch_version.TorchVersion(torch_version) >= _FIXED_IN:
        return False
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner  # only where torch needs the fix

    CachingAutotuner.recheck_autotune_cache = recheck_autotune_cache
    return True


def recheck_autotune_cache(self: Any, reload_kernel_from_src: Any) -> None:
    """`CachingAutotuner.recheck_autotune_cache` as torch 2.12 has it: a loaded static autotuner
    whose autotune cache holds a best config keeps only that config, compiled if it is not
    among the loaded ones, marked as coordinate descent's when it was (so `run` does not tune
    it again)."""
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.runtime_utils import triton_config_to_hashable

    configs = [result.config for result in self.compile_results]
    cached, _, info = triton_heuristics.check_autotune_cache(configs, self.filename, self.inductor_meta)
    self.autotune_cache_info = info
    if info.get("autotune_cache_state") != "hit":
        return
    (best,) = cached
    by_coordesc = getattr(best, "found_by_coordesc", False)
    key = triton_config_to_hashable(best)
    for result in self.compile_results:
        if triton_config_to_hashable(result.config) == key:
            result.config.found_by_coordesc = by_coordesc
            self.compile_results = [result]
            return
    if self.fn.fn is None:  # dropped when the autotuner was pickled
        self.fn = reload_kernel_from_src().fn
    self.compile_results = [self._precompile_config(best)]
