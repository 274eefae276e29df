"""Misuse of the public entry points: the contract's error type, a message naming the problem,
raised before anything is written, and (on the device) without syncing it.

tests/test_errors.py covers the impl's shape checks, unsupported options, unknown names and the
builder's step validation; this file covers what it does not: the ops called directly (no forward
context, dead layer names), cache layout and size, metadata of a real other backend, lifecycle
misuse of the graph State and runner, inputs the validation does not catch yet (strict xfails
naming where the check belongs: fixing one turns its test red, so the marker is dropped) and,
on the device, mixed devices and the absence of syncs in validation and in the hot path.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from reference import make_batch

import compiled_attn as ca
from compiled_attn.backends.flashinfer import FlashInferBackend
from compiled_attn.forward_context import get_layer
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model
from compiled_attn.registry import BACKEND_CLASSES

T = ca.AttentionType
SDPA = ca.get_attn_backend("TORCH_SDPA")
HQ, HKV, D, BS, NB = 8, 2, 16, 4, 16


def make_spec(**kw) -> ca.AttentionSpec:
    args = dict(num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS, num_blocks=NB, dtype=torch.float32,
                device="cpu")
    return ca.AttentionSpec(**(args | kw))


def sdpa_impl(**kw) -> ca.AttentionImpl:
    return SDPA.get_impl_cls()(**(dict(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV) | kw))


@pytest.fixture
def batch():
    return make_batch(make_spec(), [9, 6, 13], [9, 2, 1], seed=11)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class Untouched:
    """`with Untouched(cache):` fails if the block changes a byte of `cache` (NaN-safe)."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache, self.before = cache, cache.clone()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        assert same_bits(self.cache, self.before), "the cache was written before the error"


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.view(x.shape[0], n, D)


# -------------------------------------------------------------------------------------------
# The ops called directly


def test_attention_op_outside_forward_context_raises(batch):
    name, _keep = sdpa_impl().register(1.0, 1.0, T.DECODER)
    out = torch.empty(batch.query.shape[0], HQ, D)
    with Untouched(batch.kv_cache), pytest.raises(RuntimeError, match="outside set_forward_context.*wrap"):
        torch.ops.compiled_attn.torch_sdpa_attention(heads(batch.query, HQ), heads(batch.key, HKV),
                                                     heads(batch.value, HKV), batch.kv_cache, out, name)


def test_cache_update_op_outside_forward_context_writes_nothing(batch):
    name, _keep = sdpa_impl().register(1.0, 1.0, T.DECODER)
    with Untouched(batch.kv_cache), pytest.raises(RuntimeError, match="outside set_forward_context"):
        torch.ops.compiled_attn.kv_cache_update(heads(batch.query, HQ), heads(batch.key, HKV), heads(batch.value, HKV),
                                                batch.kv_cache, name)


def test_op_with_the_name_of_a_dead_layer_writes_nothing(batch):
    name, keep = sdpa_impl().register(1.0, 1.0, T.DECODER)
    del keep  # the registry holds layers weakly: the name dies with its layer
    with Untouched(batch.kv_cache), ca.set_forward_context(batch.build(SDPA)), \
            pytest.raises(RuntimeError, match="no attention layer named .* is alive"):
        torch.ops.compiled_attn.kv_cache_update(heads(batch.query, HQ), heads(batch.key, HKV), heads(batch.value, HKV),
                                                batch.kv_cache, name)


def test_cache_update_op_for_a_layer_without_a_cache_writes_nothing():
    """kv_cache_update called directly for an ENCODER_ONLY layer, on a step of fresh prompts that
    its checks accept (they cover no cache): it must write none, though the step's slots are real."""
    prompts = make_batch(make_spec(), [3, 5], [3, 5], seed=2)
    name, _keep = sdpa_impl().register(1.0, 1.0, T.ENCODER_ONLY)
    md = prompts.build(SDPA)
    assert (md.slot_mapping >= 0).all()
    with Untouched(prompts.kv_cache), ca.set_forward_context(md), \
            pytest.raises(ValueError, match=rf"^layer '{name}' is ENCODER_ONLY attention, which has no KV cache: "
                                            r"kv_cache_update serves DECODER and ENCODER_DECODER layers$"):
        torch.ops.compiled_attn.kv_cache_update(heads(prompts.query, HQ), heads(prompts.key, HKV),
                                                heads(prompts.value, HKV), prompts.kv_cache, name)


