"""How metadata reaches the ops: a process-wide context set around each model step.

Metadata holds python ints that change every step; passed through Dynamo they would cause
recompiles. Our ops read it from here at run time instead, and Dynamo never sees it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from compiled_attn.abstract import AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every attention op run inside the block.

    Example::

        with ca.set_forward_context(md):
            logits = compiled_model(input_ids, positions, kv_caches)
    """
    global _forward_context
    if not isinstance(attn_metadata, AttentionMetadata):
        raise ValueError(
            f"set_forward_context needs AttentionMetadata from a builder, got {type(attn_metadata)}"
        )
    prev, _forward_context = _forward_context, ForwardContext(attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    """The current context; RuntimeError outside `set_forward_context`."""
    if _forward_context is None:
        raise RuntimeError(
            "compiled_attn attention ran outside set_forward_context: wrap the model call in "
            "`with compiled_attn.set_forward_context(attn_metadata):`"
        )
    return _forward_context
