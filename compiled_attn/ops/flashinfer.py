"""The FLASHINFER attention op: one mixed batch through planned FlashInfer wrappers, fake beside it.

FlashInfer splits work into `plan` (host: scheduling, pinned-buffer staging, JIT module lookup)
and `run` (launches only). Planning happens once per step (the metadata's `step_plan`, see
backends/flashinfer.py): in the builder for a CUDA step holding prefills where FlashInfer loads,
else at the step's first call of this op; every other call only runs. Prefill tokens go through the paged
prefill wrapper, decode tokens through the decode wrapper (a mixed step's decode tokens too, unless
`MIXED_STEP_ENV` sends its every row through the prefill wrapper: by default where decode runs on
tensor cores), ENCODER_ONLY batches through the ragged wrapper over this step's fresh K/V.
FlashInfer's own op registration is a no-op, so Dynamo must never trace into it: every FlashInfer
call happens inside this op.
"""

from __future__ import annotations

import torch

from compiled_attn.abstract import AttentionType
from compiled_attn.ops.common import checked_step
from compiled_attn.ops.library import define_attention_op, register_fake


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph. Nothing captures before CUDA is
    initialized, so the cheap flag comes first (`is_available()` costs host us per call)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@define_attention_op("flashinfer_attention")
def flashinfer_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """Attention for the forward context's batch, written into `output`.

    query/output: [num_tokens, num_heads, head_size] (spec dtype); key/value: [num_tokens,
    num_kv_heads, head_size] (read only by ENCODER_ONLY; DECODER reads the cache, which
    `kv_cache_update` has already written); kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_size] of the spec's cache dtype, or None for ENCODER_ONLY. The layer `layer_name` gives
    scale / window / soft-cap / ALiBi (which must equal the spec's: the step was planned with
    those), the attention type and the fp8 cache scales.

    Capturable when the metadata comes from `FlashInferState.graph_capture_get_metadata_for_batch`
    (decode-only, `use_cuda_graph=True` wrapper): then it launches kernels only.
    """
    call, md = checked_step(layer_name, query, key, value, kv_cache, output)  # incl. the plan's check_call
    kind, step = call.attn_type, md.step_plan
    if not step.graph_safe and stream_capturing():
        raise RuntimeError(
            f"{call.impl.backend_cls.get_name()}: capturing a CUDA graph with metadata from the builder, "
            "whose wrappers were not made for graphs (use_cuda_graph=False); capture decode steps with metadata from "
            "backend.get_state_cls()(spec).graph_capture_get_metadata_for_batch(batch_size)"
        )
    step.ensure_planned(md)
    if kind == AttentionType.ENCODER_ONLY:
        step.wrapper("ragged").run(query, key, value, out=output)
        return
    scales = dict(k_scale=call.k_scale, v_scale=call.v_scale) if kv_cache.dtype.itemsize == 1 else {}
    cache = kv_cache.unbind()  # ([num_blocks, block_size, num_kv_heads, head_size],) * 2: one host call, not two
    if md.num_prefills and (not md.num_decode_tokens or step.mixed_as_prefill):  # one wrapper, every row
        step.wrapper("prefill").run(query, cache, out=output, **scales)
        return
    if md.num_prefills:  # mixed, split: each slice is a host call
        n_pre = md.num_prefill_tokens
        step.wrapper("prefill").run(query[:n_pre], cache, out=output[:n_pre], **scales)
        query, output = query[n_pre:], output[n_pre:]
    if md.num_decode_tokens:
        step.wrapper("decode").run(query, cache, out=output, **scales)


@register_fake("flashinfer_attention")
def _(query, key, value, kv_cache, output, layer_name) -> None:
    return None