def test_attention_op_of_a_cacheless_layer_without_key_and_value_raises():
    """The op called directly with key / value None for an ENCODER_ONLY layer, which reads them
    (it has no cache): a ValueError both on the layer's first call and after a call of the kind
    has passed (the per-step fast path), not a TypeError from inside the kernel."""
    prompts = make_batch(make_spec(attn_type=T.ENCODER_ONLY), [3, 5], [3, 5], seed=2)
    name, _keep = sdpa_impl().register(1.0, 1.0, T.ENCODER_ONLY)
    q, out = heads(prompts.query, HQ), torch.empty(prompts.query.shape[0], HQ, D)
    op = torch.ops.compiled_attn.torch_sdpa_attention
    with ca.set_forward_context(prompts.build(SDPA)):
        for first in (True, False):
            with Untouched(out), pytest.raises(ValueError, match=r"^ENCODER_ONLY attention reads the step's key and "
                                                                 r"value \(it has no cache\): they may not be None$"):
                op(q, None, None, None, out, name)
            if first:  # a valid call of the kind: later calls take the fast path
                op(q, heads(prompts.key, HKV), heads(prompts.value, HKV), None, out, name)


def test_an_eager_call_keeps_its_layer_record_until_its_ops_return(batch):
    """Another thread's eager calls may evict this call's layer record while its ops run, and a
    dead layer's name goes to the next layer of its kind: the call holds the record, so its ops
    still find its own layer."""
    impl, seen = sdpa_impl(), []
    real_run = impl.run

    def run_after_an_eviction(query, key, value, kv_cache, attn_type, layer_name):
        impl._eager_calls.clear()  # evicted meanwhile
        other_name, _other = sdpa_impl().register(1.0, 1.0, T.DECODER)  # the next layer of its kind
        seen.append((get_layer(layer_name).impl is impl, other_name != layer_name))
        return real_run(query, key, value, kv_cache, attn_type, layer_name)

    impl.run = run_after_an_eviction
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.build(SDPA))
    assert seen == [(True, True)]


def test_layer_under_metadata_of_another_backend_writes_nothing(batch):
    layer = ca.Attention(HQ, D, D**-0.5, HKV, backend="TORCH_SDPA")
    md = dataclasses.replace(batch.build(SDPA), backend_name="XFORMERS")
    with Untouched(batch.kv_cache), ca.set_forward_context(md), \
            pytest.raises(ValueError, match=r"TORCH_SDPA got metadata built for XFORMERS; build it with TORCH_SDPA's "
                          r"builder .*, or give the layers XFORMERS: ca.Attention\(..., backend='XFORMERS'\) or "
                          r"\$COMPILED_ATTN_BACKEND=XFORMERS"):
        layer(batch.query, batch.key, batch.value, batch.kv_cache)


# -------------------------------------------------------------------------------------------
# Cache layout and size against the metadata


def test_non_contiguous_cache_raises(batch):
    strided = batch.kv_cache.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, block-major storage
    with Untouched(strided), pytest.raises(ValueError, match=r"contiguous \(allocate it with torch.empty"):
        sdpa_impl().forward(batch.query, batch.key, batch.value, strided, batch.build(SDPA))


def test_cache_larger_than_the_spec_raises(batch):
    # a cache of another spec: its block ids would not be the metadata's
    big = torch.cat([batch.kv_cache, batch.kv_cache], dim=1)
    with Untouched(big), pytest.raises(ValueError, match=r"expected \(2, 16, 4, 2, 16\).*get_kv_cache_shape"):
        sdpa_impl().forward(batch.query, batch.key, batch.value, big, batch.build(SDPA))


