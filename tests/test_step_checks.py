"""The ops' step checks are lean (issue 14, item 3): what depends only on the layer and the kind of
call (metadata class, backend and spec; the dtype and device; the cache's shape and layout) is
checked the first time a layer meets that kind and remembered by the layer (its cache write and
attention op share it); what the metadata asks of the step is read once per forward; every call
still compares each tensor's shape, dtype and device with the step's.

The errors themselves are pinned in tests/test_errors.py, tests/test_misuse.py and
tests/test_validation.py, the mutation fuzzer in tests/test_fuzz.py; these tests pin the caching.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from reference import make_batch
from test_misuse import HKV, HQ, NB, D, Untouched, make_spec, sdpa_impl

import compiled_attn as ca
from compiled_attn import validation
from compiled_attn.backends.flashinfer import FlashInferBackend
from compiled_attn.validation import CALL_KINDS_KEPT

T = ca.AttentionType
SDPA = ca.get_attn_backend("TORCH_SDPA")


@pytest.fixture
def batch():
    return make_batch(make_spec(), [9, 6, 13], [9, 2, 1], seed=3)


@pytest.fixture
def static_checks(monkeypatch):
    """Counts the calls of `validation.check_step`, the full check (a repeat step of a kind skips it)."""
    calls = []
    full = validation.check_step

    def counted(*args):
        calls.append(args)
        return full(*args)

    monkeypatch.setattr(validation, "check_step", counted)
    return calls


def op_args(batch, query=None, key=None, value=None):
    """The ops' views of a batch: query [T, HQ, D], key / value [T, HKV, D]."""
    q, k, v = (batch.query if query is None else query, batch.key if key is None else key,
               batch.value if value is None else value)
    return q.view(q.shape[0], -1, D), k.view(k.shape[0], -1, D), v.view(v.shape[0], -1, D)


def both_ops(name, md, q, k, v, cache, output=None) -> None:
    """One layer step as `CommonImpl.run` makes it: the cache write, then the attention op."""
    with ca.set_forward_context(md):
        torch.ops.compiled_attn.kv_cache_update(q, k, v, cache, name)
        out = torch.empty_like(q) if output is None else output
        torch.ops.compiled_attn.torch_sdpa_attention(q, k, v, cache, out, name)


# -------------------------------------------------------------------------------------------
# A repeat step checks only what changes per step


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_repeat_step_skips_the_static_checks(batch, static_checks, compiled):
    layer = ca.Attention(HQ, D, D**-0.5, HKV, backend="TORCH_SDPA")
    fn = torch.compile(layer, fullgraph=True, dynamic=True) if compiled else layer
    builder = SDPA.get_builder_cls()(batch.spec)
    for step in range(4):  # a new metadata object with other row counts every step
        n = 3 - step % 2
        md = builder.build(batch.seq_lens[:n], batch.query_lens[:n], batch.block_tables[:n])
        rows = sum(batch.query_lens[:n])
        with ca.set_forward_context(md):
            fn(batch.query[:rows], batch.key[:rows], batch.value[:rows], batch.kv_cache)
        assert len(static_checks) == 1  # the first step's cache write; its attention op shares the kind
    assert len(layer._call.checked_kinds) == 1


def test_eager_forward_remembers_per_layer_name(batch, static_checks):
    impl = sdpa_impl()
    for _ in range(3):
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.build(SDPA))
    assert len(static_checks) == 1


def test_a_repeat_step_still_checks_its_rows(batch):
    name, _keep = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    both_ops(name, batch.build(SDPA), q, k, v, batch.kv_cache)
    for args, match in (((q[:-1], k, v), "query tokens"), ((q, k[:-1], v[:-1]), "key/value have")):
        with Untouched(batch.kv_cache), ca.set_forward_context(batch.build(SDPA)), \
                pytest.raises(ValueError, match=match):
            torch.ops.compiled_attn.kv_cache_update(*args, batch.kv_cache, name)
    with ca.set_forward_context(batch.build(SDPA)), pytest.raises(ValueError, match="output must be like the query"):
        torch.ops.compiled_attn.torch_sdpa_attention(q, k, v, batch.kv_cache, torch.empty(1, HQ, D), name)


# -------------------------------------------------------------------------------------------
# Anything the kind covers that changes is checked in full, with the documented error


def other_spec_step(batch, **spec_kw):
    """Metadata of a spec of its own (`make_spec(**spec_kw)`) for the batch's first request, a
    fresh prompt (valid for any attention type), and its row count."""
    md = SDPA.get_builder_cls()(make_spec(**spec_kw)).build(batch.query_lens[:1], batch.query_lens[:1], [[0, 1, 2]])
    return md, batch.query_lens[0]


