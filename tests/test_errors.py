"""Bad inputs raise a clear error of the contract's type, and write nothing into the cache.

ValueError: invalid input; NotImplementedError: valid but unsupported (naming who supports it);
RuntimeError: lifecycle misuse. Each forward-level case snapshots the NaN-filled cache and
checks it bit for bit afterwards.
"""

from __future__ import annotations

import pytest
import torch
from reference import alibi_slopes, make_batch

import compiled_attn as ca

T = ca.AttentionType
BACKEND = ca.get_attn_backend("TORCH_SDPA")
HQ, HKV, D, BS, NB = 8, 2, 16, 4, 16


def make_spec(**kw) -> ca.AttentionSpec:
    args = dict(num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS, num_blocks=NB,
                dtype=torch.float32, device="cpu")
    return ca.AttentionSpec(**(args | kw))


def impl(**kw):
    args = dict(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV) | kw
    return BACKEND.get_impl_cls()(**args)


def build(seq_lens, query_lens, block_tables, spec=None, **kw):
    return BACKEND.get_builder_cls()(spec or make_spec()).build(seq_lens, query_lens, block_tables, **kw)


@pytest.fixture
def batch():
    return make_batch(make_spec(), [9, 6, 13], [9, 2, 1], seed=4)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def expect_no_write(batch, error, match, *, impl_=None, query=None, key=None, value=None, cache=None, md=None,
                    attn_type=T.DECODER):
    """forward with the batch's tensors, some replaced, raises `error`; the cache is untouched."""
    cache = batch.kv_cache if cache is None else cache
    before = cache.clone()
    md = batch.build(BACKEND) if md is None else md
    query = batch.query if query is None else query
    key = batch.key if key is None else key
    value = batch.value if value is None else value
    with pytest.raises(error, match=match):
        (impl_ or impl()).forward(query, key, value, cache, md, attn_type=attn_type)
    assert same_bits(cache, before)


# --- the forward: tensors that do not fit the impl or the metadata -----------------------------


def test_impl_head_size_differs_from_tensors(batch):
    expect_no_write(batch, ValueError, r"query must be \[num_tokens, num_heads \* head_size = 256\]",
                    impl_=impl(head_size=32))


def test_impl_num_heads_differs_from_tensors(batch):
    expect_no_write(batch, ValueError, r"num_heads \* head_size = 64", impl_=impl(num_heads=4))


def test_impl_num_kv_heads_differs_from_tensors(batch):
    expect_no_write(batch, ValueError, r"key must be \[num_tokens, num_kv_heads \* head_size = 64\]",
                    impl_=impl(num_kv_heads=4))


def test_key_rows_differ_from_metadata(batch):
    expect_no_write(batch, ValueError, "slot_mapping", key=batch.key[:-1], value=batch.value[:-1])


def test_query_rows_differ_from_metadata(batch):
    expect_no_write(batch, ValueError, "query tokens but the metadata describes", query=batch.query[:-1])


def test_key_width_differs_from_value(batch):
    expect_no_write(batch, ValueError, "value must be", value=batch.value[:, :-1])


def test_key_dtype_differs_from_query(batch):
    expect_no_write(batch, ValueError, "key dtype torch.float64 != query dtype", key=batch.key.double())


def test_value_missing(batch):
    with pytest.raises(ValueError, match="both be tensors or both be None"):
        impl().forward(batch.query, batch.key, None, batch.kv_cache, batch.build(BACKEND))


def test_decoder_key_none(batch):
    with pytest.raises(ValueError, match="None only for cross attention"):
        impl().forward(batch.query, None, None, batch.kv_cache, batch.build(BACKEND))


