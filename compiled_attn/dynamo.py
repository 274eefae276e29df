"""What the caller of a compiled model marks so that Dynamo compiles it once for every token count."""

from __future__ import annotations

import torch


def mark_token_dim(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (the token count) of each model input unbacked, before calling a model compiled
    with `torch.compile(fullgraph=True, dynamic=True)`.

    Dynamo specialises sizes 0 and 1: unmarked, a 1-token batch (a single decode) compiles a graph
    of its own (torch 2.13: 2 graphs for token counts 7, 3, 1, 12; marked, 1). The model and our
    ops work with an unbacked token count. No effect on an eager model.

    Example::

        ca.mark_token_dim(input_ids, positions)        # int64 [num_tokens] each
        with ca.set_forward_context(md):
            logits = compiled_model(input_ids, positions, kv_caches)
    """
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)
