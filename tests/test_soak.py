"""Soak: the reference model served through CUDAGraphRunner for 10 000 steps with traffic.

GPU (marked): every available backend, real graphs, 10 000 steps ($SOAK_STEPS overrides), checked
against eager every 100 steps, live memory flat, no NaN. CPU: the same driver for a few hundred
steps over the runner's static-buffer step (use_cuda_graphs=False), so the driver itself is
tested in CI.
"""

from __future__ import annotations

import os

import pytest
import torch

from compiled_attn.backends import torch_sdpa
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model
from compiled_attn.registry import BACKEND_CLASSES
from compiled_attn.testing.agreement import min_top1_agreement
from compiled_attn.testing.soak import SoakConfig, run_soak, soak_num_blocks


def soak(name: str, config: LlamaConfig, soak_config: SoakConfig, *, device: str, dtype: torch.dtype,
         max_seq_len_to_capture: int):
    backend = BACKEND_CLASSES()[name]
    block_size = next(b for b in (16, 64) if backend.supports_block_size(b))
    spec = config.attention_spec(block_size=block_size, num_blocks=soak_num_blocks(block_size, soak_config),
                                 dtype=dtype, device=device, max_seq_len_to_capture=max_seq_len_to_capture)
    model = build_model(config, seed=0, backend=name, dtype=dtype, device=device)
    caches = allocate_kv_caches(config, backend, spec)  # torch.empty: garbage, as in a server
    return run_soak(model, backend, spec, soak_config, kv_caches=caches, vocab_size=config.vocab_size,
                    use_cuda_graphs=device == "cuda")


def test_soak_driver_on_cpu_static_buffers():
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2)
    traffic = SoakConfig(steps=150, check_every=15, capture_sizes=(1, 2, 4, 8), max_live=10, join_probability=0.1,
                         prompt_lens=(2, 12), output_lens=(4, 40), long_len=70, long_probability=0.1, rel_tol=1e-4)
    report = soak("TORCH_SDPA", config, traffic, device="cpu", dtype=torch.float32, max_seq_len_to_capture=64)
    assert report.ok, report.failures
    assert report.steps == 150 and report.checks >= 8
    # traffic reached the graph-shaped step, prefills and overlong batches
    assert report.counts["graph"] > 100 and report.counts["eager_prefill"] > 5, report.counts
    assert report.counts["eager_overlong"] > 0, report.counts
    assert report.requests_served > 10
    assert report.top1_agreement == 1.0


GPU_MODEL = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                        num_kv_heads=2)  # head_size 64: every backend's kernels take it


@pytest.mark.gpu
@pytest.mark.long(150)
@pytest.mark.parametrize("name, env", [(name, {}) for name in BACKEND_CLASSES()]
                         + [("TORCH_SDPA", {torch_sdpa.GRAPH_DECODE_ENV: "gather"})],
                         ids=[*BACKEND_CLASSES(), "TORCH_SDPA-gather"])
def test_soak_10000_decode_steps(name, env, record_property, monkeypatch):
    """Each backend on its default graph decode, and TORCH_SDPA's gather decode (its default's
    fallback) too."""
    backend = BACKEND_CLASSES()[name]
    if backend.unavailable_reason() is not None:
        pytest.skip(f"{name} unavailable: {backend.unavailable_reason()}")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    steps = int(os.environ.get("SOAK_STEPS", 10_000))
    report = soak(name, GPU_MODEL, SoakConfig(steps=steps), device="cuda", dtype=torch.bfloat16,
                  max_seq_len_to_capture=512)
    for key in ("counts", "checks", "worst_rel_err", "top1_agreement", "requests_served", "memory_growth"):
        record_property(key, getattr(report, key))
    assert report.ok, report.failures
    assert report.steps == steps and report.checks >= steps // SoakConfig.check_every - 1
    assert report.counts["graph"] >= 0.8 * steps, report.counts
    # over every checked row; every flip a bf16 near-tie (report.ok)
    assert report.top1_agreement >= min_top1_agreement(report.decodes_on_eager_kernel)