def heads_innermost(x: torch.Tensor) -> torch.Tensor:
    """x's values in x's shape, laid out with the heads as the innermost dimension."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


# name -> (batch, q, k, v, cache) -> (md, rows or None, q, k, v, cache, output or None, message)
CHANGES = {
    "spec_heads": lambda b, q, k, v, c: (*other_spec_step(b, num_heads=2 * HQ), q, k, v, c, None, "num_heads=8"),
    "cacheless_spec": lambda b, q, k, v, c: (*other_spec_step(b, attn_type=T.ENCODER_ONLY), q, k, v, c, None,
                                             "has none"),
    "backend": lambda b, q, k, v, c: (dataclasses.replace(b.build(SDPA), backend_name="XFORMERS"), None, q, k, v, c,
                                      None, "got metadata built for XFORMERS"),
    "query_dtype": lambda b, q, k, v, c: (b.build(SDPA), None, q.double(), k.double(), v.double(), c, None,
                                          "kv_cache dtype"),
    "query_only_dtype": lambda b, q, k, v, c: (b.build(SDPA), None, q.double(), k, v, c, None, "key dtype"),
    "key_dtype": lambda b, q, k, v, c: (b.build(SDPA), None, q, k.double(), v, c, None, "key dtype"),
    "value_dtype": lambda b, q, k, v, c: (b.build(SDPA), None, q, k, v.double(), c, None, "value dtype"),
    "key_heads": lambda b, q, k, v, c: (b.build(SDPA), None, q, k.reshape(k.shape[0], -1, D // 2),
                                        v.reshape(v.shape[0], -1, D // 2), c, None, "key must be"),
    "cache_blocks": lambda b, q, k, v, c: (b.build(SDPA), None, q, k, v, c[:, : NB // 2].clone(), None,
                                           "kv_cache has shape"),
    "cache_dtype": lambda b, q, k, v, c: (b.build(SDPA), None, q, k, v, c.double(), None, "kv_cache dtype"),
    "cache_layout": lambda b, q, k, v, c: (b.build(SDPA), None, q, k, v, c.transpose(0, 1).contiguous().transpose(0, 1),
                                           None, "contiguous"),
    "output_dtype": lambda b, q, k, v, c: (b.build(SDPA), None, q, k, v, c, torch.empty_like(q, dtype=torch.float64),
                                           "output must be like the query"),
    # the same shapes with a strided head dimension (heads innermost)
    "query_head_stride": lambda b, q, k, v, c: (b.build(SDPA), None, heads_innermost(q), k, v, c, None,
                                                "query .* head dimension must be contiguous"),
    "key_head_stride": lambda b, q, k, v, c: (b.build(SDPA), None, q, heads_innermost(k), v, c, None,
                                              "key .* head dimension must be contiguous"),
    "value_head_stride": lambda b, q, k, v, c: (b.build(SDPA), None, q, k, heads_innermost(v), c, None,
                                                "value .* head dimension must be contiguous"),
    "output_head_stride": lambda b, q, k, v, c: (b.build(SDPA), None, q, k, v, c, heads_innermost(torch.empty_like(q)),
                                                 "output has strides .* must be contiguous"),
    # rows strided, as a fused projection's slice: refused for the output (inputs take them: the
    # differential test's fused draws)
    "output_row_stride": lambda b, q, k, v, c: (b.build(SDPA), None, q, k, v, c,
                                                torch.empty(q.shape[0], 2 * HQ, D)[:, :HQ], "must be contiguous"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_of_kind_is_checked_in_full(batch, static_checks, change):
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    both_ops(name, batch.build(SDPA), q, k, v, batch.kv_cache)
    md, rows, q2, k2, v2, cache, output, match = CHANGES[change](batch, q, k, v, batch.kv_cache)
    if rows is not None:
        q2, k2, v2 = q2[:rows], k2[:rows], v2[:rows]
    before = len(static_checks)
    # the message the full check gives, without any layer's memory
    with pytest.raises(ValueError, match=match) as cold:
        validation.check_step(call.impl, T.DECODER, md, q2, k2, v2, cache)
        validation.check_output(q2, output if output is not None else torch.empty_like(q2))
    with Untouched(batch.kv_cache), Untouched(cache), ca.set_forward_context(md), \
            pytest.raises(ValueError) as warm:
        if output is None:
            torch.ops.compiled_attn.kv_cache_update(q2, k2, v2, cache, name)
        else:
            torch.ops.compiled_attn.torch_sdpa_attention(q2, k2, v2, cache, output, name)
    assert str(warm.value) == str(cold.value)
    assert len(static_checks) > before + 1  # the cold reference, then the op's own full check
    assert len(call.checked_kinds) == 1  # nothing remembered for the refused kind


def test_an_equal_spec_of_its_own_is_a_new_kind(batch, static_checks):
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    both_ops(name, batch.build(SDPA), q, k, v, batch.kv_cache)
    twin = SDPA.get_builder_cls()(make_spec())  # equal fields, another object
    both_ops(name, twin.build(batch.seq_lens, batch.query_lens, batch.block_tables), q, k, v, batch.kv_cache)
    assert len(static_checks) == 2 and len(call.checked_kinds) == 2


def test_options_unlike_a_new_spec_are_refused_after_a_warm_step():
    """FLASHINFER plans from the spec: a layer warm on one spec is refused on another spec's
    metadata (its window differs) before the cache write."""
    d = 64  # a head size FlashInfer has
    spec = make_spec(head_size=d, dtype=torch.bfloat16, block_size=16, num_blocks=8)
    name, call = FlashInferBackend.get_impl_cls()(HQ, d, d**-0.5, HKV).register(1.0, 1.0, T.DECODER)
    cache = torch.zeros(2, 8, 16, HKV, d, dtype=torch.bfloat16)
    q, k = torch.randn(2, HQ, d, dtype=torch.bfloat16), torch.randn(2, HKV, d, dtype=torch.bfloat16)
    args = ([5, 9], [1, 1], [[0], [1]])
    with ca.set_forward_context(FlashInferBackend.get_builder_cls()(spec).build(*args)):
        torch.ops.compiled_attn.kv_cache_update(q, k, k, cache, name)
    windowed = FlashInferBackend.get_builder_cls()(dataclasses.replace(spec, sliding_window=4)).build(*args)
    with Untouched(cache), ca.set_forward_context(windowed), pytest.raises(ValueError, match="sliding_window"):
        torch.ops.compiled_attn.kv_cache_update(q, k, k, cache, name)
    assert len(call.checked_kinds) == 1


def test_a_refused_call_raises_every_time(batch):
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    for _ in range(3):
        with Untouched(batch.kv_cache), ca.set_forward_context(batch.build(SDPA)), \
                pytest.raises(ValueError, match="kv_cache has shape"):
            torch.ops.compiled_attn.kv_cache_update(q, k, v, batch.kv_cache[:, :-1].clone(), name)
    assert not call.checked_kinds


def test_a_warm_layer_refuses_a_wrong_dtype_on_the_very_step_it_passed(batch):
    """The forward's metadata facts are read once (`StepFacts`), the layer's kind is remembered:
    neither hides a dtype that changes within one forward."""
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    md = batch.build(SDPA)
    with ca.set_forward_context(md):
        torch.ops.compiled_attn.kv_cache_update(q, k, v, batch.kv_cache, name)
        torch.ops.compiled_attn.torch_sdpa_attention(q, k, v, batch.kv_cache, torch.empty_like(q), name)
        for args, match in (((q.double(), k.double(), v.double()), "kv_cache dtype"),
                            ((q, k, v.double()), "value dtype")):
            with Untouched(batch.kv_cache), pytest.raises(ValueError, match=match):
                torch.ops.compiled_attn.kv_cache_update(*args, batch.kv_cache, name)
    with ca.set_forward_context(dataclasses.replace(md, backend_name="XFORMERS")), \
            pytest.raises(ValueError, match="got metadata built for XFORMERS"):
        torch.ops.compiled_attn.kv_cache_update(q, k, v, batch.kv_cache, name)
    assert len(call.checked_kinds) == 1


def test_a_fresh_view_of_the_cache_is_the_kind_it_passed(batch, static_checks):
    """A cache is recognised by identity, else by shape, dtype, device and layout: a model that
    hands each step a new view of the same cache is not checked in full every step."""
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    for _ in range(3):
        both_ops(name, batch.build(SDPA), q, k, v, batch.kv_cache[:])
    assert len(static_checks) == 1 and len(call.checked_kinds) == 1


def test_a_cache_resized_in_place_is_checked_again(batch):
    """The very tensor the layer passed with, shrunk in place by one block: refused before any
    write, as a new tensor of that shape would be."""
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    cache = batch.kv_cache.clone()
    both_ops(name, batch.build(SDPA), q, k, v, cache)
    cache.set_(cache.untyped_storage(), 0, (cache.shape[0], cache.shape[1] - 1, *cache.shape[2:]))
    with Untouched(cache), ca.set_forward_context(batch.build(SDPA)), \
            pytest.raises(ValueError, match="kv_cache has shape"):
        torch.ops.compiled_attn.kv_cache_update(q, k, v, cache, name)
    assert len(call.checked_kinds) == 1


def test_a_cache_restrided_in_place_is_checked_again(batch):
    """The very tensor the layer passed with, given the same shape over other strides in place
    (`set_`): no longer contiguous, so refused before any write, as a new tensor would be."""
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    cache = batch.kv_cache.clone()
    both_ops(name, batch.build(SDPA), q, k, v, cache)
    two, nb, bs, h, d = cache.shape
    cache.set_(torch.empty(cache.numel()).untyped_storage(), 0, cache.shape, (nb * bs * h * d, h * d, nb * h * d, d, 1))
    assert cache.shape == batch.kv_cache.shape and not cache.is_contiguous()
    with Untouched(cache), ca.set_forward_context(batch.build(SDPA)), \
            pytest.raises(ValueError, match="kv_cache must be contiguous"):
        torch.ops.compiled_attn.kv_cache_update(q, k, v, cache, name)


def test_a_cache_given_another_dtype_in_place_is_checked_again(batch):
    """The very tensor the layer passed with, its data replaced by another dtype's (`.data =`, as
    `module.half()` does to a Parameter): refused before any write, as a new tensor would be."""
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    cache = batch.kv_cache.clone()
    both_ops(name, batch.build(SDPA), q, k, v, cache)
    cache.data = torch.randn(cache.shape, dtype=torch.float64)
    with Untouched(cache), ca.set_forward_context(batch.build(SDPA)), \
            pytest.raises(ValueError, match="kv_cache dtype torch.float64"):
        torch.ops.compiled_attn.kv_cache_update(q, k, v, cache, name)


def test_a_layer_does_not_keep_a_dropped_cache_alive(batch):
    name, _keep = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    cache = batch.kv_cache.clone()
    both_ops(name, batch.build(SDPA), q, k, v, cache)
    dropped = weakref.ref(cache)
    del cache
    gc.collect()
    assert dropped() is None


def test_the_metadata_is_read_once_per_forward_for_all_layers(batch, monkeypatch):
    layers = [sdpa_impl().register(1.0, 1.0, T.DECODER) for _ in range(4)]
    q, k, v = op_args(batch)
    for name, _ in layers:  # warm: each layer's full check reads the rows itself
        both_ops(name, batch.build(SDPA), q, k, v, batch.kv_cache)
    rows = []
    real = validation.step_rows
    monkeypatch.setattr(validation, "step_rows", lambda *a: rows.append(a) or real(*a))
    for step in range(1, 3):
        with ca.set_forward_context(batch.build(SDPA)):
            for name, _ in layers:
                torch.ops.compiled_attn.kv_cache_update(q, k, v, batch.kv_cache, name)
                torch.ops.compiled_attn.torch_sdpa_attention(q, k, v, batch.kv_cache, torch.empty_like(q), name)
        assert len(rows) == step  # once per forward, for its 8 op calls


# -------------------------------------------------------------------------------------------
# Bounded


def test_remembered_kinds_stay_bounded(batch):
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    for _ in range(3 * CALL_KINDS_KEPT):  # a caller making a new spec (a new kind) every step
        md = SDPA.get_builder_cls()(make_spec()).build(batch.seq_lens, batch.query_lens, batch.block_tables)
        both_ops(name, md, q, k, v, batch.kv_cache)
        assert len(call.checked_kinds) <= CALL_KINDS_KEPT
    builder = SDPA.get_builder_cls()(batch.spec)
    call.checked_kinds.clear()
    for _ in range(50):  # many steps of one kind: one entry for both ops
        both_ops(name, builder.build(batch.seq_lens, batch.query_lens, batch.block_tables), q, k, v, batch.kv_cache)
    assert len(call.checked_kinds) == 1


def test_kinds_hold_their_spec_so_its_id_is_not_reused(batch):
    name, call = sdpa_impl().register(1.0, 1.0, T.DECODER)
    q, k, v = op_args(batch)
    spec = make_spec()
    both_ops(name, SDPA.get_builder_cls()(spec).build(batch.seq_lens, batch.query_lens, batch.block_tables),
             q, k, v, batch.kv_cache)
    assert len(call.checked_kinds) == 1 and call.checked_kinds[0].metadata.spec is spec
