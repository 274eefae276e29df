"""TOY_DENSE: a fourth backend in plain dense PyTorch, kept as a test fixture.

It measures what adding a backend takes (docs/design.md, "Adding a backend"): this one file
holds everything a shipped backend splits over `backends/<name>.py` and `ops/<name>.py`, and
the contract tests pick it up through conftest.py's `contract_backend` / `cpu_backend` fixtures,
which register it for one test at a time (`registered`). Registered for good it would change
which backends error messages name and what auto-selection picks.

In the fixed order of a backend module: capabilities, Metadata (the common fields are all a
dense kernel needs), Builder (the common one), State (`GraphState` with no hooks: the op reads
only device tensors of the common metadata, so a replay needs no host planning), Impl (the
common one), then the attention op with its fake kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from compiled_attn.abstract import AttentionBackend, AttentionType
from compiled_attn.backends.common import CommonImpl
from compiled_attn.graph_state import GraphState
from compiled_attn.metadata import CommonMetadata, CommonMetadataBuilder
from compiled_attn.ops.common import alibi_bias, checked_step
from compiled_attn.ops.library import define_attention_op, register_fake
from compiled_attn.registry import register_backend, unregister_backend

NAME = "TOY_DENSE"
TOKENS_PER_CHUNK = 64  # queries attended at once: each gathers its request's whole table


@define_attention_op("toy_dense_attention")
def toy_dense_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """Causal attention of each query token over its request's cached keys, written into `output`.

    query/output: [num_tokens, num_heads, head_size]; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_size], already holding this step's K/V (key/value are not read). Device
    tensors of the metadata only (query_start_loc, context_lens_tensor, block_tables), fixed
    shapes and no sync: capturable.
    """
    call, md = checked_step(layer_name, query, key, value, kv_cache, output)
    impl = call.impl
    num_kv_heads, group = impl.num_kv_heads, impl.num_heads // impl.num_kv_heads
    starts = md.query_start_loc.to(torch.int64)  # [num_seqs + 1]
    width = md.block_tables.shape[1] * kv_cache.shape[2]  # keys per gathered row
    key_pos = torch.arange(width, device=query.device)
    slopes = impl.alibi_on(query.device)
    for lo in range(0, query.shape[0], TOKENS_PER_CHUNK):
        q = query[lo : lo + TOKENS_PER_CHUNK].float()  # [n, H, D]
        n = q.shape[0]
        token = torch.arange(lo, lo + n, device=query.device)
        req = torch.searchsorted(starts[1:], token, right=True)  # the request of each token
        pos = (md.context_lens_tensor[req] + token - starts[req])[:, None]  # [n, 1] position in its sequence
        table = md.block_tables[req]  # [n, blocks]
        k, v = (kv_cache[half][table].flatten(1, 2).float() for half in (0, 1))  # [n, width, Hkv, D] each
        if kv_cache.dtype.itemsize == 1:  # fp8 caches hold K / k_scale, V / v_scale
            k, v = k * call.k_scale, v * call.v_scale
        allowed = key_pos <= pos  # [n, width]: causal, so never past the request's seq_len
        if impl.sliding_window:
            allowed &= key_pos > pos - impl.sliding_window
        v = v.masked_fill(~allowed[:, :, None, None], 0)  # NaN outside a request times probability 0 is NaN
        scores = torch.einsum("nhgd,nlhd->nhgl", q.view(n, num_kv_heads, group, -1), k) * impl.scale
        if impl.logits_soft_cap:
            scores = impl.logits_soft_cap * torch.tanh(scores / impl.logits_soft_cap)
        mask = allowed[:, None, None, :]
        scores = scores.masked_fill(~mask, float("-inf"))  # before the bias: keys outside a request may be NaN
        if slopes is not None:
            rel = (key_pos - pos)[:, None, None, :]  # key pos - query pos
            scores = scores + alibi_bias(slopes.view(1, num_kv_heads, group, 1), rel, mask)
        out = torch.einsum("nhgl,nlhd->nhgd", scores.softmax(-1), v)
        output[lo : lo + n] = out.reshape(n, impl.num_heads, -1).to(output.dtype)


@register_fake("toy_dense_attention")
def _(query, key, value, kv_cache, output, layer_name) -> None:
    return None


class ToyDenseBackend(AttentionBackend):
    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_attn_types = (AttentionType.DECODER,)
    supports_alibi = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    requires_cuda = False
    graph_attn_types = (AttentionType.DECODER,)
    graph_supports_alibi = True
    attention_op = torch.ops.compiled_attn.toy_dense_attention

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[ToyDenseImpl]:
        return ToyDenseImpl

    @staticmethod
    def get_metadata_cls() -> type[CommonMetadata]:
        return CommonMetadata

    @staticmethod
    def get_builder_cls() -> type[ToyDenseMetadataBuilder]:
        return ToyDenseMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[ToyDenseState]:
        return ToyDenseState


class ToyDenseMetadataBuilder(CommonMetadataBuilder):
    backend_cls = ToyDenseBackend


class ToyDenseState(GraphState):
    backend_cls = ToyDenseBackend


class ToyDenseImpl(CommonImpl):
    backend_cls = ToyDenseBackend


@contextmanager
def registered() -> Iterator[type[ToyDenseBackend]]:
    """TOY_DENSE known to the registry (get_attn_backend, error hints) inside the block only."""
    register_backend(ToyDenseBackend)
    try:
        yield ToyDenseBackend
    finally:
        unregister_backend(ToyDenseBackend)