def test_cache_smaller_than_spec(batch):
    # The metadata's slots may reach block NB - 1; a cache with fewer blocks must not be written.
    small = batch.kv_cache[:, : NB // 2].clone()
    expect_no_write(batch, ValueError, "kv_cache has shape", cache=small)


def test_cache_with_wrong_head_layout(batch):
    expect_no_write(batch, ValueError, "kv_cache must be", cache=batch.kv_cache.transpose(3, 4).contiguous())


def test_decoder_without_cache(batch):
    with pytest.raises(ValueError, match="needs a kv_cache"):
        impl().forward(batch.query, batch.key, batch.value, None, batch.build(BACKEND))


def test_metadata_from_another_backend(batch):
    md = batch.build(BACKEND)
    md.backend_name = "FLASHINFER"
    expect_no_write(batch, ValueError, "TORCH_SDPA got metadata built for FLASHINFER", md=md)


def test_metadata_of_wrong_type():
    with pytest.raises(ValueError, match="AttentionMetadata"), ca.set_forward_context({"slot_mapping": None}):
        pass


def test_layer_outside_forward_context(batch):
    layer = ca.Attention(HQ, D, D**-0.5, HKV, backend="TORCH_SDPA")
    before = batch.kv_cache.clone()
    with pytest.raises(RuntimeError, match="outside set_forward_context"):
        layer(batch.query, batch.key, batch.value, batch.kv_cache)
    assert same_bits(batch.kv_cache, before)


def test_cross_attention_without_cross_tables(batch):
    layer = ca.Attention(HQ, D, D**-0.5, HKV, attn_type=T.ENCODER_DECODER, backend="TORCH_SDPA")
    before = batch.kv_cache.clone()
    with pytest.raises(ValueError, match="cross"), ca.set_forward_context(batch.build(BACKEND)):
        layer(batch.query, batch.key, batch.value, batch.kv_cache)
    assert same_bits(batch.kv_cache, before)


# --- unsupported configurations -------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_on_torch_sdpa_impl(kv_cache_dtype):
    # The message names the backends that do support fp8 (FLASHINFER / XFORMERS, where present).
    with pytest.raises(NotImplementedError, match="TORCH_SDPA does not support kv_cache_dtype"):
        impl(kv_cache_dtype=kv_cache_dtype)


def test_fp8_cache_on_torch_sdpa_layer():
    with pytest.raises(NotImplementedError, match="does not support"):
        ca.Attention(HQ, D, D**-0.5, HKV, kv_cache_dtype="fp8", backend="TORCH_SDPA")


def test_unknown_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        impl(kv_cache_dtype="int4")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
        ({"sliding_window": 0}, "sliding_window must be None or >= 1"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap must be None or > 0"),
        ({"alibi_slopes": [0.5, 0.25]}, r"alibi_slopes must have shape \[num_heads\]"),
    ],
    ids=["heads", "window", "soft_cap", "alibi"],
)
def test_bad_impl_options(kw, match):
    with pytest.raises(ValueError, match=match):
        impl(**kw)


WINDOW_DECODER_ONLY = "sliding_window is defined for DECODER attention only, not "


@pytest.mark.parametrize(
    ("kw", "attn_type", "match"),
    [
        ({"sliding_window": 4}, T.ENCODER_ONLY, WINDOW_DECODER_ONLY + "ENCODER_ONLY"),
        ({"sliding_window": 4}, T.ENCODER_DECODER, WINDOW_DECODER_ONLY + "ENCODER_DECODER"),
        ({"alibi_slopes": alibi_slopes(HQ)}, T.ENCODER_DECODER, r"ALiBi is not defined for ENCODER_DECODER \(cross\)"),
    ],
    ids=["window_encoder_only", "window_cross", "alibi_cross"],
)
def test_window_and_alibi_outside_the_attention_types_they_mean_something_for(kw, attn_type, match, batch):
    # TORCH_SDPA supports every attention type, window and ALiBi: the refusal is the pairing's
    with pytest.raises(NotImplementedError, match=match):
        ca.Attention(HQ, D, D**-0.5, HKV, attn_type=attn_type, backend="TORCH_SDPA", **kw)
    expect_no_write(batch, NotImplementedError, match, impl_=impl(**kw), attn_type=attn_type)


