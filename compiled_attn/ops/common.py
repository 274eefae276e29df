"""Helpers the attention ops share."""

from __future__ import annotations

from compiled_attn.abstract import AttentionMetadata
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
