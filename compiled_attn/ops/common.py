"""Helpers the attention ops share."""

from __future__ import annotations

import torch

from compiled_attn.abstract import AttentionMetadata
from compiled_attn.forward_context import LayerCall, get_forward_context, get_layer
from compiled_attn.validation import check_layer_call


def checked_step(
    layer_name: str,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    output: torch.Tensor | None = None,
) -> tuple[LayerCall, AttentionMetadata]:
    """The calling layer and the forward context's metadata, with this call checked against both
    (`validation.check_layer_call`: in full the first time the layer meets this kind of call,
    then only what changes per step; attention ops also pass their `output`) before the op
    writes or reads anything. RuntimeError for a dead layer name or no forward context."""
    call = get_layer(layer_name)
    step = get_forward_context().step_facts(call.group)
    check_layer_call(call, step, query, key, value, kv_cache, output)
    return call, step.md


def alibi_bias(slopes: torch.Tensor, rel: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """slope * (key pos - query pos) where `allowed`, -inf elsewhere, in fp32 (shapes broadcast).

    Each row is shifted so that its largest entry is 0: softmax ignores the shift, and the keys
    that dominate then carry biases near 0, where a bf16 / fp16 mask is exact enough. Unshifted,
    bidirectional ALiBi reaches biases like 35, which bf16 rounds by up to 0.125 (13 % in exp).
    """
    bias = (slopes.to(torch.float32) * rel.to(torch.float32)).masked_fill(~allowed, float("-inf"))
    top = bias.amax(-1, keepdim=True)
    return bias - torch.where(torch.isfinite(top), top, 0)
