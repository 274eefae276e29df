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

Two more 2.11 paths re-tuned a kernel in every process, and are closed here too (found by a
review against 2.11's source): an FX entry written while the autotune cache already held the
kernel's best keeps that config alone, and its hash then misses the cache entry (written under
the hash of the heuristic configs, which the kernel's own cache handle still has); and a
reduction given a halved-block config at load (`_dynamic_scale_rblock`) benchmarks the two
and saves the winner unmarked, so the next process tunes it again (coordinate descent has
tried that block already). Left as torch has it: kernels compiled in worker processes come
back unmarked (an FX-cache miss, or a kernel that cannot launch statically).
`scripts/autotune_probe.py` lists what a warm process still tunes and what the autotune cache
said for each.

From 2.12 torch's own method stays, and it lacks the cache-handle fallback above: a kernel whose
FX entry kept only its best config is tuned again in each new process (seen on CPU with torch
2.13 and a stand-in autotuner; not measured on a GPU).
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
    it again). Also: the kernel's own cache handle is asked when the loaded configs' hash
    misses, and a coordinate-descent config gets no halved-block rival at load."""
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.runtime_utils import triton_config_to_hashable

    configs = [result.config for result in self.compile_results]
    cached, _, info = triton_heuristics.check_autotune_cache(configs, self.filename, self.inductor_meta)
    # an entry written with the best config alone: the kernel's cache handle keeps the hash of the
    # heuristic configs, under which the autotune cache holds the kernel's entry
    handle = getattr(self.save_cache_hook, "__self__", None)
    if (info.get("autotune_cache_state") == "miss" and handle is not None
            and handle.configs_hash != triton_heuristics.hash_configs(configs)):
        best = handle.read_best(self.inductor_meta, configs)
        if best is not None:
            cached = [best]
            info = {"autotune_cache_state": "hit", "best_config": triton_config_to_hashable(best),
                    "via": "the kernel's cache handle"}
    self.autotune_cache_info = info
    if info.get("autotune_cache_state") != "hit":
        return
    (best,) = cached
    by_coordesc = getattr(best, "found_by_coordesc", False)
    blocks = [k for k in best.kwargs if k.startswith("R")]  # what _dynamic_scale_rblock halves: the largest
    if by_coordesc and blocks and max(blocks, key=best.kwargs.__getitem__) in ("R0_BLOCK", "R1_BLOCK"):
        # coordinate descent tried it halved: 2.11 would benchmark that rival and save the winner unmarked
        self.inductor_meta = {**self.inductor_meta, "dynamic_scale_rblock": False}
    key = triton_config_to_hashable(best)
    for result in self.compile_results:
        if triton_config_to_hashable(result.config) == key:
            result.config.found_by_coordesc = by_coordesc
            self.compile_results = [result]
            return
    if self.fn.fn is None:  # dropped when the autotuner was pickled
        self.fn = reload_kernel_from_src().fn
    self.compile_results = [self._precompile_config(best)]