def test_metadata_built_for_another_block_size_raises(batch):
    other = make_spec(block_size=8, num_blocks=8)
    md = SDPA.get_builder_cls()(other).build(batch.seq_lens, batch.query_lens, [[0, 1], [2], [3, 4]])
    with Untouched(batch.kv_cache), pytest.raises(ValueError, match=r"kv_cache has shape .* expected \(2, 8, 8"):
        sdpa_impl().forward(batch.query, batch.key, batch.value, batch.kv_cache, md)


def test_integer_keys_raise(batch):
    with Untouched(batch.kv_cache), pytest.raises(ValueError, match="must be one float dtype"):
        sdpa_impl().forward(batch.query.int(), batch.key.int(), batch.value.int(), batch.kv_cache, batch.build(SDPA))


def test_unknown_attention_type_raises(batch):
    with Untouched(batch.kv_cache), pytest.raises(ValueError, match="'bogus' is not a valid AttentionType"):
        sdpa_impl().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.build(SDPA), attn_type="bogus")


# -------------------------------------------------------------------------------------------
# Metadata of a real other backend (not just a renamed field)


def test_flashinfer_metadata_on_torch_sdpa_raises(batch):
    spec = make_spec(head_size=64, dtype=torch.bfloat16)
    md = FlashInferBackend.get_builder_cls()(spec).build(batch.seq_lens, batch.query_lens, batch.block_tables)
    with Untouched(batch.kv_cache), pytest.raises(ValueError, match="TORCH_SDPA got metadata built for FLASHINFER"):
        sdpa_impl().forward(batch.query, batch.key, batch.value, batch.kv_cache, md)


def test_torch_sdpa_metadata_on_flashinfer_writes_nothing():
    spec = make_spec(head_size=64, dtype=torch.bfloat16)
    b = make_batch(spec, [9, 6, 13], [9, 2, 1], seed=12)
    impl = FlashInferBackend.get_impl_cls()(HQ, 64, 64**-0.5, num_kv_heads=HKV)
    with Untouched(b.kv_cache), pytest.raises(ValueError, match="FLASHINFER got metadata built for TORCH_SDPA"):
        impl.forward(b.query, b.key, b.value, b.kv_cache, b.build(SDPA))


# -------------------------------------------------------------------------------------------
# Graph State and runner lifecycle (CPU: the runner's static-buffer step, use_cuda_graphs=False)

TINY = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def tiny_spec(**kw) -> ca.AttentionSpec:
    return TINY.attention_spec(block_size=4, num_blocks=32, dtype=torch.float32, device="cpu",
                               max_seq_len_to_capture=32, **kw)


@pytest.fixture
def runner() -> CUDAGraphRunner:
    spec = tiny_spec()
    caches = [c.normal_() for c in allocate_kv_caches(TINY, SDPA, spec)]
    r = CUDAGraphRunner(build_model(TINY, seed=0, backend="TORCH_SDPA"), SDPA, spec, caches, capture_sizes=[1, 2],
                        max_batch_size=2, use_cuda_graphs=False, progress=False)
    r.capture()
    return r


@pytest.mark.parametrize("batch_size", [2.0, "2"])
def test_graph_clone_of_a_batch_size_not_an_int_raises_naming_it(batch_size):
    state = SDPA.get_state_cls()(tiny_spec())
    with state.graph_capture(2):
        state.graph_capture_get_metadata_for_batch(2)
        with pytest.raises(ValueError, match=r"^batch_size must be an int, got "):
            state.graph_clone(batch_size)


def test_graph_clone_before_graph_capture_raises():
    with pytest.raises(RuntimeError, match=r"graph_clone\(2\) before graph_capture"):
        SDPA.get_state_cls()(tiny_spec()).graph_clone(2)


