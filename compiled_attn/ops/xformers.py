"""The XFORMERS attention op: xFormers kernels over the paged cache, fake kernel beside it.

One op serves a mixed batch. The bias objects it uses (python ints inside) are built on the
host by the builder or the graph State and reach the op through the forward context:

- decode: triton split-K over the paged cache, `kv_cache[0].view(1, num_blocks * block_size,
  Hkv, 1, D)` expanded over the query heads of each group (GQA without copies). The op is
  named explicitly: xFormers' dispatcher never picks split-K above 32 query tokens.
- prefill: flash (PyTorch's FA2) or cutlass over packed K/V — this step's fresh K/V when no
  prefill has cached context, else K/V gathered from the cache (chunked prefill, prefix hits).
- ALiBi: cutlass with a per-request tensor bias (eager only; no xFormers kernel takes ALiBi
  together with a block-diagonal or paged bias), K/V copied per query head (`cutlass_safe`).

xFormers is imported lazily so that this module (and the fake kernel) load on CPU-only machines.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from compiled_attn.abstract import AttentionType
from compiled_attn.metadata import first_keys
from compiled_attn.ops.common import alibi_bias, checked_step
from compiled_attn.ops.library import define_attention_op, register_fake

# The one not_supported_reason we override: an xFormers wheel whose C++ extension does not load
# against this torch flags every CUDA op, yet flash / cutlass (PyTorch's own kernels) and
# triton split-K (Triton) do not need that extension.
_CPP_EXTENSION_REASON = "wasn't build with CUDA support"


@functools.cache
def fmha() -> Any:
    """`xformers.ops.fmha`, imported on first use (it is an optional dependency)."""
    import xformers.ops.fmha as fmha_module

    return fmha_module


def _not_supported(op: Any, inp: Any) -> list[str]:
    return [r for r in op.not_supported_reasons(inp) if _CPP_EXTENSION_REASON not in r]


def run_xformers(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: Any,
    scale: float,
    ops: tuple[str, ...],
) -> torch.Tensor:
    """One xFormers forward with the first of `ops` ("flash", "cutlass", "splitk") that takes it.

    query: [1, Mq, G, Hpg, D] or [1, Mq, H, D]; key/value alike (usually expanded over the
    query heads of a group). Returns the query's shape and dtype. Raises NotImplementedError
    naming every op's reasons when none fits (the caller's configuration is then unsupported).
    """
    f = fmha()
    inp = f.Inputs(query=query, key=key, value=value, attn_bias=bias, p=0.0, scale=scale)
    inp.validate_inputs()
    shape = inp.normalize_bmhk()
    classes = {"flash": f.flash.FwOp, "cutlass": f.cutlass.FwOp, "splitk": f.triton_splitk.FwOp}
    reasons = {}
    for name in ops:
        op = classes[name]
        why = _not_supported(op, inp)
        if not why:
            out, _ = op.apply(cutlass_safe(inp) if name == "cutlass" else inp, needs_gradient=False)
            return out.reshape(shape)
        reasons[op.NAME] = why
    raise NotImplementedError(f"no xFormers kernel takes this input ({type(bias).__name__}): {reasons}")


def cutlass_safe(inp: Any) -> Any:
    """`inp` as cutlass computes it correctly: 4-D, every query head with K/V of its own in memory.

    PyTorch's mem-efficient kernel returns wrong rows (rel err 0.15-0.26) in a partial last query
    tile when K/V heads have stride 0, our expanded GQA layout; contiguous copies are exact
    (scripts/xf_alibi_probe.py, H200 and H100). And xFormers' cutlass op runs each KV group of a
    5-D input on a side stream of its own (its source), which 4-D input avoids. Costs one K/V copy
    per call; only ALiBi and a prefill that flash refuses get here.
    """
    q, k, v, bias = inp.query, inp.key, inp.value, inp.attn_bias
    if q.dim() == 5:
        q, k, v = q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3)
        if isinstance(bias, torch.Tensor):
            bias = bias.flatten(1, 2)
    return dataclasses.replace(inp, query=q, key=k.contiguous(), value=v.contiguous(), attn_bias=bias)


def grouped(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[T, Hq, D] -> [1, T, G, Hq // G, D] as a view (queries: contiguous groups)."""
    t, h, d = x.shape
    return x.view(1, t, num_kv_heads, h // num_kv_heads, d)


def expanded(x: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """[T, G, D] keys/values -> [1, T, G, heads_per_group, D], stride 0 over the group's heads
    (unsqueeze, not x[None, :, :, None, :]: Python indexing costs several host us per call)."""
    t, g, d = x.shape
    return x.unsqueeze(0).unsqueeze(3).expand(1, t, g, heads_per_group, d)


def gather_cache(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of cache `slots` (int64 [T]) as [T, Hkv, D] each (packed, in the cache dtype)."""
    _, nb, bs, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, hkv, d)
    return flat[0, slots], flat[1, slots]


def paged_kv(kv_cache: torch.Tensor, heads_per_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache halves as xFormers' paged K/V: [1, num_blocks * block_size, Hkv, Hpg, D] views
    (one view and one expand of the whole, contiguous cache: fewer host calls per step)."""
    _, nb, bs, hkv, d = kv_cache.shape
    kv = kv_cache.view(2, 1, nb * bs, hkv, 1, d).expand(2, 1, nb * bs, hkv, heads_per_group, d)
    return kv[0], kv[1]


@define_attention_op("xformers_attention")
def xformers_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """Attention for the forward context's batch, written into `output`.

    query/output: [num_tokens, num_heads, head_size]; key/value: [num_tokens (encoder tokens for
    cross attention), num_kv_heads, head_size] or None; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_size], already holding this step's K/V, or None (encoder types).
    Scale, window and ALiBi come from the layer `layer_name`. Capturable for decode batches: the
    decode branch only reads device tensors of the metadata's prebuilt bias and launches kernels.
    """
    call, md = checked_step(layer_name, query, key, value, kv_cache, output)  # incl. md.check_options
    impl, kind = call.impl, call.attn_type
    scale, sliding_window = impl.scale, impl.sliding_window or 0
    alibi_slopes = impl.alibi_on(query.device)
    g = md.spec.num_kv_heads
    if alibi_slopes is not None:
        alibi_attention(md, query, key, value, kv_cache, output, scale, sliding_window, alibi_slopes, kind)
        return
    if kind in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
        role = "encoder" if kind == AttentionType.ENCODER else "encoder_only"
        hpg = query.shape[1] // g
        out = run_xformers(grouped(query, g), expanded(key, hpg), expanded(value, hpg),
                           md.bias(role), scale, ("flash", "cutlass"))
        output.copy_(out.view_as(output))
        return
    cross = kind == AttentionType.ENCODER_DECODER
    hpg = query.shape[1] // g
    n_pre = md.num_prefill_tokens
    if md.num_prefills:
        if cross and key is not None:
            k, v = key, value  # the prefills' encoder tokens, fresh this step
        elif not cross and md.prefill_fresh:
            k, v = key[:n_pre], value[:n_pre]
        else:
            k, v = gather_cache(kv_cache, md.cross_slot_mapping if cross else md.prefill_kv_slots)
        bias = md.bias("cross_prefill" if cross else "prefill")
        out = run_xformers(grouped(query[:n_pre], g), expanded(k, hpg), expanded(v, hpg), bias, scale,
                           ("flash", "cutlass"))
        output[:n_pre].copy_(out.view(n_pre, *output.shape[1:]))
    if md.num_decode_tokens:
        k, v = paged_kv(kv_cache, hpg)
        bias = md.bias("cross_decode" if cross else "decode")
        out = run_xformers(grouped(query[n_pre:], g), k, v, bias, scale, ("splitk",))
        output[n_pre:].copy_(out.view(md.num_decode_tokens, *output.shape[1:]))


@register_fake("xformers_attention")
def _(query, key, value, kv_cache, output, layer_name) -> None:
    return None


def alibi_attention(
    md: Any,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    output: torch.Tensor,
    scale: float,
    sliding_window: int,
    alibi_slopes: torch.Tensor,
    kind: AttentionType,
) -> None:
    """ALiBi: one cutlass call per request with a [1, G, Hpg, Lq, Lk] tensor bias.

    xFormers takes ALiBi only as a dense tensor bias (no block-diagonal or paged variant), so
    this path loops over requests on the host: eager only (the State refuses ALiBi graphs).
    """
    if kind == AttentionType.ENCODER_DECODER:  # refused when a layer is made; the loop below would treat it as self
        raise NotImplementedError("ALiBi is not defined for ENCODER_DECODER (cross) attention")
    g = md.spec.num_kv_heads
    hpg = query.shape[1] // g
    slopes = alibi_slopes.to(torch.float32).view(g, hpg)[None, :, :, None, None]
    for q_lo, q_hi, first_pos, first_key, causal, k, v in _alibi_requests(md, key, value, kv_cache, kind):
        lq, lk = q_hi - q_lo, k.shape[0]
        qpos = first_pos + torch.arange(lq, device=query.device, dtype=torch.float32)
        kpos = first_key + torch.arange(lk, device=query.device, dtype=torch.float32)
        rel = kpos[None, :] - qpos[:, None]  # [Lq, Lk] key pos - query pos
        allowed = torch.ones_like(rel, dtype=torch.bool)
        if causal:
            allowed &= rel <= 0
        if sliding_window > 0:
            allowed &= rel > -sliding_window
        # cutlass wants the bias rows 8-aligned (16-byte loads): allocate padded, use a slice
        bias = torch.empty(1, g, hpg, lq, -(-lk // 8) * 8, device=query.device, dtype=query.dtype)[..., :lk]
        bias.copy_(alibi_bias(slopes, rel, allowed))
        out = run_xformers(grouped(query[q_lo:q_hi], g), expanded(k, hpg), expanded(v, hpg), bias, scale,
                           ("cutlass",))
        output[q_lo:q_hi].copy_(out.view(lq, *output.shape[1:]))


def _alibi_requests(md: Any, key, value, kv_cache, kind: AttentionType):
    """Per request: query rows, first query position, first key position, causality, K/V
    [Lk, Hkv, D] (a rolling table's requests: keys past their rolled blocks, `first_keys`). No
    ENCODER_DECODER: a cross layer with ALiBi is refused when it is made (`check_attn_type`)."""
    first = first_keys(md.rolled_blocks, md.num_seqs, md.block_size).tolist()
    q_lo = k_lo = 0
    for i, (seq_len, query_len) in enumerate(zip(md.seq_lens, md.query_lens, strict=True)):
        if kind == AttentionType.ENCODER:
            enc_len = md.encoder_seq_lens[i]
            yield k_lo, k_lo + enc_len, 0, 0, False, key[k_lo : k_lo + enc_len], value[k_lo : k_lo + enc_len]
            k_lo += enc_len
            continue
        q_hi = q_lo + query_len
        if kind == AttentionType.ENCODER_ONLY:
            yield q_lo, q_hi, 0, 0, False, key[q_lo:q_hi], value[q_lo:q_hi]
        else:
            n_keys = seq_len - first[i]
            k, v = gather_cache(kv_cache, md.alibi_kv_slots[k_lo : k_lo + n_keys])
            yield q_lo, q_hi, seq_len - query_len, first[i], True, k, v
            k_lo += n_keys
        q_lo = q_hi
