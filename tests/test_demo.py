"""The demo's generation loop: eager, and through the graph runner's padded static step (CPU)."""

from __future__ import annotations

import torch

import compiled_attn as ca
from compiled_attn.demo import generate, run_demo
from compiled_attn.models.llama import LlamaConfig, build_model

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def test_runner_generation_matches_eager_teacher_forced():
    spec = CONFIG.attention_spec(block_size=16, num_blocks=64, dtype=torch.float32, device="cpu",
                                 max_seq_len_to_capture=128)
    backend = ca.get_attn_backend("TORCH_SDPA", spec)
    model = build_model(CONFIG, seed=1, backend="TORCH_SDPA")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(CONFIG.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 1)]
    eager = generate(model, backend, spec, prompts, steps=6)
    padded = generate(model, backend, spec, prompts, steps=6, forced=eager.tokens, graphs=True)
    assert padded.tokens == eager.tokens
    for a, b in zip(padded.logits, eager.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_demo_on_cpu_agrees_and_reports():
    row = run_demo(steps=3, num_requests=3, device="cpu")
    assert row["agree"], row["check"]
    assert row["backend"] == "TORCH_SDPA" and row["eager tok/s"] > 0 and row["compiled tok/s"] > 0



def test_a_sharded_demo_runs_its_ranks_on_the_device_asked_for(monkeypatch):
    """`run_demo(tp=2, device=...)` spawns its ranks on that device type (each rank takes its own
    index), and on run_ranks' default without one; a CPU model is the one whose layout is checked."""
    from compiled_attn import demo

    asked = []
    monkeypatch.setattr(demo.distributed, "run_ranks", lambda *a, device_type=None: asked.append(device_type) or [{}])
    monkeypatch.setattr(demo.distributed, "default_device_type", lambda world_size: "cpu")
    for device in ("cpu", "cuda", "cuda:1", None):
        run_demo(steps=1, tp=2, device=device)
    assert asked == ["cpu", "cuda", "cuda", "cpu"]