def test_runner_metadata_for_another_cache_size_raises(runner):
    other = dataclasses.replace(tiny_spec(), num_blocks=64)
    md = SDPA.get_builder_cls()(other).build([5], [1], [[40, 41]])
    before = [c.clone() for c in runner.kv_caches]
    with pytest.raises(ValueError, match="num_blocks=64.*does not match the state's spec"):
        runner.run(md, torch.tensor([3]), torch.tensor([4]))
    assert all(same_bits(a, b) for a, b in zip(runner.kv_caches, before, strict=True))


def test_runner_serves_metadata_of_an_equal_spec_made_apart(runner):
    # a distinct spec object of the same options, its scale written out 1 ulp away (as 1 / sqrt(d)
    # is from d**-0.5 for head sizes 72 .. 192)
    spec = dataclasses.replace(tiny_spec(), scale=math.nextafter(tiny_spec().softmax_scale, 1.0))
    md = SDPA.get_builder_cls()(spec).build([5], [1], [[1, 2]])
    eager = [c.clone() for c in runner.kv_caches]
    with ca.set_forward_context(md):
        want = runner.model(torch.tensor([3]), torch.tensor([4]), eager)
    torch.testing.assert_close(runner.run(md, torch.tensor([3]), torch.tensor([4])), want)


@pytest.mark.parametrize(("other", "field"), [(dict(sliding_window=4), "sliding_window"),
                                               (dict(scale=1.0), "softmax_scale"),
                                               (dict(logits_soft_cap=5.0), "logits_soft_cap")],
                         ids=["window", "scale", "soft-cap"])
def test_runner_metadata_for_another_spec_raises(runner, other, field):
    # replayed, the step runs on the State's metadata: nothing else would see its own spec's options
    # (the window's builder rolls tables: blocks before the window are freed, -1)
    rolling = "sliding_window" in other
    builder = SDPA.get_builder_cls()(dataclasses.replace(tiny_spec(), **other), rolling_tables=rolling)
    md = builder.build([30], [1], [[-1] * 6 + [10, 11]] if rolling else [[1, 2, 3, 4, 5, 6, 7, 8]])
    before = [c.clone() for c in runner.kv_caches]
    with pytest.raises(ValueError, match=rf"^metadata built for another spec than the state's \({field} "):
        runner.run(md, torch.tensor([3]), torch.tensor([29]))
    assert all(same_bits(a, b) for a, b in zip(runner.kv_caches, before, strict=True))


def test_runner_after_a_cache_is_reallocated_in_place_raises(runner):
    # same tensor object, new storage (what resize_ / set_ / an offload round trip may do)
    md = SDPA.get_builder_cls()(tiny_spec()).build([5], [1], [[1, 2]])
    cache = runner.kv_caches[0]
    cache.set_(torch.empty_like(cache))
    with pytest.raises(RuntimeError, match="not the ones the graphs were captured with.*new CUDAGraphRunner"):
        runner.run(md, torch.tensor([3]), torch.tensor([4]))


