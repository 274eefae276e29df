"""Helpers the attention ops share."""

from __future__ import annotations

import torch

from compiled_attn.abstract import AttentionMetadata, AttentionType
from compiled_attn.forward_context import get_forward_context


def current_metadata(backend_name: str) -> AttentionMetadata:
    """The forward context's metadata, checked to come from `backend_name`'s builder."""
    md = get_forward_context().attn_metadata
    if getattr(md, "backend_name", None) != backend_name:
        raise ValueError(
            f"{backend_name} got metadata built for {getattr(md, 'backend_name', None) or type(md).__name__}; "
            f"build it with {backend_name}'s builder (backend.get_builder_cls()(spec).build(...))"
        )
    return md


def check_query_rows(query: torch.Tensor, md: AttentionMetadata, kind: AttentionType) -> None:
    """The query has as many rows as the metadata has tokens (encoder tokens for ENCODER)."""
    expect = md.num_encoder_tokens if kind == AttentionType.ENCODER else md.num_prefill_tokens + md.num_decode_tokens
    if query.shape[0] != expect:
        raise ValueError(
            f"{kind.name} attention got {query.shape[0]} query tokens but the metadata describes "
            f"{expect}: build the metadata for this batch"
        )
