"""Random-weight transformers models from configs (no hub access): the CLI, tests and benchmarks.

Four families cover what the engine reads from a model: Llama (plain GQA), Qwen2 (sliding window
on the layers from `max_window_layers` on), Mistral (one window for every layer, in the config)
and Gemma2 (alternating windows, attention soft-cap, `query_pre_attn_scalar` as the scale).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

FAMILIES = ("llama", "qwen2", "mistral", "gemma2")
# shapes by name: "tiny" for CPU tests (fp32, seconds to compile), "small" for GPU tests and the
# CLI (head size 64: every backend serves it), "llama3-8b" for the benchmarks
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def random_config(family: str, size: str = "tiny", *, sliding_window: int = 6, **overrides: Any) -> Any:
    """A transformers config of `family` and `size`; `sliding_window` (tokens) for the families
    that have one (Qwen2: layers >= 1 of it, Mistral: all, Gemma2: every other layer);
    `overrides`: any config field, the family's settings here included."""
    import transformers as tr

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {FAMILIES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    shape = dict(SIZES[size], max_position_embeddings=16384)
    # the family's settings, then the caller's overrides of any of them
    if family == "llama":
        return tr.LlamaConfig(**{**shape, "rope_theta": 500000.0, **overrides})
    if family == "qwen2":
        return tr.Qwen2Config(**{**shape, "use_sliding_window": True, "sliding_window": sliding_window,
                                 "max_window_layers": 1, **overrides})
    if family == "mistral":
        return tr.MistralConfig(**{**shape, "sliding_window": sliding_window, **overrides})
    # Gemma2: a scale that is not head_dim ** -0.5, and caps low enough to bite at random weights
    return tr.Gemma2Config(**{**shape, "sliding_window": sliding_window,
                              "query_pre_attn_scalar": shape["head_dim"] // 2, "attn_logit_softcapping": 2.0,
                              "final_logit_softcapping": 8.0, **overrides})


def random_model(config: Any, *, attn_implementation: str = "compiled_attn", dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """A causal LM of `config` with weights drawn from `seed` on `device` (std fan_in ** -0.5 for
    matrices, so that logits spread and greedy tokens are not ties; 1-D weights as initialised)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)  # transformers writes the implementation into the config it is given
    with torch.device(device):  # made in `dtype` on `device`: an 8B model never exists in fp32
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # drawn in fp32 one matrix at a time, then rounded
                p.copy_(torch.randn(p.shape, generator=g, device=p.device) * p.shape[-1] ** -0.5)
    return model.eval().requires_grad_(False)


def eager_twin(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """The same weights under transformers' own eager attention (the reference), in `dtype`."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    with torch.device(next(model.parameters()).device):
        twin = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    twin.load_state_dict(model.state_dict())  # the engine's ca.Attention layers hold no state
    return twin.to(dtype or next(model.parameters()).dtype).eval().requires_grad_(False)