def test_runner_after_a_cache_is_resized_in_place_raises(runner):
    # a smaller resize_ keeps the address, but a replay would write at the captured strides
    md = SDPA.get_builder_cls()(tiny_spec()).build([5], [1], [[1, 2]])
    cache = runner.kv_caches[0]
    address = cache.data_ptr()
    cache.resize_(cache.shape[0], cache.shape[1] // 2, *cache.shape[2:])
    assert cache.data_ptr() == address
    with pytest.raises(RuntimeError, match="not the ones the graphs were captured with.*new CUDAGraphRunner"):
        runner.run(md, torch.tensor([3]), torch.tensor([4]))


# -------------------------------------------------------------------------------------------
# Inputs the validation once let through (each used to write the cache, or crash, before an error)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_inputs_of_another_dtype_than_the_cache_raise_before_writing(batch, dtype):
    q, k, v = (x.to(dtype) for x in (batch.query, batch.key, batch.value))
    with Untouched(batch.kv_cache), pytest.raises(ValueError, match="dtype"):
        sdpa_impl().forward(q, k, v, batch.kv_cache, batch.build(SDPA))


def test_flashinfer_query_dtype_unlike_the_spec_raises_before_writing():
    spec = make_spec(head_size=64, dtype=torch.bfloat16)
    b = make_batch(spec, [9, 6, 13], [9, 2, 1], seed=13)
    impl = FlashInferBackend.get_impl_cls()(HQ, 64, 64**-0.5, num_kv_heads=HKV)
    q, k, v = (x.float() for x in (b.query, b.key, b.value))
    with Untouched(b.kv_cache), pytest.raises(ValueError, match="dtype"):
        impl.forward(q, k, v, b.kv_cache, b.build(FlashInferBackend))


def test_flashinfer_layer_heads_unlike_the_spec_raise():
    spec = make_spec(head_size=64, dtype=torch.bfloat16)
    b = make_batch(dataclasses.replace(spec, num_heads=2 * HQ), [9, 6, 13], [9, 2, 1], seed=14)
    impl = FlashInferBackend.get_impl_cls()(2 * HQ, 64, 64**-0.5, num_kv_heads=HKV)
    md = FlashInferBackend.get_builder_cls()(spec).build(b.seq_lens, b.query_lens, b.block_tables)
    with Untouched(b.kv_cache), pytest.raises(ValueError, match="num_heads"):
        impl.forward(b.query, b.key, b.value, b.kv_cache, md)


@pytest.mark.parametrize("kw", [{"scale": 0.5}, {"sliding_window": 4}, {"logits_soft_cap": 5.0}],
                         ids=["scale", "window", "soft_cap"])
def test_flashinfer_layer_options_unlike_the_spec_raise_before_writing(kw):
    # FlashInfer plans these per step from the spec; the layer's must match before anything runs
    spec = make_spec(head_size=64, dtype=torch.bfloat16)
    b = make_batch(spec, [9, 6, 13], [9, 2, 1], seed=15)
    impl = FlashInferBackend.get_impl_cls()(**(dict(num_heads=HQ, head_size=64, scale=64**-0.5, num_kv_heads=HKV) | kw))
    with Untouched(b.kv_cache), pytest.raises(ValueError, match="from the spec"):
        impl.forward(b.query, b.key, b.value, b.kv_cache, b.build(FlashInferBackend))


def test_fp8_cache_for_an_auto_layer_raises_before_writing(batch):
    cache = batch.kv_cache.to(torch.float8_e4m3fn)
    with Untouched(cache), pytest.raises(ValueError, match="kv_cache dtype"):
        sdpa_impl().forward(batch.query, batch.key, batch.value, cache, batch.build(SDPA))


def test_query_on_another_device_than_the_cache_raises(batch):
    with Untouched(batch.kv_cache), pytest.raises(ValueError, match="device"):
        sdpa_impl().forward(batch.query.to("meta"), batch.key, batch.value, batch.kv_cache, batch.build(SDPA))


def test_forward_with_something_else_than_metadata_raises(batch):
    with pytest.raises(ValueError, match="AttentionMetadata"):
        sdpa_impl().forward(batch.query, batch.key, batch.value, batch.kv_cache, {"slot_mapping": None})


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf])
def test_bad_kv_scales_raise(scale):
    with pytest.raises(ValueError, match="k_scale"):
        ca.Attention(HQ, D, D**-0.5, HKV, backend="TORCH_SDPA", k_scale=scale)


@pytest.mark.parametrize("kw", [{"head_size": 0}, {"scale": math.nan}, {"scale": math.inf}],
                         ids=["head_size_0", "scale_nan", "scale_inf"])
