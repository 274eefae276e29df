"""inductor_cache: a new process reuses the coordinate-descent results of the graphs it loads from
Inductor's FX cache (torch 2.11 tuned them again: PyTorch issue 172819).

The recheck's logic runs here on stand-in autotuners (any torch, no Triton); the GPU test runs a
compile=True runner in four processes that share one cache (a cold one, two warm, one warm with
torch's own recheck) and counts the configs each times.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from reference import run_python

from compiled_attn import inductor_cache


@dataclasses.dataclass
class Config:  # what triton_config_to_hashable reads of a Triton Config (which compares by value too)
    kwargs: dict
    num_warps: int
    num_stages: int = 1


class Autotuner:
    """The attributes of a loaded static CachingAutotuner that the recheck reads and sets."""

    def __init__(self, configs: list[Config], fn_loaded: bool = True) -> None:
        self.compile_results = [SimpleNamespace(config=c) for c in configs]
        self.filename, self.inductor_meta = "/cache/ab/kernel.py", {"coordinate_descent_tuning": True}
        self.fn = SimpleNamespace(fn=object() if fn_loaded else None)
        self.save_cache_hook = None  # or the bound `save` of the kernel's AutotuneCache
        self.compiled: list[Config] = []

    def _precompile_config(self, cfg: Config) -> SimpleNamespace:
        self.compiled.append(cfg)
        return SimpleNamespace(config=cfg)


def random_config(rng: random.Random) -> Config:
    return Config({"XBLOCK": rng.choice([1, 2, 4]), "R0_BLOCK": rng.choice([512, 1024, 2048, 4096])},
                  rng.choice([1, 2, 4, 8, 16, 32]))


def with_cache(monkeypatch, answer: Config | None) -> list:
    """check_autotune_cache answering `answer` (a hit) or nothing (a miss); returns its calls."""
    from torch._inductor.runtime import triton_heuristics

    calls = []

    def check(configs, filename, inductor_meta):
        calls.append((list(configs), filename))
        if answer is None:
            return configs, None, {"autotune_cache_state": "miss", "num_configs": len(configs)}
        return [answer], object(), {"autotune_cache_state": "hit", "best_config": "..."}

    monkeypatch.setattr(triton_heuristics, "check_autotune_cache", check)
    return calls


@pytest.mark.parametrize("seed", range(4))
def test_a_single_heuristic_config_gives_way_to_the_cached_coordinate_descent_result(monkeypatch, seed):
    """torch 2.11 kept the one heuristic config here, so `run` tuned again from it."""
    rng = random.Random(seed)
    start = random_config(rng)
    best = Config({**start.kwargs, "R0_BLOCK": start.kwargs["R0_BLOCK"] * 2}, start.num_warps)
    best.found_by_coordesc = True
    tuner = Autotuner([start], fn_loaded=seed % 2 == 0)
    jit = SimpleNamespace(fn=object())  # a Triton JITFunction: its Python function at .fn
    loaded_jit, meta = tuner.fn, tuner.inductor_meta
    calls = with_cache(monkeypatch, best)
    inductor_cache.recheck_autotune_cache(tuner, lambda: SimpleNamespace(fn=jit))
    assert calls == [([start], tuner.filename)]
    assert tuner.compiled == [best] and [r.config for r in tuner.compile_results] == [best]
    assert tuner.compile_results[0].config.found_by_coordesc
    assert tuner.fn is (jit if seed % 2 else loaded_jit)  # reloaded where pickling dropped it
    assert tuner.autotune_cache_info["autotune_cache_state"] == "hit"
    # coordinate descent tried the halved block: no rival config at load (saved unmarked by 2.11)
    assert tuner.inductor_meta == {"coordinate_descent_tuning": True, "dynamic_scale_rblock": False}
    assert meta == {"coordinate_descent_tuning": True}  # a copy: the dict may be the kernel source's


@pytest.mark.parametrize("by_coordesc", [True, False])
def test_a_loaded_config_equal_to_the_cached_one_is_kept_and_marked(monkeypatch, by_coordesc):
    """Several loaded configs, the cached best equal to one of them (another object, as after
    unpickling): that one stays, not compiled again, marked as the cache says."""
    rng = random.Random(7)
    loaded = [random_config(rng) for _ in range(4)]
    loaded = list({(tuple(sorted(c.kwargs.items())), c.num_warps): c for c in loaded}.values())
    pick = loaded[-1]
    best = Config(dict(pick.kwargs), pick.num_warps, pick.num_stages)
    best.found_by_coordesc = by_coordesc
    tuner = Autotuner(loaded)
    with_cache(monkeypatch, best)
    inductor_cache.recheck_autotune_cache(tuner, lambda: pytest.fail("nothing to reload"))
    assert [r.config for r in tuner.compile_results] == [pick] and tuner.compiled == []
    assert pick.found_by_coordesc is by_coordesc
    assert ("dynamic_scale_rblock" in tuner.inductor_meta) is by_coordesc


def test_a_cache_miss_leaves_the_loaded_configs(monkeypatch):
    rng = random.Random(3)
    loaded = [random_config(rng) for _ in range(3)]
    tuner = Autotuner(loaded)
    with_cache(monkeypatch, None)
    inductor_cache.recheck_autotune_cache(tuner, lambda: pytest.fail("nothing to reload"))
    assert [r.config for r in tuner.compile_results] == loaded and tuner.compiled == []
    assert tuner.autotune_cache_info == {"autotune_cache_state": "miss", "num_configs": 3}
    assert not any(hasattr(c, "found_by_coordesc") for c in loaded)


class Handle:
    """A kernel's AutotuneCache as pickled with it: `read_best` under the heuristic configs' hash."""

    def __init__(self, best: Config | None, configs_hash: str = "hash of the heuristic configs") -> None:
        self.best, self.reads, self.configs_hash = best, [], configs_hash

    def read_best(self, inductor_meta: dict, configs: list[Config]) -> Config | None:
        self.reads.append(list(configs))
        return self.best

    def save(self, *args, **kwargs) -> None:
        pytest.fail("the recheck saves nothing")


@pytest.mark.parametrize("in_cache", [True, False])
def test_an_entry_saved_with_the_best_config_alone_reads_it_through_the_kernels_handle(monkeypatch, in_cache):
    """The FX entry holds [best] only (written while the autotune cache had it): its hash misses,
    the kernel's own cache handle (hash of the heuristic configs) still finds the entry."""
    rng = random.Random(11)
    alone = random_config(rng)
    best = Config(dict(alone.kwargs), alone.num_warps, alone.num_stages)
    best.found_by_coordesc = True
    tuner = Autotuner([alone])
    handle = Handle(best if in_cache else None)
    tuner.save_cache_hook = handle.save
    with_cache(monkeypatch, None)
    inductor_cache.recheck_autotune_cache(tuner, lambda: pytest.fail("nothing to reload"))
    assert handle.reads == [[alone]]
    assert [r.config for r in tuner.compile_results] == [alone] and tuner.compiled == []
    assert getattr(alone, "found_by_coordesc", False) is in_cache
    assert tuner.autotune_cache_info["autotune_cache_state"] == ("hit" if in_cache else "miss")


