"""torch.library.opcheck for every compiled_attn op, with all five test_utils named explicitly.

Ops that read the forward context run inside `set_forward_context`. Caches here hold random values
(not NaN) so that opcheck's comparisons of the mutated cache are meaningful.
"""

from __future__ import annotations

import pytest
import torch
from reference import alibi_slopes, make_batch

import compiled_attn as ca

T = ca.AttentionType
BACKEND = ca.get_attn_backend("TORCH_SDPA")
TEST_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)


def opcheck(op, args) -> None:
    torch.library.opcheck(op, args, test_utils=TEST_UTILS)


def batch_for(attn_type=T.DECODER, seq_lens=(9, 6, 13), query_lens=(9, 2, 1), encoder_seq_lens=None, **spec_kw):
    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, block_size=4, num_blocks=32,
                            dtype=torch.float32, device="cpu", attn_type=attn_type, **spec_kw)
    batch = make_batch(spec, list(seq_lens), list(query_lens), seed=11, encoder_seq_lens=encoder_seq_lens)
    cache = batch.kv_cache
    noise = torch.randn(cache.shape, generator=torch.Generator().manual_seed(2)).to(cache.dtype)
    cache.copy_(torch.where(cache.isnan(), noise, cache))
    return batch, batch.build(BACKEND)


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.view(x.shape[0], n, -1)


def layer(attn_type=T.DECODER, k_scale=1.0, v_scale=1.0, **impl_kw):
    """(layer name for the ops, the record that keeps the name alive)."""
    impl = BACKEND.get_impl_cls()(4, 16, 0.25, 2, **impl_kw)
    return impl.register(k_scale, v_scale, attn_type)


@pytest.mark.parametrize("cross", [False, True])
def test_kv_cache_update(cross):
    if cross:
        batch, md = batch_for(T.ENCODER_DECODER, encoder_seq_lens=[5, 7, 3])
        key, value = batch.encoder_kv()
    else:
        batch, md = batch_for()
        key, value = batch.key, batch.value
    name, _call = layer(T.ENCODER_DECODER if cross else T.DECODER)
    with ca.set_forward_context(md):
        opcheck(torch.ops.compiled_attn.kv_cache_update.default,
                (heads(batch.query, 4), heads(key, 2), heads(value, 2), batch.kv_cache, name))


def test_copy_blocks():
    caches = [torch.randn(2, 8, 4, 2, 16), torch.randn(2, 8, 4, 2, 16)]
    opcheck(torch.ops.compiled_attn.copy_blocks.default, (caches, torch.tensor([[1, 5], [2, 0]])))


def test_swap_blocks():
    src, dst = torch.randn(2, 8, 4, 2, 16), torch.randn(2, 5, 4, 2, 16)
    opcheck(torch.ops.compiled_attn.swap_blocks.default, (src, dst, torch.tensor([[7, 0], [2, 4]])))


SDPA_VARIANTS = {
    # name: (attn_type, batch kwargs, sliding_window, logits_soft_cap, alibi)
    "decoder_mixed": (T.DECODER, {}, None, None, False),
    "decoder_alibi": (T.DECODER, {}, None, None, True),
    "decoder_softcap": (T.DECODER, {}, None, 5.0, False),
    "decoder_window_softcap_alibi": (T.DECODER, {}, 3, 5.0, True),
    "encoder_only": (T.ENCODER_ONLY, {"seq_lens": (9, 6), "query_lens": (9, 6)}, None, None, False),
    "encoder": (T.ENCODER, {"seq_lens": (3, 2), "query_lens": (3, 2), "encoder_seq_lens": [5, 7]}, None, None, False),
    "cross_with_encoder_kv": (T.ENCODER_DECODER, {"encoder_seq_lens": [5, 7, 3]}, None, None, False),
    "cross_cached": (
        T.ENCODER_DECODER,
        {"seq_lens": (6, 13), "query_lens": (1, 1), "encoder_seq_lens": [5, 7]},
        None, None, False,
    ),
}


@pytest.mark.parametrize("name", list(SDPA_VARIANTS))
def test_torch_sdpa_attention(name):
    attn_type, kw, window, cap, alibi = SDPA_VARIANTS[name]
    batch, md = batch_for(attn_type, **kw)
    query, key, value, cache = batch.query, batch.key, batch.value, batch.kv_cache
    if attn_type == T.ENCODER:
        query = batch.encoder_query()
        key, value = torch.cat(batch.enc_k).flatten(1), torch.cat(batch.enc_v).flatten(1)
        cache = None
    elif attn_type == T.ENCODER_ONLY:
        cache = None
    elif attn_type == T.ENCODER_DECODER:
        key, value = batch.encoder_kv() if md.num_prefills else (None, None)
    q = heads(query, 4)
    k = None if key is None else heads(key, 2)
    v = None if value is None else heads(value, 2)
    output = torch.empty_like(q)
    name, _call = layer(attn_type, alibi_slopes=alibi_slopes(4) if alibi else None, sliding_window=window,
                        logits_soft_cap=cap)
    with ca.set_forward_context(md):
        opcheck(torch.ops.compiled_attn.torch_sdpa_attention.default, (q, k, v, cache, output, name))


@pytest.mark.parametrize("features", ["plain", "window_softcap_alibi"])
def test_attention_op_of_each_cpu_backend(cpu_backend, features):
    # the op a backend declares (`attention_op`), over the metadata of its own builder
    window, cap, alibi = (3, 5.0, True) if features != "plain" else (None, None, False)
    batch, _ = batch_for()
    md = batch.build(cpu_backend)
    impl = cpu_backend.get_impl_cls()(4, 16, 0.25, 2, alibi_slopes=alibi_slopes(4) if alibi else None,
                                      sliding_window=window, logits_soft_cap=cap)
    name, _call = impl.register(1.0, 1.0, T.DECODER)
    q = heads(batch.query, 4)
    with ca.set_forward_context(md):
        opcheck(cpu_backend.attention_op.default,
                (q, heads(batch.key, 2), heads(batch.value, 2), batch.kv_cache, torch.empty_like(q), name))
