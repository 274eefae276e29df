"""The second reliability round (issue 16), one behaviour per test: each input that once wrote the
cache before its error, crashed with a raw TypeError / IndexError / OverflowError, or ran into
NaN now raises the contract's error with the cache bit for bit unchanged, or is correct against
the float64 reference.

The forward context per thread lives in tests/test_forward_context.py; the mutation fuzzer over
every entry point in tests/test_fuzz.py.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import numpy as np
import pytest
import torch
from reference import make_batch, reference_attention, reference_forward, rel_err
from test_misuse import BS, HKV, HQ, NB, D, Untouched, make_spec, same_bits
from test_misuse import sdpa_impl as impl

import compiled_attn as ca
from compiled_attn import forward_context
from compiled_attn.backends.common import EAGER_NAMES_KEPT
from compiled_attn.registry import BACKEND_CLASSES

T = ca.AttentionType
SDPA = ca.get_attn_backend("TORCH_SDPA")


def build(seq_lens, query_lens, tables, spec=None, **kw):
    return SDPA.get_builder_cls()(spec or make_spec()).build(seq_lens, query_lens, tables, **kw)


@pytest.fixture
def batch():
    return make_batch(make_spec(), [9, 6, 13], [9, 2, 1], seed=4)


def check_correct(batch, out: torch.Tensor, **ref_kw) -> None:
    assert rel_err(out, reference_forward(batch, **ref_kw)) <= 1e-5


# -------------------------------------------------------------------------------------------
# Block-table entries past a request's need: ignored (never checked, read or copied)


@pytest.mark.parametrize("junk", [999, -40, 2**40, 2**70, "x", None, 2.5], ids=str)
def test_table_entries_past_need_are_ignored(batch, junk):
    # request 1 (6 tokens: 2 blocks) is narrower than request 2 (13 tokens: 4 blocks); its junk
    # entry would once land in the padded device table and crash the op after the cache write
    tables = [list(t) for t in batch.block_tables]
    tables[1] = tables[1] + [junk, junk]
    md = SDPA.get_builder_cls()(batch.spec).build(batch.seq_lens, batch.query_lens, tables)
    assert md.block_tables[1].tolist() == batch.block_tables[1] + [0, 0]
    check_correct(batch, impl().forward(batch.query, batch.key, batch.value, batch.kv_cache, md))


def test_table_entries_past_need_never_reach_a_graph():
    spec = make_spec(max_seq_len_to_capture=32)
    md = build([13, 2], [1, 1], [[1, 2, 3, 4], [5, 999, -40]], spec=spec)
    state = SDPA.get_state_cls()(spec)
    with state.graph_capture(2):
        bufs = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
        graph_state = state.graph_clone(2)
    graph_state.prepare_graph_input_buffers(bufs, md)
    assert bufs["block_tables"][:, :4].tolist() == [[1, 2, 3, 4], [5, 0, 0, 0]]


# -------------------------------------------------------------------------------------------
# Block tables that name a block twice, or two requests writing one block in a step


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "tables", "match"),
    [
        ([9], [9], [[3, 3, 4]], r"block_tables\[0\] names block 3 twice"),
        ([6, 5], [1, 1], [[7, 8], [9, 8]], "block 8 is written this step by request"),  # one slot
        ([6, 7], [1, 1], [[7, 8], [9, 8]], "block 8 is written this step by request"),  # one block
        ([8, 6], [2, 1], [[7, 8], [9, 8]], "block 8 is written this step by request"),  # 1 reads 0's writes
    ],
    ids=["duplicate_in_table", "same_slot", "same_block", "reads_anothers_write"],
)
def test_blocks_written_this_step_belong_to_one_request(seq_lens, query_lens, tables, match):
    with pytest.raises(ValueError, match=match):
        build(seq_lens, query_lens, tables)


def test_cross_tables_naming_a_block_twice_raise():
    with pytest.raises(ValueError, match=r"cross_block_tables\[0\] names block 5 twice"):
        build([3], [3], [[0]], spec=make_spec(attn_type=T.ENCODER_DECODER), encoder_seq_lens=[6],
              cross_block_tables=[[5, 5]])


def test_a_full_block_shared_read_only_by_two_requests_is_prefix_caching():
    # two decodes share their first (full, cached) block: both read it, neither writes it
    spec = make_spec()
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(2, BS, HKV, D, generator=g)  # K/V of positions 0..3, common to both
    own = [torch.randn(2, n, HKV, D, generator=g) for n in (2, 3)]  # positions 4.. of each request
    cache = torch.full((2, NB, BS, HKV, D), float("nan"))
    cache[:, 7] = shared
    cache[:, 9, :2], cache[:, 11, :3] = own[0], own[1]
    md = build([6, 7], [1, 1], [[7, 9], [7, 11]], spec=spec)
    q = torch.randn(2, HQ * D, generator=g)
    k_new = torch.stack([own[0][0, -1], own[1][0, -1]]).flatten(1)
    v_new = torch.stack([own[0][1, -1], own[1][1, -1]]).flatten(1)
    out = impl().forward(q, k_new, v_new, cache, md)
    for i, (seq_len, kv) in enumerate(zip((6, 7), own, strict=True)):
        hist = torch.cat([shared, kv], dim=1)  # [2, seq_len, Hkv, D]
        ref = reference_attention(q[i].view(1, HQ, D), hist[0], hist[1], torch.tensor([seq_len - 1]), causal=True,
                                  scale=D**-0.5)
        assert rel_err(out[i].view(1, HQ, D), ref) <= 1e-5


# -------------------------------------------------------------------------------------------
# ca.Attention checks the query's rows before the cache write (eager and compiled)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("rows", [-1, 1])
def test_layer_refuses_wrong_query_rows_before_writing(batch, compiled, rows):
    layer = ca.Attention(HQ, D, D**-0.5, HKV, backend="TORCH_SDPA")
    fn = torch.compile(layer, fullgraph=True, dynamic=True) if compiled else layer
    query = batch.query[:rows] if rows < 0 else torch.cat([batch.query, batch.query[:rows]])
    with Untouched(batch.kv_cache), ca.set_forward_context(batch.build(SDPA)), \
            pytest.raises(ValueError, match="query tokens but the metadata describes"):
        fn(query, batch.key, batch.value, batch.kv_cache)


def test_cache_update_op_refuses_wrong_query_rows_before_writing(batch):
    name, _keep = impl().register(1.0, 1.0, T.DECODER)
    q, k, v = (x.view(x.shape[0], -1, D) for x in (batch.query[:-1], batch.key, batch.value))
    with Untouched(batch.kv_cache), ca.set_forward_context(batch.build(SDPA)), \
            pytest.raises(ValueError, match="query tokens"):
        torch.ops.compiled_attn.kv_cache_update(q, k, v, batch.kv_cache, name)


def test_attention_op_refuses_an_output_unlike_the_query(batch):
    name, _keep = impl().register(1.0, 1.0, T.DECODER)
    q, k, v = (x.view(x.shape[0], -1, D) for x in (batch.query, batch.key, batch.value))
    with ca.set_forward_context(batch.build(SDPA)), pytest.raises(ValueError, match="output must be like the query"):
        torch.ops.compiled_attn.torch_sdpa_attention(q, k, v, batch.kv_cache, torch.empty(1, HQ, D), name)


# -------------------------------------------------------------------------------------------
# Layers against the metadata's spec


@pytest.mark.parametrize("layer_type", [T.DECODER, T.ENCODER_DECODER])
def test_cache_layer_on_metadata_of_a_cacheless_spec_raises(batch, layer_type):
    # once: all-NaN output from block 0 of the cache, no error (FlashInfer refused it, SDPA not)
    md = build(batch.query_lens[:1], batch.query_lens[:1], [], spec=make_spec(attn_type=T.ENCODER_ONLY))
    n = batch.query_lens[0]
    with Untouched(batch.kv_cache), pytest.raises(ValueError, match="ENCODER_ONLY spec, which has none"):
        impl().forward(batch.query[:n], batch.key[:n], batch.value[:n], batch.kv_cache, md, attn_type=layer_type)
    layer = ca.Attention(HQ, D, D**-0.5, HKV, backend="TORCH_SDPA")
    with Untouched(batch.kv_cache), ca.set_forward_context(md), pytest.raises(ValueError, match="has none"):
        layer(batch.query[:n], batch.key[:n], batch.value[:n], batch.kv_cache)


def test_encoder_only_layer_on_steps_with_context_raises(batch):
    with pytest.raises(ValueError, match="ENCODER_ONLY batches are fresh prompts"):
        impl().forward(batch.query, batch.key, batch.value, None, batch.build(SDPA), attn_type=T.ENCODER_ONLY)


def test_encoder_key_rows_unlike_the_encoder_tokens_raise():
    spec = make_spec(attn_type=T.ENCODER)
    b = make_batch(spec, [3, 2], [3, 2], seed=1, encoder_seq_lens=[5, 7])
    key, value = torch.cat(b.enc_k).flatten(1), torch.cat(b.enc_v).flatten(1)
    with pytest.raises(ValueError, match="key/value have 11/11 tokens"):
        impl().forward(b.encoder_query(), key[:-1], value[:-1], None, b.build(SDPA), attn_type=T.ENCODER)


def test_cross_step_with_prefills_needs_their_encoder_kv():
    # once: the prefills' cross K/V were never written, and their outputs read NaN from the cache
    spec = make_spec(attn_type=T.ENCODER_DECODER)
    b = make_batch(spec, [3, 7], [3, 1], seed=2, encoder_seq_lens=[5, 6])
    with Untouched(b.kv_cache), pytest.raises(ValueError, match="needs their encoder key/value"):
        impl().forward(b.query, None, None, b.kv_cache, b.build(SDPA), attn_type=T.ENCODER_DECODER)


@pytest.mark.parametrize(("name", "spec_kw", "match"), [
    ("XFORMERS", {"logits_soft_cap": 30.0, "head_size": 64, "block_size": 64},
     "XFORMERS does not support logits_soft_cap: its builder cannot serve this spec; use FLASHINFER or TORCH_SDPA$"),
    ("TORCH_SDPA", {"kv_cache_dtype": "fp8", "head_size": 64}, r"TORCH_SDPA does not support kv_cache_dtype.*; use "
     "FLASHINFER$"),
    ("TORCH_SDPA", {"kv_cache_dtype": "fp8"}, r"; no registered backend has all of them$"),  # head_size 16: none
], ids=["xformers_soft_cap", "sdpa_fp8", "sdpa_fp8_head_16"])
def test_builders_refuse_spec_options_their_backend_would_ignore(name, spec_kw, match):
    """The message names the backends that have every option the spec needs, or says none does."""
    with pytest.raises(NotImplementedError, match=match):
        BACKEND_CLASSES()[name].get_builder_cls()(make_spec(**spec_kw))


def test_torch_sdpa_layers_take_their_own_options(batch):
    # documented: TORCH_SDPA plans nothing from the spec, so each layer's window applies
    out = impl(sliding_window=3).forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.build(SDPA))
    check_correct(batch, out, sliding_window=3)


# -------------------------------------------------------------------------------------------
# Option values: non-finite soft-cap and ALiBi, Python-type mistakes


@pytest.mark.parametrize("cap", [math.inf, math.nan, 0.0, -1.0, "30", True], ids=str)
def test_soft_cap_must_be_finite_and_positive(cap):
    for make in (lambda: make_spec(logits_soft_cap=cap), lambda: impl(logits_soft_cap=cap),
                 lambda: ca.Attention(HQ, D, D**-0.5, HKV, logits_soft_cap=cap, backend="TORCH_SDPA")):
        with pytest.raises(ValueError, match="logits_soft_cap must be None or > 0 and finite"):
            make()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_alibi_slopes_must_be_finite(bad):
    slopes = [0.5] * (HQ - 1) + [bad]
    for make in (lambda: make_spec(alibi_slopes=torch.tensor(slopes)), lambda: impl(alibi_slopes=slopes)):
        with pytest.raises(ValueError, match="alibi_slopes must be finite"):
            make()


def test_alibi_slopes_are_kept_as_checked_not_as_the_caller_edits_them_later():
    slopes = torch.linspace(0.1, 0.8, HQ)
    kept = [make_spec(alibi_slopes=slopes).alibi_slopes, impl(alibi_slopes=slopes).alibi_slopes]
    slopes.fill_(math.nan)  # after the finite check
    for got in kept:
        assert torch.equal(got, torch.linspace(0.1, 0.8, HQ))


SPEC_TYPE_MISTAKES = [
    ("num_heads", 4.0), ("num_heads", "4"), ("num_heads", None), ("num_heads", torch.tensor(4.0)),
    ("head_size", 2**31), ("num_blocks", 2**31), ("block_size", True), ("max_seq_len_to_capture", 2**40),
    ("dtype", "float32"), ("dtype", None), ("device", "cdua"), ("device", None), ("kv_cache_dtype", None),
    ("kv_cache_dtype", ["auto"]), ("scale", "x"), ("scale", math.nan), ("scale", 0.0), ("sliding_window", 2**40),
    ("sliding_window", "4"), ("alibi_slopes", "x"), ("attn_type", None), ("attn_type", ["decoder"]),
    ("scale", torch.tensor([0.1, 0.2])),  # a real type float() refuses
]


@pytest.mark.parametrize(("field", "value"), SPEC_TYPE_MISTAKES, ids=[f"{f}={v!r}" for f, v in SPEC_TYPE_MISTAKES])
def test_spec_type_mistakes_are_value_errors(field, value):
    with pytest.raises(ValueError, match=field if field != "attn_type" else "AttentionType"):
        make_spec(**{field: value})


def test_spec_accepts_numpy_and_tensor_ints():
    spec = make_spec(num_heads=np.int64(4), num_blocks=torch.tensor(32))
    assert type(spec.num_heads) is int and type(spec.num_blocks) is int and spec.num_blocks == 32


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine")
def test_cuda_spec_on_a_machine_without_cuda_raises_at_the_builder():
    spec = make_spec(device="cuda")  # a spec may name CUDA (CPU tests inspect CUDA backends' host logic)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        SDPA.get_builder_cls()(spec)
    for backend in BACKEND_CLASSES().values():
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            backend.get_state_cls()(make_spec(device="cuda", head_size=64, block_size=64))


def test_a_cuda_device_index_past_the_machines_devices_raises_at_the_builder(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="^the spec's device is cuda:1 but this machine has 1 CUDA devices$"):
        SDPA.get_builder_cls()(make_spec(device="cuda:1"))


def test_metadata_without_a_spec_raises_and_writes_nothing(batch):
    md = dataclasses.replace(batch.build(SDPA), spec=None)  # made by hand, say: no builder set its spec
    with Untouched(batch.kv_cache), pytest.raises(ValueError, match="^the metadata has no spec: build it with the "
                                                                        "backend's builder$"):
        impl().forward(batch.query, batch.key, batch.value, batch.kv_cache, md)


IMPL_TYPE_MISTAKES = [
    ({"num_heads": 4.0}, "num_heads"), ({"head_size": "8"}, "head_size"), ({"num_kv_heads": None, "num_heads": 0},
                                                                            "num_heads"),
    ({"scale": None}, "scale"), ({"scale": "0.3"}, "scale"), ({"kv_cache_dtype": None}, "kv_cache_dtype"),
    ({"sliding_window": 4.0}, "sliding_window"), ({"alibi_slopes": "slopes"}, "alibi_slopes"),
    ({"scale": np.array([0.1, 0.2])}, r"^scale must be finite and > 0, got array\(\[0.1, 0.2\]\)$"),
]


@pytest.mark.parametrize(("kw", "match"), IMPL_TYPE_MISTAKES, ids=[str(kw) for kw, _ in IMPL_TYPE_MISTAKES])
def test_impl_and_layer_type_mistakes_are_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        impl(**kw)
    args = dict(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV) | kw
    with pytest.raises(ValueError, match=match):
        ca.Attention(**args, backend="TORCH_SDPA")


BUILD_TYPE_MISTAKES = {
    "float_len": ([9.0], [9], [[0, 1, 2]], "seq_lens"),
    "none_len": ([9], [None], [[0, 1, 2]], "query_lens"),
    "str_len": (["9"], [9], [[0, 1, 2]], "seq_lens"),
    "len_past_int32": ([2**31], [1], [[0]], "int32"),
    "lens_not_a_list": (9, [9], [[0, 1, 2]], "seq_lens must be a list"),
    "float_block": ([9], [9], [[0, 1.0, 2]], "block"),
    "none_block": ([9], [9], [[0, None, 2]], "block"),
    "str_block": ([9], [9], [[0, "1", 2]], "block"),
    "huge_block": ([9], [9], [[0, 2**40, 2]], "names block 1099511627776"),
    "block_past_int64": ([9], [9], [[0, 2**70, 2]], "block"),
    "table_not_a_list": ([9], [9], [5], r"block_tables\[0\] must be a list"),
    "tables_none": ([9], [9], None, "block_tables must be a list"),
    "float_tensor_lens": (torch.tensor([9.0]), [9], [[0, 1, 2]], "seq_lens"),
    "bool_among_int_blocks": ([9], [9], [[0, True, 2]], r"^block_tables\[0\] holds a bool: block ids are ints"),
    "bool_tensor_among_int_blocks": ([9], [9], [[0, torch.tensor(True), 2]],
                                     r"^block_tables\[0\] holds a bool: block ids are ints"),
    "set_row": ([9], [9], [{0, 1, 2}], r"^block_tables\[0\] must be a list of block ids, got set$"),
    "3d_table_array": ([9], [9], np.zeros((1, 3, 2), dtype=np.int64),
                       r"^block_tables\[0\] must be one row of block ids, got an array of shape \(3, 2\)$"),
    "float_tensor_row": ([9], [9], [torch.tensor([0.0, 1.0, 2.0])],
                         r"^block_tables\[0\] must hold integer block ids on the host, got a torch.float32 tensor"),
    "nested_row": ([9], [9], [[0, [1, 2], 3]], r"^block_tables\[0\] must hold int block ids, got \[0, \[1, 2\], 3\]$"),
    # tensors off the host, on any device or sparse: named, never numpy's TypeError
    "meta_tensor_lens": (torch.tensor([9], device="meta"), [9], [[0, 1, 2]],
                         r"^seq_lens must be a 1-D host array of ints, got torch.int64 \(1,\) on meta"),
    "sparse_tensor_lens": ([9], torch.tensor([9]).to_sparse(), [[0, 1, 2]],
                           r"^query_lens must be a 1-D host array of ints, got .* \(torch.sparse_coo\)$"),
    "meta_table": ([9], [9], torch.zeros(1, 3, dtype=torch.int32, device="meta"),
                   r"^block_tables must hold integer block ids on the host, got a torch.int32 tensor on meta$"),
    "meta_row": ([9], [9], [torch.tensor([0, 1, 2], device="meta")],
                 r"^block_tables\[0\] must hold integer block ids on the host, got a torch.int64 tensor on meta$"),
    "tokens_past_int32": ([2**31 - 1, 2], [2**31 - 1, 2], [[0], [1]],
                          r"^sum\(query_lens\)=2147483649 > 2147483647: a step's tokens must fit int32$"),
}


@pytest.mark.parametrize("case", list(BUILD_TYPE_MISTAKES))
def test_build_type_mistakes_are_value_errors(case):
    seq_lens, query_lens, tables, match = BUILD_TYPE_MISTAKES[case]
    with pytest.raises(ValueError, match=match):
        build(seq_lens, query_lens, tables)


def test_cross_tables_without_encoder_lengths_are_refused():
    """They would be dropped (the cross fields are built from encoder_seq_lens), and a cross layer
    would then say the metadata lacks the tables it was given."""
    with pytest.raises(ValueError, match="^cross_block_tables without encoder_seq_lens: pass each request's encoder"):
        build([9], [9], [[0, 1, 2]], cross_block_tables=[[3, 4]])


def test_build_takes_numpy_and_tensor_lengths_and_tables(batch):
    md = SDPA.get_builder_cls()(batch.spec).build(
        np.asarray(batch.seq_lens), torch.tensor(batch.query_lens), [np.asarray(t) for t in batch.block_tables])
    check_correct(batch, impl().forward(batch.query, batch.key, batch.value, batch.kv_cache, md))


@pytest.mark.parametrize("arg", ["query", "key", "kv_cache", "k_scale", "v_scale", "attn_type", "metadata"])
@pytest.mark.parametrize("value", [None, "x", -1.5], ids=str)
def test_forward_type_mistakes_are_value_errors(batch, arg, value):
    args = dict(query=batch.query, key=batch.key, value=batch.value, kv_cache=batch.kv_cache,
                attn_metadata=batch.build(SDPA))
    args[{"metadata": "attn_metadata"}.get(arg, arg)] = value
    with Untouched(batch.kv_cache), pytest.raises(ValueError):
        impl().forward(**args)


def test_get_attn_backend_type_mistakes_are_value_errors():
    with pytest.raises(ValueError, match="unknown attention backend"):
        ca.get_attn_backend(3)
    with pytest.raises(ValueError, match="AttentionSpec"):
        ca.get_attn_backend("TORCH_SDPA", {"num_heads": 4})
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ca.kv_cache_torch_dtype(None, torch.float32)


# -------------------------------------------------------------------------------------------
# Eager forward keeps a bounded number of layer registrations


def test_eager_forward_registrations_stay_bounded(batch):
    layer_impl = impl()
    md = batch.build(SDPA)
    gc.collect()
    registered = len(forward_context._layers)
    for i in range(40):  # a caller whose scales change every call
        layer_impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), md, k_scale=1.0 + i / 64)
    gc.collect()
    assert len(layer_impl._eager_calls) == EAGER_NAMES_KEPT
    assert len(forward_context._layers) <= registered + EAGER_NAMES_KEPT


def test_a_refused_forward_evicts_no_kept_registration(batch):
    layer_impl = impl()
    md = batch.build(SDPA)
    for i in range(EAGER_NAMES_KEPT):
        layer_impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), md, k_scale=1.0 + i / 64)
    kept = list(layer_impl._eager_calls)
    with pytest.raises(ValueError):  # a new scale on a call refused for its rows
        layer_impl.forward(batch.query[:-1], batch.key, batch.value, batch.kv_cache, md, k_scale=0.5)
    assert list(layer_impl._eager_calls) == kept


def test_a_refused_forward_registers_nothing(batch):
    layer_impl = impl()
    with pytest.raises(ValueError):
        layer_impl.forward(batch.query[:-1], batch.key, batch.value, batch.kv_cache, batch.build(SDPA), k_scale=0.5)
    with pytest.raises(ValueError):
        layer_impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, "not metadata", k_scale=0.25)
    assert not layer_impl._eager_calls


# -------------------------------------------------------------------------------------------
# Block ops: cache rank and layout, duplicates, read-before-write across the list


def random_cache(num_blocks: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, num_blocks, BS, HKV, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cache", [torch.randn(8, BS, HKV, D), torch.randn(3, 8, BS, HKV, D),
                                   torch.randn(2, 8, BS * HKV * D)], ids=["rank4", "three_halves", "rank3"])
def test_block_ops_refuse_caches_of_another_rank_or_layout(cache):
    before = cache.clone()
    with pytest.raises(ValueError, match=r"must be \[2, num_blocks"):
        SDPA.copy_blocks([cache], torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"must be \[2, num_blocks"):
        SDPA.swap_blocks(cache, cache.clone(), torch.tensor([[1, 2]]))
    assert same_bits(cache, before)


def test_copy_blocks_reads_every_source_before_writing_when_a_cache_is_listed_twice():
    cache = random_cache()
    old = cache.clone()
    SDPA.copy_blocks([cache, cache], torch.tensor([[1, 2], [2, 3]]))
    assert same_bits(cache[:, 2], old[:, 1]) and same_bits(cache[:, 3], old[:, 2])


def test_block_pairs_naming_a_destination_twice_raise():
    caches = [random_cache(seed=1)]
    with Untouched(caches[0]), pytest.raises(ValueError, match="name a block twice"):
        SDPA.copy_blocks(caches, torch.tensor([[1, 5], [2, 5]]))
    src, dst = random_cache(seed=2), random_cache(seed=3)
    with Untouched(dst), pytest.raises(ValueError, match="name a block twice"):
        SDPA.swap_blocks(src, dst, torch.tensor([[1, 5], [2, 5]]))


@pytest.mark.parametrize("pairs", [[[1, 2]], np.array([[1, 2]]), None], ids=["list", "numpy", "none"])
def test_block_pairs_that_are_not_tensors_raise(pairs):
    cache = random_cache()
    with Untouched(cache), pytest.raises(ValueError, match="block pairs must be an int64 tensor"):
        SDPA.copy_blocks([cache], pairs)
    with pytest.raises(ValueError, match="kv_caches must be a list"):
        SDPA.copy_blocks(cache, torch.tensor([[1, 2]]))


# -------------------------------------------------------------------------------------------
# Graph path: the host checks run before the static buffers are refilled


def prepared_state(spec):
    state = SDPA.get_state_cls()(spec)
    with state.graph_capture(4):
        bufs = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(4))
        graph_state = state.graph_clone(4)
    return bufs, graph_state


@pytest.mark.parametrize("bad", [NB, -1, 2**31 - 1], ids=["num_blocks", "negative", "int32_max"])
def test_graph_refill_refuses_a_block_the_builder_would_reject(bad):
    spec = make_spec(max_seq_len_to_capture=32)
    bufs, graph_state = prepared_state(spec)
    md = build([13, 2], [1, 1], [[1, 2, 3, 4], [5]], spec=spec)
    with pytest.raises(ValueError, match="read-only"):
        md.block_tables_host[0, 2] = bad  # the builder froze the table it checked
    md.block_tables_host.flags.writeable = True  # forced open and edited: the refill checks it again
    md.block_tables_host[0, 2] = bad  # what the device table was made from, edited after build
    before = {k: v.clone() for k, v in bufs.items()}
    with pytest.raises(ValueError, match=rf"names block {bad}, outside the cache"):
        graph_state.prepare_graph_input_buffers(bufs, md)
    assert all(torch.equal(bufs[k], before[k]) for k in bufs), "a static buffer was refilled before the check"


def test_graph_refill_refuses_metadata_not_made_by_the_builder():
    spec = make_spec(max_seq_len_to_capture=32)
    bufs, graph_state = prepared_state(spec)
    md = dataclasses.replace(build([13], [1], [[1, 2, 3, 4]], spec=spec), block_tables_host=None)
    with pytest.raises(ValueError, match="builder"):
        graph_state.prepare_graph_input_buffers(bufs, md)


@pytest.mark.parametrize("bad", ["4", 0, 2.0])
def test_state_batch_sizes_of_the_wrong_type_raise(bad):
    state = SDPA.get_state_cls()(make_spec())
    with pytest.raises(ValueError, match="max_batch_size"), state.graph_capture(bad):
        pass
    with state.graph_capture(4), pytest.raises(ValueError, match="batch_size"):
        state.graph_capture_get_metadata_for_batch(bad)


@pytest.mark.parametrize("option", ["num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes",
                                    "sliding_window", "kv_cache_dtype", "logits_soft_cap"])
def test_layer_options_are_fixed_at_construction(option):
    """The ops check a layer once per kind of call and remember it: an option changed afterwards
    would never be checked, so it cannot be changed."""
    layer_impl = impl(sliding_window=4)
    before = getattr(layer_impl, option)
    with pytest.raises(AttributeError, match=f"{option} is fixed at construction"):
        setattr(layer_impl, option, 3)
    assert getattr(layer_impl, option) is before


@pytest.mark.parametrize(("fields", "error"), [
    (dict(num_kv_heads=0), "^LlamaConfig.num_kv_heads must be >= 1, got 0$"),
    (dict(vocab_size=2.0), "^LlamaConfig.vocab_size must be an int, got 2.0$"),
    (dict(num_heads=6), "^LlamaConfig: hidden_size=256 must split into num_heads=6 heads"),
    (dict(num_kv_heads=3), "and those into num_kv_heads=3 groups of equal size$"),
    (dict(hidden_size=60, num_heads=4, num_kv_heads=2),
     r"^LlamaConfig: the head size hidden_size / num_heads = 15 must be even \(rotary embedding"),
], ids=["zero-kv-heads", "float-vocab", "heads-split-hidden", "kv-heads-split-heads", "odd-head-size"])
def test_a_llama_config_that_cannot_make_a_model_is_refused_naming_the_field(fields, error):
    from compiled_attn.models.llama import LlamaConfig

    with pytest.raises(ValueError, match=error):
        LlamaConfig(**fields)