def test_a_miss_under_the_handles_own_hash_is_not_read_twice(monkeypatch):
    from torch._inductor.runtime.triton_heuristics import hash_configs

    loaded = [random_config(random.Random(5))]
    tuner = Autotuner(loaded)
    handle = Handle(None, hash_configs(loaded))
    tuner.save_cache_hook = handle.save
    with_cache(monkeypatch, None)
    inductor_cache.recheck_autotune_cache(tuner, lambda: pytest.fail("nothing to reload"))
    assert handle.reads == [] and tuner.autotune_cache_info["autotune_cache_state"] == "miss"


def test_a_split_reduction_keeps_its_load_time_rival(monkeypatch):
    """`_dynamic_scale_rblock` halves the largest R* argument: RSPLIT, which coordinate descent
    does not tune, keeps its rival."""
    best = Config({"XBLOCK": 1, "R0_BLOCK": 32, "RSPLIT": 64}, 8)
    best.found_by_coordesc = True
    tuner = Autotuner([Config({"XBLOCK": 1, "R0_BLOCK": 16, "RSPLIT": 64}, 8)])
    with_cache(monkeypatch, best)
    inductor_cache.recheck_autotune_cache(tuner, lambda: pytest.fail("nothing to reload"))
    assert tuner.compiled == [best] and "dynamic_scale_rblock" not in tuner.inductor_meta