@pytest.mark.parametrize("field", ["num_heads", "head_size", "block_size", "num_blocks"])
def test_bad_spec_sizes(field):
    with pytest.raises(ValueError, match=f"AttentionSpec.{field} must be >= 1"):
        make_spec(**{field: 0})


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown attention backend 'NOPE'"):
        ca.get_attn_backend("NOPE")
    with pytest.raises(ValueError, match="unknown attention backend"):
        ca.Attention(HQ, D, D**-0.5, HKV, backend="NOPE")


# --- the builder: invalid steps ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "tables", "match"),
    [
        ([5, 9], [1, 9], [[0, 1], [2, 3, 4]], r"request 1 .* is a prefill after decode 0"),
        ([5, 3], [1, 1], [[0, 1], [2]], None),  # two decodes: valid (sanity check of the table)
        ([4, 3], [5, 3], [[0, 1], [2]], r"request 0: seq_len=4 < query_len=5"),
        ([4, 3], [4, 0], [[0], [2]], r"request 1: query_len=0 < 1"),
        ([9], [9], [[0, 1]], r"block_tables\[0\] has 2 blocks but seq_len=9 needs 3"),
        ([8], [8], [[0, NB]], rf"block_tables\[0\] names block {NB}, outside the cache's 0..{NB - 1}"),
        ([8], [8], [[-1, 0]], r"names block -1"),
        ([8, 2], [8], [[0, 1], [2]], r"len\(seq_lens\)=2 != len\(query_lens\)=1"),
        ([8, 2], [8, 2], [[0, 1]], r"len\(block_tables\)=1 != number of requests 2"),
    ],
    ids=["decode_before_prefill", "valid", "seq_lt_query", "query_lt_1", "table_too_short", "block_too_big",
         "negative_block", "lens_differ", "too_few_tables"],
)
def test_builder_rejects(seq_lens, query_lens, tables, match):
    if match is None:
        build(seq_lens, query_lens, tables)
        return
    with pytest.raises(ValueError, match=match):
        build(seq_lens, query_lens, tables)


def test_one_token_prompt_after_decode_is_rejected():
    # A 1-token prompt is a prefill, so it may not follow a decode.
    with pytest.raises(ValueError, match="is a prefill after decode"):
        build([5, 1], [1, 1], [[0, 1], [2]])


def test_encoder_only_needs_seq_len_equal_query_len():
    with pytest.raises(ValueError, match=r"no cache, so seq_len \(5\) must equal query_len \(3\)"):
        build([5], [3], [], spec=make_spec(attn_type=T.ENCODER_ONLY))


@pytest.mark.parametrize("attn_type", [T.ENCODER, T.ENCODER_DECODER])
def test_encoder_types_need_encoder_seq_lens(attn_type):
    with pytest.raises(ValueError, match="needs encoder_seq_lens"):
        build([3], [3], [[0]], spec=make_spec(attn_type=attn_type))


def test_cross_needs_cross_block_tables():
    with pytest.raises(ValueError, match="needs cross_block_tables"):
        build([3], [3], [[0]], spec=make_spec(attn_type=T.ENCODER_DECODER), encoder_seq_lens=[5])


@pytest.mark.parametrize(
    ("enc", "cross", "match"),
    [
        ([5, 2], [[1, 2]], r"len\(cross_block_tables\)=1 != number of requests 2"),
        ([5], [[1, 2]], r"len\(encoder_seq_lens\)=1 != number of requests 2"),
        ([5, 0], [[1, 2], [3]], "encoder_seq_lens must all be >= 1"),
        ([5, 2], [[1], [3]], r"cross_block_tables\[0\] has 1 blocks but seq_len=5 needs 2"),
        ([5, 2], [[1, NB], [3]], rf"cross_block_tables\[0\] names block {NB}"),
    ],
    ids=["too_few_tables", "too_few_lens", "empty_encoder", "table_too_short", "block_too_big"],
)
def test_builder_rejects_cross_fields(enc, cross, match):
    with pytest.raises(ValueError, match=match):
        build([3, 4], [3, 1], [[0], [5]], spec=make_spec(attn_type=T.ENCODER_DECODER),
              encoder_seq_lens=enc, cross_block_tables=cross)
