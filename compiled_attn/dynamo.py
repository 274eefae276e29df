"""What the caller of a compiled model marks so that Dynamo compiles it once for every token
count, and traces its Python floats as constants."""

from __future__ import annotations

from contextlib import AbstractContextManager

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


def floats_as_constants() -> AbstractContextManager[None]:
    """Trace a model's Python floats (a norm's eps, a scale kept on a module) as constants.

    Under `torch.compile(dynamic=True)` Dynamo lifts each float it reads, module attributes and
    globals alike, into a 0-d float64 CPU input. Inductor then packs them with a C++ kernel on
    every step and copies them to the device: a CUDA graph replays that copy from a host buffer,
    and loading the compiled graph on a fresh process needs a C++ compiler (on an H100 host, tens
    of seconds of CPU feature checks and builds). Specialised, a float recompiles the model once
    per value it takes: nothing for a model's constants. The patch matters while Dynamo traces:
    wrap every call that may trace (the first, and any that recompile); a graph traced without it
    keeps its float inputs. It costs tens of microseconds a call (16-60 us on development CPUs).
    Since torch 2.12 the patch holds for the calling thread only; torch 2.11 patches Dynamo's
    config for the process, so two threads inside it at once may leave it on after both leave
    (floats then stay constants process-wide, which costs only recompiles for floats that
    change).

    Example::

        with ca.floats_as_constants(), ca.set_forward_context(md):
            logits = compiled_model(input_ids, positions, kv_caches)
    """
    return torch._dynamo.config.patch(specialize_float=True)
