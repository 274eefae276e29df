"""Helpers the attention ops share."""

from __future__ import annotations

import torch

from compiled_attn.abstract import AttentionImpl, AttentionMetadata, AttentionType
from compiled_attn.forward_context import get_forward_context


def current_metadata(backend_name: str) -> AttentionMetadata:
    """The forward context's metadata, checked to come from `backend_name`'s builder."""
    md = get_forward_context().attn_metadata
    check_metadata_backend(md, backend_name)
    return md


def check_metadata_backend(md: AttentionMetadata, backend_name: str) -> None:
    built_by = getattr(md, "backend_name", None) or type(md).__name__
    if built_by != backend_name:
        raise ValueError(
            f"{backend_name} got metadata built for {built_by}; build it with {backend_name}'s builder "
            "(backend.get_builder_cls()(spec).build(...))"
        )


def check_query_rows(query: torch.Tensor, md: AttentionMetadata, kind: AttentionType) -> None:
    """The query has as many rows as the metadata has tokens (encoder tokens for ENCODER)."""
    expect = md.num_encoder_tokens if kind == AttentionType.ENCODER else md.num_prefill_tokens + md.num_decode_tokens
    if query.device != md.slot_mapping.device:
        raise ValueError(
            f"query is on device {query.device}, the metadata on {md.slot_mapping.device}: build it on the query's"
        )
    if query.shape[0] != expect:
        raise ValueError(
            f"{kind.name} attention got {query.shape[0]} query tokens but the metadata describes "
            f"{expect}: build the metadata for this batch"
        )


def check_layer_matches_spec(impl: AttentionImpl, md: AttentionMetadata) -> None:
    """The layer's head layout is the spec's (the metadata was built for that spec)."""
    spec = getattr(md, "spec", None)
    if spec is None:
        return
    for name in ("num_heads", "num_kv_heads", "head_size"):
        if getattr(impl, name) != getattr(spec, name):
            raise ValueError(
                f"layer has {name}={getattr(impl, name)} but the metadata's spec has {getattr(spec, name)}: "
                "build the metadata with this layer group's spec"
            )


def alibi_bias(slopes: torch.Tensor, rel: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """slope * (key pos - query pos) where `allowed`, -inf elsewhere, in fp32 (shapes broadcast).

    Each row is shifted so that its largest entry is 0: softmax ignores the shift, and the keys
    that dominate then carry biases near 0, where a bf16 / fp16 mask is exact enough. Unshifted,
    bidirectional ALiBi reaches biases like 35, which bf16 rounds by up to 0.125 (13 % in exp).
    """
    bias = (slopes.to(torch.float32) * rel.to(torch.float32)).masked_fill(~allowed, float("-inf"))
    top = bias.amax(-1, keepdim=True)
    return bias - torch.where(torch.isfinite(top), top, 0)
