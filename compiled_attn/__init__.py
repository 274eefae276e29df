"""compiled_attn: paged attention that survives torch.compile(fullgraph=True) and CUDA graphs.

The public contract is described in docs/design.md; everything here is part of it.
"""

from compiled_attn import backends, ops  # noqa: F401  (register the shipped backends and the cache ops)
from compiled_attn.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    AttentionState,
    AttentionType,
    kv_cache_torch_dtype,
)
from compiled_attn.dynamo import floats_as_constants, mark_token_dim
from compiled_attn.forward_context import get_forward_context, set_forward_context
from compiled_attn.layer import Attention
from compiled_attn.registry import BackendUnavailableError, get_attn_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionState",
    "AttentionType",
    "BackendUnavailableError",
    "floats_as_constants",
    "get_attn_backend",
    "get_forward_context",
    "kv_cache_torch_dtype",
    "mark_token_dim",
    "set_forward_context",
]