def test_bad_impl_sizes_and_scale_raise(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        sdpa_impl(**kw)


def test_fractional_sliding_window_raises():
    with pytest.raises(ValueError, match="sliding_window"):
        sdpa_impl(sliding_window=2.5)


@pytest.mark.parametrize("kw", [{"dtype": torch.int32}, {"max_seq_len_to_capture": 0}], ids=["int_dtype", "max_len"])
def test_bad_spec_dtype_and_capture_length_raise(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        make_spec(**kw)


@pytest.mark.parametrize("block", [0.5, True], ids=["float", "bool"])
def test_non_integer_block_ids_raise(block):
    with pytest.raises(ValueError, match="block"):
        SDPA.get_builder_cls()(make_spec()).build([3], [3], [[block]])


# -------------------------------------------------------------------------------------------
# Device: mixed devices, no syncs in validation or in the hot path


def cuda_backends() -> list:
    return [pytest.param(name, id=name) for name in BACKEND_CLASSES()]


def cuda_setup(name: str):
    """(backend, spec, batch, impl, md) of a mixed batch on CUDA in the backend's preferred layout."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    backend = BACKEND_CLASSES()[name]
    if backend.unavailable_reason() is not None:
        pytest.skip(f"{name} unavailable: {backend.unavailable_reason()}")
    block_size = next(b for b in (16, 64) if backend.supports_block_size(b))
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=block_size, num_blocks=32,
                            dtype=torch.bfloat16, device="cuda")
    b = make_batch(spec, [70, 6, 130, 33], [70, 2, 1, 1], seed=21)
    impl = backend.get_impl_cls()(8, 64, spec.softmax_scale, num_kv_heads=2)
    return backend, spec, b, impl, b.build(backend)


@pytest.mark.gpu
@pytest.mark.parametrize("name", cuda_backends())
@pytest.mark.parametrize("which", [
    "query",
    "key_value", "cache", "metadata"])
def test_mixed_devices_raise_before_writing(name, which):
    backend, spec, b, impl, md = cuda_setup(name)
    q, k, v, cache = b.query, b.key, b.value, b.kv_cache
    if which == "query":
        q = q.cpu()
    elif which == "key_value":
        k, v = k.cpu(), v.cpu()
    elif which == "cache":
        cache = cache.cpu()
    else:
        md = backend.get_builder_cls()(dataclasses.replace(spec, device="cpu")).build(
            b.seq_lens, b.query_lens, b.block_tables)
    with Untouched(cache), pytest.raises(ValueError, match="device"):
        impl.forward(q, k, v, cache, md)


@pytest.mark.gpu
@pytest.mark.parametrize("name", cuda_backends())
def test_inputs_of_another_dtype_raise_before_writing_cuda(name):
    _, _, b, impl, md = cuda_setup(name)
    q, k, v = (x.half() for x in (b.query, b.key, b.value))
    with Untouched(b.kv_cache), pytest.raises(ValueError, match="dtype"):
        impl.forward(q, k, v, b.kv_cache, md)


@contextmanager
def sync_is_an_error() -> Iterator[None]:
    """Any synchronising CUDA call inside the block raises (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("name", cuda_backends())
@pytest.mark.parametrize("misuse", ["query_rows", "cache_too_small", "foreign_metadata"])
def test_validation_raises_without_syncing(name, misuse):
    _, _, b, impl, md = cuda_setup(name)
    impl.forward(b.query, b.key, b.value, b.kv_cache.clone(), md)  # warm-up: lazy planning, kernel loads
    q, k, v, cache = b.query, b.key, b.value, b.kv_cache
    if misuse == "query_rows":
        q = q[:-1]
    elif misuse == "cache_too_small":
        cache = cache[:, : cache.shape[1] // 2].clone()
    else:
        md = copy.copy(md)
        md.backend_name = "NOT_" + name
    # sync_is_an_error exits first: the cache comparison after it may sync
    with Untouched(cache), pytest.raises(ValueError), sync_is_an_error():
        impl.forward(q, k, v, cache, md)


@pytest.mark.gpu
@pytest.mark.parametrize("name", cuda_backends())
def test_forward_on_built_metadata_does_not_sync(name):
    _, _, b, impl, md = cuda_setup(name)
    impl.forward(b.query, b.key, b.value, b.kv_cache, md)  # warm-up: lazy planning, kernel loads
    with sync_is_an_error():
        out = impl.forward(b.query, b.key, b.value, b.kv_cache, md)
    assert out.shape == b.query.shape
