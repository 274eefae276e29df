"""Fake kernels: the traced path (`impl.run`, the layer, each op) on CUDA fake tensors, on a CPU build.

FakeTensorMode makes device="cuda" tensors without CUDA, but cannot copy real CPU tensors to
CUDA. So metadata is built on CPU and every tensor field is replaced by a fake CUDA tensor of
the same shape and dtype: the fake kernels read shapes only.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import compiled_attn as ca

T = ca.AttentionType
BACKEND = ca.get_attn_backend("TORCH_SDPA")
HQ, HKV, D, BS, NB = 8, 2, 64, 16, 32
DTYPE = torch.bfloat16


def spec(attn_type: T = T.DECODER) -> ca.AttentionSpec:
    return ca.AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS, num_blocks=NB,
                            dtype=DTYPE, device="cpu", attn_type=attn_type)


def fake_cuda_metadata(md):
    """`md` with each tensor field replaced by a fake CUDA tensor (call inside FakeTensorMode)."""
    fields = {
        name: torch.empty(v.shape, dtype=v.dtype, device="cuda") if isinstance(v, torch.Tensor) else v
        for name, v in md.asdict_zerocopy().items()
    }
    return type(md)(**fields)


def assert_fake_cuda(t: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert isinstance(t, FakeTensor)
    assert t.device.type == "cuda"
    assert t.dtype == DTYPE
    assert tuple(t.shape) == shape


# name: (attn_type, seq_lens, query_lens, encoder_seq_lens, key/value given)
CASES = {
    "decoder_mixed": (T.DECODER, [20, 7, 33], [12, 7, 1], None, True),
    "decoder_decode_only": (T.DECODER, [20, 33], [1, 1], None, True),
    "encoder_only": (T.ENCODER_ONLY, [20, 7], [20, 7], None, True),
    "cross_with_encoder_kv": (T.ENCODER_DECODER, [4, 9], [4, 1], [17, 5], True),
    "cross_cached": (T.ENCODER_DECODER, [4, 9], [1, 1], [17, 5], False),
}


def inputs(case: str):
    attn_type, seq_lens, query_lens, enc, with_kv = CASES[case]
    tables = [list(range(3 * i, 3 * i + 3)) for i in range(len(seq_lens))]
    cross = [list(range(10 + 2 * i, 12 + 2 * i)) for i in range(len(seq_lens))] if enc else None
    md = BACKEND.get_builder_cls()(spec(attn_type)).build(seq_lens, query_lens, tables, enc, cross)
    num_tokens = sum(query_lens)
    num_kv = md.num_encoder_tokens if attn_type == T.ENCODER_DECODER else num_tokens
    if attn_type == T.ENCODER_DECODER:  # key/value hold only the prefills' encoder tokens
        num_kv = sum(enc[: md.num_prefills])
    with_cache = attn_type != T.ENCODER_ONLY
    return md, num_tokens, (num_kv if with_kv else None), with_cache


def make_fakes(num_tokens, num_kv, with_cache):
    q = torch.randn(num_tokens, HQ * D, device="cuda", dtype=DTYPE)
    k = None if num_kv is None else torch.randn(num_kv, HKV * D, device="cuda", dtype=DTYPE)
    v = None if num_kv is None else torch.randn(num_kv, HKV * D, device="cuda", dtype=DTYPE)
    cache = torch.empty(BACKEND.get_kv_cache_shape(NB, BS, HKV, D), device="cuda", dtype=DTYPE) if with_cache else None
    return q, k, v, cache


@pytest.mark.parametrize("case", list(CASES))
def test_impl_forward_on_fake_cuda(case):
    md, num_tokens, num_kv, with_cache = inputs(case)
    impl = BACKEND.get_impl_cls()(HQ, D, D**-0.5, HKV, logits_soft_cap=30.0)
    with FakeTensorMode():
        q, k, v, cache = make_fakes(num_tokens, num_kv, with_cache)
        out = impl.forward(q, k, v, cache, fake_cuda_metadata(md), attn_type=CASES[case][0])
    assert_fake_cuda(out, (num_tokens, HQ * D))


@pytest.mark.parametrize("case", ["decoder_mixed", "cross_cached"])
def test_layer_on_fake_cuda(case):
    md, num_tokens, num_kv, with_cache = inputs(case)
    layer = ca.Attention(HQ, D, D**-0.5, HKV, logits_soft_cap=30.0, attn_type=CASES[case][0], backend="TORCH_SDPA")
    with FakeTensorMode():
        q, k, v, cache = make_fakes(num_tokens, num_kv, with_cache)
        with ca.set_forward_context(fake_cuda_metadata(md)):
            out = layer(q, k, v, cache)
    assert_fake_cuda(out, (num_tokens, HQ * D))


def test_ops_run_under_fake_cuda_tensors_without_error():
    md, num_tokens, _, _ = inputs("decoder_mixed")
    impl = BACKEND.get_impl_cls()(HQ, D, D**-0.5, HKV)
    name, _call = impl.register(1.0, 1.0, T.DECODER)
    with FakeTensorMode():
        q, k, v, cache = make_fakes(num_tokens, num_tokens, True)
        q, k, v = q.view(-1, HQ, D), k.view(-1, HKV, D), v.view(-1, HKV, D)
        output = torch.empty_like(q)
        with ca.set_forward_context(fake_cuda_metadata(md)):  # each op's fake kernel: no error, no real work
            torch.ops.compiled_attn.kv_cache_update(q, k, v, cache, name)
            torch.ops.compiled_attn.torch_sdpa_attention(q, k, v, cache, output, name)
        other = torch.empty(2, 4, BS, HKV, D, dtype=DTYPE)  # a CPU cache (swap target)
        pairs = torch.tensor([[0, 1], [2, 3]])
        torch.ops.compiled_attn.copy_blocks([cache], pairs)
        torch.ops.compiled_attn.swap_blocks(cache, other, pairs)
        # the mutated arguments stay fakes of their shapes on the fake CUDA device
        assert all(isinstance(t, FakeTensor) and t.device.type == "cuda" for t in (output, cache))
        assert output.shape == q.shape