def test_installed_before_torch_2_12_only(monkeypatch):
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    original = CachingAutotuner.recheck_autotune_cache
    monkeypatch.setattr(CachingAutotuner, "recheck_autotune_cache", original)  # restored after the test
    assert not inductor_cache.keep_tuned_configs("2.12.0")
    assert not inductor_cache.keep_tuned_configs("2.13.0+cpu")
    assert CachingAutotuner.recheck_autotune_cache is original
    for version in ("2.11.0+cu130", "2.12.0a0+git5", "2.11.0"):  # idempotent
        assert inductor_cache.keep_tuned_configs(version)
        assert CachingAutotuner.recheck_autotune_cache is inductor_cache.recheck_autotune_cache


# A fresh process: capture a compile=True runner on a one-layer GPU model; argv[1] "off" leaves
# torch's recheck as it is. Prints how many times Inductor's benchmarker ran (coordinate descent
# and the choice between configs both go through it) and the FX graph cache's hits and misses.
TUNING_PROCESS = """
import dataclasses, json, sys
import torch
from torch._dynamo.utils import counters
import compiled_attn as ca
import test_graphs as t
from compiled_attn.graphs import runner as runner_module
if sys.argv[1] == "off":
    runner_module.keep_tuned_configs = lambda: False
config = dataclasses.replace(t.GPU_CONFIG, num_layers=1)
spec = t.gpu_spec("TORCH_SDPA")
backend = ca.get_attn_backend("TORCH_SDPA", spec)
model = t.build_model(config, seed=0, backend="TORCH_SDPA", dtype=torch.bfloat16, device="cuda")
runner = t.CUDAGraphRunner(model, backend, spec, t.allocate_kv_caches(config, backend, spec), capture_sizes=[1, 2],
                           max_batch_size=2, progress=False, compile=True)
runner.capture()
print(json.dumps({"timed": sum(n for k, n in counters["inductor"].items() if k.startswith("benchmarking.")),
                  "fx hits": counters["inductor"]["fxgraph_cache_hit"],
                  "fx misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def tuning_counts(cache: Path, recheck: str) -> dict:
    """TUNING_PROCESS's counts, in a new Python with `cache` as Inductor's and Triton's cache."""
    out = run_python(TUNING_PROCESS, recheck, env={"TORCHINDUCTOR_CACHE_DIR": str(cache),
                                                   "TRITON_CACHE_DIR": str(cache / "triton")}, timeout=300)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.long(120)
def test_a_new_process_reuses_the_tuned_kernels(tmp_path):
    """The runner's compile tunes its kernels once: later processes on the same cache load the
    graphs from the FX cache and time no config (a third process too: a config saved again
    without its coordinate-descent mark would be tuned again there). A last process with torch
    2.11's own recheck, on the same cache, tunes again: the counts tell the two apart."""
    first = tuning_counts(tmp_path, "on")
    assert first["timed"] > 0, first  # the cold process tuned
    for _ in range(2):
        warm = tuning_counts(tmp_path, "on")
        assert warm["fx hits"] >= 1 and warm["fx misses"] == 0 and warm["timed"] == 0, warm
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 12):
        torchs = tuning_counts(tmp_path, "off")
        assert torchs["fx hits"] >= 1 and torchs["fx misses"] == 0 and torchs["timed"] > 0, torchs
