"""FLASHINFER backend: page layout, planning and padding on CPU (a stand-in FlashInfer records
plan calls); every feature against the float64 reference, graphs and opcheck on the device.

Kernel variants compile for 10-60 s each, so the GPU feature cases are a pairwise design over
(dtype, head size, cache dtype, GQA group, window, soft-cap, ALiBi): test_differential.FEATURE_CASES.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys
import types
import unittest.mock
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given
from reference import alibi_slopes, captured, make_batch, reference_attention, reference_forward, rel_err
from test_differential import CI_LIMITS, FEATURE_CASES, cases, check_against_reference, differential_settings

import compiled_attn as ca
import compiled_attn.ops
from compiled_attn.backends import flashinfer as fib
from compiled_attn.backends.flashinfer import FlashInferBackend
from compiled_attn.backends.xformers import XFormersBackend

KINDS = ca.AttentionType
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")
BF16_TOL = 1e-2
# The reference already holds the fp8-rounded K/V (reference.round_trip), so what remains is the
# 16-bit rounding of probabilities and output, plus one more output rounding by FlashInfer's
# `out *= v_scale` after the kernel: twice the 16-bit bound.
FP8_TOL = 2e-2


def spec_of(device: str = "cpu", **kw) -> ca.AttentionSpec:
    base = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, num_blocks=64,
                dtype=torch.bfloat16, device=device)
    return ca.AttentionSpec(**{**base, **kw})


# ---------------------------------------------------------------------------------------------
# CPU: page layout


def expected_layout(seq_lens, tables, block_size):
    indptr, indices, last = [0], [], []
    for s, t in zip(seq_lens, tables, strict=True):
        pages = (s + block_size - 1) // block_size
        indices += t[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(s - (pages - 1) * block_size)
    return indptr, indices, last


@pytest.mark.parametrize("seed", range(5))
def test_builder_page_layout_matches_tables_for_random_batches(seed):
    rng = random.Random(seed)
    spec = spec_of(block_size=rng.choice([1, 8, 16]), num_blocks=4096)
    n_pre, n_dec = rng.randint(0, 4), rng.randint(0, 6)
    seq_lens, query_lens = [], []
    for _ in range(n_pre):
        s = rng.randint(1, 300)
        seq_lens.append(s)
        query_lens.append(rng.randint(1, s))
    for _ in range(n_dec or (0 if n_pre else 1)):
        seq_lens.append(rng.randint(2, 300))
        query_lens.append(1)
    blocks = torch.randperm(spec.num_blocks).tolist()
    tables, at = [], 0
    for s in seq_lens:
        n = (s + spec.block_size - 1) // spec.block_size + rng.randint(0, 2)  # tables may run longer
        tables.append(blocks[at : at + n])
        at += n
    md = FlashInferBackend.get_builder_cls()(spec).build(seq_lens, query_lens, tables)
    indptr, indices, last = expected_layout(seq_lens, tables, spec.block_size)
    for t in (md.qo_indptr, md.paged_kv_indptr, md.paged_kv_indices, md.paged_kv_last_page_len):
        assert t.dtype == torch.int32
    assert md.qo_indptr.tolist() == np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    assert md.paged_kv_indptr.tolist() == indptr
    assert md.paged_kv_indices.tolist() == indices
    assert md.paged_kv_last_page_len.tolist() == last
    assert all(1 <= x <= spec.block_size for x in last)


def test_encoder_only_metadata_has_qo_indptr_and_no_pages():
    spec = spec_of(attn_type=KINDS.ENCODER_ONLY)
    md = FlashInferBackend.get_builder_cls()(spec).build([5, 3], [5, 3], [])
    assert md.qo_indptr.tolist() == [0, 5, 8]
    assert md.paged_kv_indptr is None


# ---------------------------------------------------------------------------------------------
# CPU: planning with a stand-in FlashInfer that records plan() calls (conftest's fake_flashinfer)


def mixed_md(spec, builder=None):
    builder = builder or FlashInferBackend.get_builder_cls()(spec)
    # prefills: fresh 20-token prompt, 5-token chunk over 35 cached; decodes: 17 and 2 tokens
    return builder.build([20, 40, 17, 2], [20, 5, 1, 1], [[1, 2], [3, 4, 5], [6, 7], [8]])


def test_mixed_step_plans_prefill_and_rebased_decode_once(fake_flashinfer):
    spec = spec_of(sliding_window=32, logits_soft_cap=30.0)
    md = mixed_md(spec)
    for _ in range(3):  # three layers, one plan
        md.step_plan.ensure_planned(md)
    pre, dec = md.step_plan.wrapper("prefill"), md.step_plan.wrapper("decode")
    assert len(pre.plans) == 1 and len(dec.plans) == 1
    (qo, kv_indptr, indices, last, *dims), kw = pre.plans[0]
    assert (qo.tolist(), kv_indptr.tolist(), indices.tolist(), last.tolist()) == (
        [0, 20, 25], [0, 2, 5], [1, 2, 3, 4, 5], [4, 8])
    assert dims == [8, 2, 64, 16] and kw["causal"] is True
    (kv_indptr, indices, last, *dims), kw = dec.plans[0]
    assert (kv_indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2, 3], [6, 7, 8], [1, 2])
    assert kw["window_left"] == 31 and kw["logits_soft_cap"] == 30.0
    assert kw["pos_encoding_mode"] == "NONE" and kw["q_data_type"] == torch.bfloat16
    alibi = mixed_md(spec_of(alibi_slopes=alibi_slopes(8)))
    alibi.step_plan.ensure_planned(alibi)
    assert alibi.step_plan.wrapper("prefill").plans[0][1]["pos_encoding_mode"] == "ALIBI"


def test_a_mixed_step_as_prefill_plans_one_wrapper_over_every_row(fake_flashinfer, monkeypatch):
    """MIXED_STEP_ENV=prefill: the prefill wrapper plans the decodes' rows and pages too (FlashInfer's
    causal mask aligns each query to its last key, so a 1-token row sees its whole context); the
    decode wrapper plans nothing. A decode-only step still plans the decode wrapper."""
    monkeypatch.setenv(fib.MIXED_STEP_ENV, "prefill")
    builder = FlashInferBackend.get_builder_cls()(spec_of())
    md = mixed_md(spec_of(), builder)
    for _ in range(3):
        md.step_plan.ensure_planned(md)
    assert md.step_plan.is_planned(md) and md.step_plan.wrapper("decode").plans == []
    (plan, kw), = md.step_plan.wrapper("prefill").plans
    assert [t.tolist() for t in plan[:4]] == [[0, 20, 25, 26, 27], [0, 2, 5, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8],
                                              [4, 8, 1, 2]]
    assert kw["causal"] is True
    decode = builder.build([9, 3], [1, 1], [[2], [4]])
    decode.step_plan.ensure_planned(decode)
    assert decode.step_plan.wrapper("decode").plans[-1][0][0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("attn_type", [KINDS.DECODER, KINDS.ENCODER_ONLY])
def test_mixed_step_choice_is_checked(attn_type, monkeypatch):
    """Checked by every builder, those of specs that never mix (ENCODER_ONLY) too."""
    monkeypatch.setenv(fib.MIXED_STEP_ENV, "both")
    with pytest.raises(ValueError, match="COMPILED_ATTN_FLASHINFER_MIXED='both': use auto, split or prefill"):
        FlashInferBackend.get_builder_cls()(spec_of(attn_type=attn_type))


@pytest.mark.parametrize(("choice", "num_kv_heads", "one_prefill"), [
    (None, 2, True), ("auto", 2, True), ("auto", 4, False), ("", 4, False), ("split", 2, False),
    ("prefill", 8, True),
])
def test_mixed_step_choice_by_default_follows_tensor_core_decode(choice, num_kv_heads, one_prefill, monkeypatch):
    """auto (unset or empty too): one prefill where decode runs on tensor cores (GQA group >= 4,
    here 8 heads over 2 KV heads), split below; split and prefill hold for every group."""
    if choice is None:
        monkeypatch.delenv(fib.MIXED_STEP_ENV, raising=False)
    else:
        monkeypatch.setenv(fib.MIXED_STEP_ENV, choice)
    spec = spec_of(num_kv_heads=num_kv_heads)
    assert fib.decode_uses_tensor_cores(spec) == (num_kv_heads == 2)
    builder = FlashInferBackend.get_builder_cls()(spec)
    assert builder.build([9, 3], [4, 1], [[2], [4]]).step_plan.mixed_as_prefill == one_prefill
    encoder = FlashInferBackend.get_builder_cls()(spec_of(num_kv_heads=num_kv_heads, attn_type=KINDS.ENCODER_ONLY))
    assert not encoder.build([9, 3], [9, 3], [[2], [4]]).step_plan.mixed_as_prefill


def test_step_replans_a_wrapper_another_step_took_over(fake_flashinfer):
    spec = spec_of()
    builder = FlashInferBackend.get_builder_cls()(spec)
    first, second, third = (mixed_md(spec, builder) for _ in range(3))
    for md in (first, second, third):
        md.step_plan.ensure_planned(md)
    assert not first.step_plan.is_planned(first) and third.step_plan.is_planned(third)
    first.step_plan.ensure_planned(first)
    # first and third share a slot (two slots alternate): first planned again after third
    assert first.step_plan.wrapper("decode") is third.step_plan.wrapper("decode")
    assert first.step_plan.wrapper("decode") is not second.step_plan.wrapper("decode")
    assert len(first.step_plan.wrapper("decode").plans) == 3


def test_build_plans_a_step_holding_prefills_and_leaves_a_decode_step_to_its_first_use(fake_flashinfer,
                                                                                       monkeypatch):
    """A step with prefills never replays as a decode graph: build() plans it (a loop that builds
    while the GPU runs the previous step overlaps the plan with it), uploading its device fields
    with it; a decode-only step may replay as a graph, whose State plans its own wrappers, so its
    eager wrapper is planned only where it runs eagerly. A view (made for inspection) plans
    nothing, and evicts no step's plan."""
    monkeypatch.setattr(fib, "plans_in_build", lambda spec: True)  # a CUDA spec's answer, on this CPU spec
    spec = spec_of()
    builder = FlashInferBackend.get_builder_cls()(spec)
    mixed = mixed_md(spec, builder)
    prefill, decode_wrapper = mixed.step_plan.wrapper("prefill"), mixed.step_plan.wrapper("decode")
    assert len(prefill.plans) == 1 and len(decode_wrapper.plans) == 1 and mixed.is_uploaded("slot_mapping")
    assert mixed.step_plan.is_planned(mixed)
    assert mixed.prefill_metadata.num_seqs == 2 and mixed.decode_metadata.num_seqs == 2
    mixed.step_plan.ensure_planned(mixed)
    assert len(prefill.plans) == 1 and len(decode_wrapper.plans) == 1  # the views planned nothing
    decode = builder.build([17, 2], [1, 1], [[6, 7], [8]])
    assert decode.step_plan.wrapper("decode").plans == [] and not decode.is_uploaded("slot_mapping")
    assert not decode.step_plan.is_planned(decode)
    decode.step_plan.ensure_planned(decode)
    assert decode.step_plan.is_planned(decode)
    assert decode.step_plan.wrapper("decode").plans[-1][0][0].tolist() == [0, 2, 3]


def test_a_build_under_fake_tensor_mode_leaves_its_plan_to_its_first_use(fake_flashinfer, monkeypatch):
    """A build under FakeTensorMode (as a trace may make one) has fake host tensors, which a plan
    cannot read (DataDependentOutputException), and would leave a fake workspace in the builder's
    wrappers for every later step: it builds without planning, and the next real build plans."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(fib, "plans_in_build", lambda spec: True)
    builder = FlashInferBackend.get_builder_cls()(spec_of())
    with FakeTensorMode():
        traced = mixed_md(spec_of(), builder)
    assert not traced.step_plan.is_planned(traced) and traced.step_plan.wrapper("prefill").plans == []
    md = mixed_md(spec_of(), builder)
    assert md.step_plan.is_planned(md) and md.step_plan.wrapper("prefill").plans[0][0][0].tolist() == [0, 20, 25]


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'flashinfer'"),
                                   OSError("libcudart.so.13: cannot open shared object file")])
def test_plans_in_build_only_on_cuda_where_flashinfer_loads(monkeypatch, error):
    """A CPU spec's builder never plans in build() (page layout, CPU tests); a CUDA one does where
    FlashInfer loads, and where it does not (not installed, a CUDA library missing) builds
    without planning: the step's first use raises, naming what is missing."""
    cuda = dataclasses.replace(spec_of(), device=torch.device("cuda"))
    monkeypatch.setattr(fib, "_flashinfer", lambda: types.SimpleNamespace())
    assert fib.plans_in_build(cuda) and not fib.plans_in_build(spec_of())

    def missing() -> None:
        raise error

    monkeypatch.setattr(fib, "_flashinfer", missing)
    assert not fib.plans_in_build(cuda)
    md = mixed_md(spec_of())
    assert md.qo_indptr.tolist() == [0, 20, 25, 26, 27]
    with pytest.raises(type(error), match=str(error).split(":")[0][:20]):
        md.step_plan.ensure_planned(md)


def test_a_copy_of_the_metadata_plans_from_its_own_fields(fake_flashinfer):
    builder = FlashInferBackend.get_builder_cls()(spec_of())
    copy = dataclasses.replace(builder.build([17, 3], [1, 1], [[5, 6], [7]]))  # the built one is gone
    gc.collect()
    copy.step_plan.ensure_planned(copy)
    assert copy.step_plan.wrapper("decode").plans[-1][0][0].tolist() == [0, 2, 3]


def test_a_planned_step_is_freed_without_the_collector(fake_flashinfer):
    # no cycle through its plan: cyclic garbage would wait for the collector (StepPlan's comment)
    builder = FlashInferBackend.get_builder_cls()(spec_of())
    md = mixed_md(spec_of(), builder)
    md.step_plan.ensure_planned(md)
    freed = weakref.ref(md)
    gc.disable()
    try:
        del md
        assert freed() is None
    finally:
        gc.enable()


def test_a_step_planned_again_after_a_failed_plan_took_its_slot(fake_flashinfer):
    builder = FlashInferBackend.get_builder_cls()(spec_of())
    first, second = builder.build([17, 3], [1, 1], [[5, 6], [7]]), builder.build([5], [1], [[9]])
    third = builder.build([40, 20, 9], [1, 1, 1], [[1, 2, 3], [4, 8], [10]])  # first's slot
    for md in (first, second):
        md.step_plan.ensure_planned(md)
    wrapper = first.step_plan.wrapper("decode")

    def failing_plan(*args, **kwargs):  # as FlashInfer's: the new page buffers are in before it raises
        wrapper.plans.append((args, kwargs))
        raise RuntimeError("workspace overflow")

    wrapper.plan = failing_plan
    with pytest.raises(RuntimeError, match="workspace overflow"):
        third.step_plan.ensure_planned(third)
    del wrapper.plan
    first.step_plan.ensure_planned(first)
    assert wrapper.plans[-1][0][0].tolist() == [0, 2, 3]  # first's own plan again, not third's


def test_decode_uses_tensor_cores_from_group_four(fake_flashinfer):
    for heads, kv_heads, want in ((8, 2, True), (8, 1, True), (6, 2, False), (4, 4, False)):
        md = FlashInferBackend.get_builder_cls()(spec_of(num_heads=heads, num_kv_heads=kv_heads)).build(
            [5], [1], [[0]])
        md.step_plan.ensure_planned(md)
        assert md.step_plan.wrapper("decode").init_kwargs["use_tensor_cores"] is want


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("num_kv_heads", [2, 8])  # tensor cores, CUDA cores
def test_decode_wrappers_run_fa2_never_auto(fake_flashinfer, kv_cache_dtype, num_kv_heads):
    # "auto" imports cudnn-frontend at every eager plan (DECODE_BACKEND): neither wrapper may ask for it
    spec = spec_of(num_kv_heads=num_kv_heads, kv_cache_dtype=kv_cache_dtype)
    md = mixed_md(spec)
    md.step_plan.ensure_planned(md)
    state = FlashInferBackend.get_state_cls()(spec)
    with state.graph_capture(2):
        state.graph_capture_get_metadata_for_batch(2)
    for wrapper in (md.step_plan.wrapper("decode"), state._slots[2].wrapper):
        assert wrapper.init_kwargs["backend"] == "fa2"


def test_fp8_cache_plans_fp8_kv_dtype(fake_flashinfer):
    md = mixed_md(spec_of(kv_cache_dtype="fp8_e5m2"))
    md.step_plan.ensure_planned(md)
    assert md.step_plan.wrapper("decode").plans[0][1]["kv_data_type"] == torch.float8_e5m2


def test_encoder_only_plans_non_causal_ragged(fake_flashinfer):
    md = FlashInferBackend.get_builder_cls()(spec_of(attn_type=KINDS.ENCODER_ONLY)).build([5, 3], [5, 3], [])
    md.step_plan.ensure_planned(md)
    (qo, kv, *_), kw = md.step_plan.wrapper("ragged").plans[0]
    assert qo.tolist() == kv.tolist() == [0, 5, 8] and kw["causal"] is False


def test_split_kv_is_off_from_the_measured_number_of_request_kv_head_pairs(fake_flashinfer):
    """Graph wrappers plan by their batch size (capture and every replay: one grid), eager decodes
    by their own count; only the tensor-core kernel (group >= 4) drops split-kv. Without split-kv
    the capture's plan stands: a replay only refills the page CSR it reads."""
    spec = spec_of(num_heads=8, num_kv_heads=2, max_seq_len_to_capture=64)  # group 4: tensor cores
    big = fib.NO_SPLIT_KV_MIN_PAIRS // spec.num_kv_heads
    _, graphs = capture_state(spec, [big, big - 1])
    md = FlashInferBackend.get_builder_cls()(spec).build([17, 3], [1, 1], [[5, 6], [7]])
    for bs, want in ((big, [True]), (big - 1, [False, False])):
        _, bufs, graph_state = graphs[bs]
        graph_state.prepare_graph_input_buffers(bufs, md)  # two live rows in either graph
        graph_state.begin_forward(md)
        plans = graph_state._slots[bs].wrapper.plans
        assert [kw.get("disable_split_kv", False) for _, kw in plans] == want
        if bs == big:  # the refill (the recording stand-in's plan() writes no buffers)
            assert bufs["paged_kv_indptr"][:4].tolist() == [0, 2, 3, 4]  # then one page per pad row
            assert bufs["paged_kv_last_page_len"][:3].tolist() == [1, 3, 1]
            assert bufs["paged_kv_indices"][:4].tolist() == [5, 6, 7, fib.SCRATCH_BLOCK]
    for heads, n, want in ((8, big, True), (8, big - 1, False), (2, big, False)):  # (2, 2): CUDA cores
        step = FlashInferBackend.get_builder_cls()(spec_of(num_heads=heads, num_kv_heads=2, num_blocks=n)).build(
            [5] * n, [1] * n, [[i] for i in range(n)])
        step.step_plan.ensure_planned(step)
        assert step.step_plan.wrapper("decode").plans[0][1].get("disable_split_kv", False) is want


def test_graphs_whose_wrapper_resolved_to_fa3_plan_every_replay(fake_flashinfer):
    """FA3's schedule follows the lengths even without split-kv: no capture plan is kept for it."""
    spec = spec_of(num_heads=8, num_kv_heads=2, max_seq_len_to_capture=64)
    big = fib.NO_SPLIT_KV_MIN_PAIRS // spec.num_kv_heads
    _, graphs = capture_state(spec, [big])
    _, bufs, graph_state = graphs[big]
    graph_state._slots[big].wrapper._backend = "fa3"  # what FlashInfer's plan() records it resolved to
    md = FlashInferBackend.get_builder_cls()(spec).build([17, 3], [1, 1], [[5, 6], [7]])
    for _ in range(2):
        graph_state.prepare_graph_input_buffers(bufs, md)
        graph_state.begin_forward(md)
    assert len(graph_state._slots[big].wrapper.plans) == 3  # capture, then each replay


def capture_state(spec, sizes):
    state = FlashInferBackend.get_state_cls()(spec)
    out = {}
    with state.graph_capture(max(sizes)):
        for bs in sizes:
            md_bs = state.graph_capture_get_metadata_for_batch(bs)
            out[bs] = (md_bs, state.get_graph_input_buffers(md_bs), state.graph_clone(bs))
    return state, out


def test_graph_metadata_is_all_pads_that_write_nothing(fake_flashinfer):
    _, graphs = capture_state(spec_of(max_seq_len_to_capture=64), [4, 2])
    md_bs, bufs, graph_state = graphs[4]
    assert md_bs.num_decode_tokens == 4 and md_bs.num_prefills == 0
    assert bufs["slot_mapping"].tolist() == [-1] * 4
    (indptr, indices, last, *_), _ = graph_state._slots[4].wrapper.plans[0]
    assert indptr.tolist() == [0, 1, 2, 3, 4] and last.tolist() == [1] * 4
    assert indices.tolist() == [fib.SCRATCH_BLOCK] * 4


def test_prepare_pads_rows_beyond_the_live_batch(fake_flashinfer):
    spec = spec_of(max_seq_len_to_capture=64)
    _, graphs = capture_state(spec, [4])
    _, bufs, graph_state = graphs[4]
    md = FlashInferBackend.get_builder_cls()(spec).build([17, 3], [1, 1], [[5, 6], [7]])
    graph_state.prepare_graph_input_buffers(bufs, md)
    graph_state.begin_forward(md)
    assert bufs["slot_mapping"].tolist() == md.slot_mapping.tolist() + [-1, -1]
    (indptr, indices, last, *_), _ = graph_state._slots[4].wrapper.plans[-1]
    assert indptr.tolist() == [0, 2, 3, 4, 5] and last.tolist() == [1, 3, 1, 1]
    assert indices.tolist() == [5, 6, 7, fib.SCRATCH_BLOCK, fib.SCRATCH_BLOCK]


def test_graph_step_of_metadata_made_by_replace_refills_the_same_pages(fake_flashinfer):
    """Metadata from `dataclasses.replace` keeps the host tables (checked again before the refill)
    but not the builder's flat page ids: the State reads them from the host table instead, and
    the buffers get what the builder's own metadata gives them."""
    spec = spec_of(max_seq_len_to_capture=64)
    _, graphs = capture_state(spec, [4])
    _, bufs, graph_state = graphs[4]
    md = FlashInferBackend.get_builder_cls()(spec).build([17, 3, 33], [1, 1, 1], [[5, 6], [7], [9, 2, 4]])
    filled = []
    for step in (md, dataclasses.replace(md)):
        graph_state.prepare_graph_input_buffers(bufs, step)
        graph_state.begin_forward(step)
        filled.append({name: buf.clone() for name, buf in bufs.items()})
    assert filled[1]["paged_kv_indices"][:7].tolist() == [5, 6, 7, 9, 2, 4, fib.SCRATCH_BLOCK]
    for name, want in filled[0].items():
        assert torch.equal(filled[1][name], want), name


@pytest.mark.parametrize("over, reason", [
    ({}, None),
    (dict(head_size=64), "head size"),
    (dict(dtype=torch.float16), None),
    (dict(kv_cache_dtype="fp8_e4m3"), "cache"),
    (dict(sliding_window=64), "window"),
    (dict(logits_soft_cap=30.0), "soft-cap"),
    (dict(alibi_slopes=alibi_slopes(8)), "ALiBi"),
])
def test_cudnn_serves_graphed_decode_only_where_it_was_measured(over, reason, monkeypatch):
    spec = spec_of(**{"head_size": 128, **over})
    monkeypatch.setattr(fib, "cudnn_decode_available", lambda: True)
    got = fib.cudnn_decode_reason(spec, (9, 0))
    assert got is None if reason is None else reason in got
    assert "sm100" in fib.cudnn_decode_reason(spec, (10, 0))
    assert "CUDA" in fib.cudnn_decode_reason(spec, None)
    if reason is None:
        monkeypatch.setattr(fib, "cudnn_decode_available", lambda: False)
        assert "pip install nvidia-cudnn-frontend" in fib.cudnn_decode_reason(spec, (9, 0))


def test_graph_decode_kernel_choice_is_checked(monkeypatch):
    spec = spec_of(head_size=128)  # a CPU spec: neither table kernel can serve it
    assert fib.graph_decode_kernel(spec) == "flashinfer"
    assert fib.graph_decode_kernel(spec, "flashinfer") == "flashinfer"
    for kernel in ("cudnn", "triton"):
        with pytest.raises(NotImplementedError, match=f"{fib.GRAPH_DECODE_ENV}={kernel}: .*CUDA devices"):
            fib.graph_decode_kernel(spec, kernel)
    monkeypatch.setenv(fib.GRAPH_DECODE_ENV, "cudnn-fa")
    with pytest.raises(ValueError, match="auto, flashinfer, cudnn or triton"):
        FlashInferBackend.get_state_cls()(spec)


@pytest.mark.parametrize("frontend", [True, False])
def test_auto_graph_decode_is_triton_where_a_table_kernel_serves(frontend, monkeypatch):
    """On sm90 a spec of a 16-bit cache, head size 128, no ALiBi / soft-cap / window decodes on
    Triton, with or without the cudnn-frontend package (which only cuDNN needs), and on cuDNN
    where Triton is not installed. An fp8 cache decodes on Triton (cuDNN refuses it); a spec
    neither serves (a window) is refused with the reason when one is named."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fib, "cudnn_decode_available", lambda: frontend)
    spec = spec_of(head_size=128, device="cuda")
    assert fib.graph_decode_kernel(spec) == fib.graph_decode_kernel(spec, "triton") == "triton"
    assert fib.graph_decode_kernel(spec, "flashinfer") == "flashinfer"
    if frontend:
        assert fib.graph_decode_kernel(spec, "cudnn") == "cudnn"
    else:
        with pytest.raises(NotImplementedError, match="cudnn: .*cudnn-frontend"):
            fib.graph_decode_kernel(spec, "cudnn")
    fp8 = dataclasses.replace(spec, kv_cache_dtype="fp8")
    assert fib.graph_decode_kernel(fp8) == fib.graph_decode_kernel(fp8, "triton") == "triton"
    with pytest.raises(NotImplementedError, match="cudnn: .*cache"):
        fib.graph_decode_kernel(fp8, "cudnn")
    windowed = dataclasses.replace(spec, sliding_window=64)
    with pytest.raises(NotImplementedError, match="triton: .*window"):
        fib.graph_decode_kernel(windowed, "triton")
    monkeypatch.setattr(fib, "triton_available", lambda: False)  # then cuDNN where it serves
    assert fib.graph_decode_kernel(spec) == ("cudnn" if frontend else "flashinfer")
    with pytest.raises(NotImplementedError, match="triton: .*pip install triton"):
        fib.graph_decode_kernel(spec, "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fib.graph_decode_kernel(spec) == "flashinfer"  # measured on sm90 only


def table_decode_steps(spec, graph_state, bufs, md_bs, name, scales=(1.0, 1.0)):
    """Two decode steps through a graph State's buffers (prepare, begin_forward, the op on the
    graph metadata): each step's live rows equal the float64 reference over the cache (stored
    as K / k_scale and V / v_scale). Yields each step's lengths once it is checked."""
    builder = FlashInferBackend.get_builder_cls()(spec)
    for seq_lens, tables in (([17, 3], [[5, 6], [7]]), ([33, 9, 16], [[9, 2, 4], [1], [3]])):
        args = op_args(spec, 4, "cpu", name)
        md = builder.build(seq_lens, [1] * len(seq_lens), tables)
        graph_state.prepare_graph_input_buffers(bufs, md)
        graph_state.begin_forward(md)
        with ca.set_forward_context(md_bs):
            torch.ops.compiled_attn.flashinfer_attention(**args)
        k_cache, v_cache = args["kv_cache"]
        for i, (n, table) in enumerate(zip(seq_lens, tables, strict=True)):
            keys, values = (c[table].flatten(0, 1)[:n].double() * sc for c, sc in ((k_cache, scales[0]),
                                                                                   (v_cache, scales[1])))
            ref = reference_attention(args["query"][i : i + 1], keys, values, torch.tensor([n - 1]), causal=True,
                                      scale=spec.softmax_scale)
            assert rel_err(args["output"][i : i + 1], ref) <= BF16_TOL
        yield seq_lens


class DenseCudnnDecode:
    """cuDNN's prepared paged decode (`prepare_cudnn_batch_decode`), computed by
    `reference_attention` from the lengths and block table bound to it and the [pages, kv_heads,
    block_size, head_size] cache views it is given."""

    builds = 0
    graph = types.SimpleNamespace(get_workspace_size=lambda: 512)

    def __init__(self, q, k, v, scale, *, max_sequence_kv, actual_seq_lens_kv, block_tables, actual_seq_lens_q,
                 out, **layout):
        DenseCudnnDecode.builds += 1
        self.scale, self.bound = scale, (actual_seq_lens_kv, block_tables)
        assert layout == dict(return_lse=False, q_len_per_req=1, window_left=-1, lse=None, sinks=None)
        assert max_sequence_kv == block_tables.shape[1] * k.shape[2]  # the table's reach, in tokens
        assert actual_seq_lens_kv.shape == actual_seq_lens_q.shape == (q.shape[0], 1, 1, 1)
        assert actual_seq_lens_q.dtype == torch.int32 and actual_seq_lens_q.eq(1).all()

    def run(self, q, k, v, out, lse, workspace, *, actual_seq_lens_kv, block_tables) -> None:
        assert (actual_seq_lens_kv, block_tables) == self.bound
        block = k.shape[2]
        for i, n in enumerate(actual_seq_lens_kv.view(-1).tolist()):
            pages = block_tables[i, : -(-n // block)].long()
            keys, values = (c[pages].transpose(1, 2).flatten(0, 1)[:n] for c in (k, v))
            out[i] = reference_attention(q[i : i + 1], keys, values, torch.tensor([n - 1]), causal=True,
                                         scale=self.scale)[0].to(out.dtype)


def test_cudnn_graph_decode_reads_the_states_lengths_and_tables(fake_flashinfer, monkeypatch):
    """Where cuDNN serves graphed decode, a step needs no plan and no page CSR: the prepared graph
    reads the seq_lens and block-table buffers the step's upload wrote (pads: one token of SCRATCH_BLOCK). The op's
    output for the live rows matches the float64 reference over the cache; the graph is built once."""
    monkeypatch.setattr(fib, "graph_decode_kernel", lambda spec: "cudnn")
    monkeypatch.setattr(fib, "_prepare_cudnn_decode", lambda: DenseCudnnDecode)
    monkeypatch.setattr(DenseCudnnDecode, "builds", 0)
    spec = spec_of(max_seq_len_to_capture=64)
    _, graphs = capture_state(spec, [4])
    md_bs, bufs, graph_state = graphs[4]
    assert graph_state.decode_kernel == "cudnn" and isinstance(graph_state._slots[4].wrapper, fib.CudnnGraphDecode)
    assert not any(name.startswith("paged_kv") for name in bufs)  # no page CSR to allocate or refill
    name, _keep = layer_of(spec)
    for seq_lens in table_decode_steps(spec, graph_state, bufs, md_bs, name):
        n = len(seq_lens)
        assert bufs["seq_lens_tensor"].tolist() == seq_lens + [1] * (4 - n)
        assert bufs["block_tables"][n:, 0].tolist() == [fib.SCRATCH_BLOCK] * (4 - n)
    assert DenseCudnnDecode.builds == 1  # one layout: built at the first call, kept
    # a query of another layout (a slice of a fused QKV projection) gets a graph of its own; the
    # first stays, as a captured graph may still read it
    args = op_args(spec, 4, "cpu", name)
    fused = torch.randn(4, spec.num_heads + 2 * spec.num_kv_heads, spec.head_size).to(spec.dtype)
    args["query"] = fused[:, : spec.num_heads]
    with ca.set_forward_context(md_bs):
        torch.ops.compiled_attn.flashinfer_attention(**args)
    assert DenseCudnnDecode.builds == 2 and len(graph_state._slots[4].wrapper._prepared) == 2


class DensePagedDecode:
    """`ops.triton_decode.PagedDecode` computed by `reference_attention` from the lengths and
    tables it is given: what is under test is the State's wiring, not the kernel."""

    made: list[tuple] = []
    scales: list[tuple[float, float]] = []

    def __init__(self, batch_size, num_heads, head_size, config, device) -> None:
        DensePagedDecode.made.append((batch_size, num_heads, head_size, config))

    def run(self, q, k_cache, v_cache, block_tables, seq_lens, out, scale, k_scale, v_scale) -> None:
        DensePagedDecode.scales.append((k_scale, v_scale))
        page = k_cache.shape[1]
        for i, n in enumerate(seq_lens.tolist()):
            pages = block_tables[i, : -(-n // page)].long()
            keys, values = (c[pages].flatten(0, 1)[:n].double() * sc
                            for c, sc in ((k_cache, k_scale), (v_cache, v_scale)))
            out[i] = reference_attention(q[i : i + 1], keys, values, torch.tensor([n - 1]), causal=True,
                                         scale=scale)[0].to(out.dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_graph_decode_reads_the_states_lengths_and_tables(kv_cache_dtype, fake_flashinfer, monkeypatch):
    """Where Triton serves graphed decode, each size's wrapper binds the State's seq_lens and
    block-table buffers (no page CSR, no plan) and its own launch shape; each step's output for
    the live rows matches the float64 reference over the cache, so the buffers it reads are the
    ones each step's upload wrote. An fp8 cache's layer scales reach the kernel; a 16-bit one's
    are 1."""
    fake = types.SimpleNamespace(PagedDecode=DensePagedDecode,
                                 default_config=lambda batch, kv_heads, device, fp8_cache: ("config", batch, kv_heads,
                                                                                            fp8_cache))
    monkeypatch.setitem(sys.modules, "compiled_attn.ops.triton_decode", fake)
    monkeypatch.setattr(compiled_attn.ops, "triton_decode", fake, raising=False)
    monkeypatch.setattr(fib, "graph_decode_kernel", lambda spec: "triton")
    monkeypatch.setattr(DensePagedDecode, "made", [])
    monkeypatch.setattr(DensePagedDecode, "scales", [])
    spec = spec_of(max_seq_len_to_capture=64, kv_cache_dtype=kv_cache_dtype)
    scales = (0.5, 3.0) if kv_cache_dtype != "auto" else (1.0, 1.0)
    _, graphs = capture_state(spec, [4, 2])
    md_bs, bufs, graph_state = graphs[4]
    assert graph_state.decode_kernel == "triton" and isinstance(graph_state._slots[4].wrapper, fib.TritonGraphDecode)
    assert not any(name.startswith("paged_kv") for name in bufs)
    assert DensePagedDecode.made == [(n, spec.num_heads, spec.head_size,
                                      ("config", n, spec.num_kv_heads, kv_cache_dtype != "auto")) for n in (4, 2)]
    name, _keep = layer_of(spec, *scales)
    assert len(list(table_decode_steps(spec, graph_state, bufs, md_bs, name, scales))) == 2
    assert DensePagedDecode.scales == [scales, scales]


def test_graph_clone_keeps_the_states_decode_kernel(fake_flashinfer, monkeypatch):
    """A clone serves with what its State resolved when it was made, whatever the environment
    (or the rule) says by the time it is cloned."""
    monkeypatch.setattr(fib, "graph_decode_kernel", lambda spec: "cudnn")
    spec = spec_of(max_seq_len_to_capture=64)
    state = FlashInferBackend.get_state_cls()(spec)
    with state.graph_capture(4):
        state.graph_capture_get_metadata_for_batch(4)
        monkeypatch.setattr(fib, "graph_decode_kernel", lambda spec: "flashinfer")
        clone = state.graph_clone(4)
    assert clone.decode_kernel == "cudnn" and clone._slots[4] is state._slots[4]


def test_cudnn_graph_decode_is_never_built_inside_a_capture(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(fib, "_prepare_cudnn_decode", lambda: DenseCudnnDecode)
    monkeypatch.setattr(fib, "stream_capturing", lambda: True)
    spec = spec_of(max_seq_len_to_capture=64)
    lens, tables = torch.ones(2, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    decode = fib.CudnnGraphDecode(spec, torch.zeros(1024, dtype=torch.uint8), lens, tables)
    args = op_args(spec, 2, "cpu")
    with pytest.raises(RuntimeError, match="before capturing"):
        decode.run(args["query"], tuple(args["kv_cache"]), out=args["output"])


def test_cudnn_workspace_need_beyond_the_buffer_names_the_switch(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(fib, "_prepare_cudnn_decode", lambda: DenseCudnnDecode)
    spec = spec_of(max_seq_len_to_capture=64)
    lens, tables = torch.ones(2, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    decode = fib.CudnnGraphDecode(spec, torch.zeros(256, dtype=torch.uint8), lens, tables)
    args = op_args(spec, 2, "cpu")
    with pytest.raises(RuntimeError, match=f"512-byte workspace.*{fib.GRAPH_DECODE_ENV}=flashinfer"):
        decode.run(args["query"], tuple(args["kv_cache"]), out=args["output"])


def test_begin_forward_before_prepare_raises(fake_flashinfer):
    spec = spec_of(max_seq_len_to_capture=64)
    _, graphs = capture_state(spec, [2])
    md = FlashInferBackend.get_builder_cls()(spec).build([17], [1], [[5, 6]])
    with pytest.raises(RuntimeError, match="prepare_graph_input_buffers"):
        graphs[2][2].begin_forward(md)


def test_prepare_rejects_prefills_and_overlong_steps(fake_flashinfer):
    spec = spec_of(max_seq_len_to_capture=32)
    _, graphs = capture_state(spec, [2])
    _, bufs, graph_state = graphs[2]
    builder = FlashInferBackend.get_builder_cls()(spec)
    with pytest.raises(ValueError, match="decode-only"):
        graph_state.prepare_graph_input_buffers(bufs, builder.build([4], [4], [[1]]))
    with pytest.raises(ValueError, match="max_seq_len_to_capture"):
        graph_state.prepare_graph_input_buffers(bufs, builder.build([40], [1], [[1, 2, 3]]))


def test_metadata_for_batch_outside_graph_capture_raises():
    state = FlashInferBackend.get_state_cls()(spec_of())
    with pytest.raises(RuntimeError, match="graph_capture"):
        state.graph_capture_get_metadata_for_batch(1)


# ---------------------------------------------------------------------------------------------
# CPU: availability, capabilities, fake kernel


def test_unavailable_reason_on_cpu_names_the_cause():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    reason = FlashInferBackend.unavailable_reason()
    assert reason is not None and ("flashinfer" in reason or "CUDA" in reason)
    with pytest.raises(ca.BackendUnavailableError):
        ca.get_attn_backend("FLASHINFER")


def test_nonstandard_alibi_slopes_are_not_implemented_naming_torch_sdpa():
    slopes = torch.linspace(0.1, 0.9, 8)
    with pytest.raises(NotImplementedError, match="TORCH_SDPA"):
        FlashInferBackend.get_impl_cls()(8, 64, 0.125, num_kv_heads=2, alibi_slopes=slopes)
    with pytest.raises(NotImplementedError, match="TORCH_SDPA"):
        FlashInferBackend.get_builder_cls()(spec_of(alibi_slopes=slopes))
    assert "TORCH_SDPA" in FlashInferBackend.unsupported_reason(spec_of("cuda", alibi_slopes=slopes))


def test_alibi_with_soft_cap_is_not_implemented_naming_torch_sdpa():
    """The pair is a capability FlashInfer lacks (`supports_alibi_with_soft_cap`), so every error
    that names alternatives names TORCH_SDPA alone: XFORMERS' errors for soft-cap named FLASHINFER."""
    with pytest.raises(NotImplementedError, match=r"^FLASHINFER cannot combine ALiBi with logits_soft_cap; use "
                                                  r"TORCH_SDPA$"):
        FlashInferBackend.get_impl_cls()(8, 64, 0.125, num_kv_heads=2, alibi_slopes=alibi_slopes(8),
                                         logits_soft_cap=30.0)
    assert FlashInferBackend.unsupported_reason(spec_of("cuda", alibi_slopes=alibi_slopes(8), logits_soft_cap=30.0)
                                                ) == "FLASHINFER cannot combine ALiBi with logits_soft_cap"
    with pytest.raises(NotImplementedError, match=r"^XFORMERS does not support logits_soft_cap; use TORCH_SDPA$"):
        XFormersBackend.get_impl_cls()(8, 64, 0.125, num_kv_heads=2, alibi_slopes=alibi_slopes(8),
                                       logits_soft_cap=30.0)


def test_standard_alibi_slopes_include_non_power_of_two_heads():
    assert torch.allclose(fib.standard_alibi_slopes(8), alibi_slopes(8).float())
    want12 = [2 ** (-i) for i in range(1, 9)] + [2 ** (-0.5 * i) for i in (1, 3, 5, 7)]
    assert torch.allclose(fib.standard_alibi_slopes(12), torch.tensor(want12))


@pytest.mark.parametrize("attn_type", [KINDS.ENCODER, KINDS.ENCODER_DECODER])
def test_encoder_and_cross_attention_are_not_implemented(attn_type):
    impl = FlashInferBackend.get_impl_cls()(8, 64, 0.125, num_kv_heads=2)
    with pytest.raises(NotImplementedError, match="TORCH_SDPA"):
        impl.check_attn_type(attn_type)


def test_unsupported_head_size_and_dtype():
    with pytest.raises(NotImplementedError, match="head sizes"):
        FlashInferBackend.get_impl_cls()(8, 96, 0.1, num_kv_heads=2)
    assert "dtypes" in FlashInferBackend.unsupported_reason(spec_of(dtype=torch.float32))


def layer_of(spec, k_scale=1.0, v_scale=1.0, **over):
    """An impl of `spec`'s values (or `over`) registered as a layer: (name, record to keep alive)."""
    opts = dict(scale=spec.softmax_scale, sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
                alibi_slopes=spec.alibi_slopes, attn_type=spec.attn_type)
    opts.update(over)
    attn_type = opts.pop("attn_type")
    impl = FlashInferBackend.get_impl_cls()(spec.num_heads, spec.head_size, num_kv_heads=spec.num_kv_heads,
                                            kv_cache_dtype=spec.kv_cache_dtype, **opts)
    return impl.register(k_scale, v_scale, attn_type)


def op_args(spec, num_tokens, device, layer_name="unused"):
    q = torch.randn(num_tokens, spec.num_heads, spec.head_size, device=device).to(spec.dtype)
    kv = torch.randn(num_tokens, spec.num_kv_heads, spec.head_size, device=device).to(spec.dtype)
    cache = torch.randn(FlashInferBackend.get_kv_cache_shape(
        spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size), device=device).to(spec.cache_dtype)
    return dict(query=q, key=kv, value=kv.clone(), kv_cache=cache, output=torch.empty_like(q), layer_name=layer_name)


@pytest.mark.parametrize("over", [dict(scale=0.5), dict(sliding_window=7), dict(logits_soft_cap=3.0),
                                  dict(alibi_slopes=alibi_slopes(8)), dict(attn_type=KINDS.ENCODER_ONLY)])
def test_layer_values_differing_from_the_spec_raise_at_forward(over):
    spec = spec_of()
    md = mixed_md(spec)
    name, _keep = layer_of(spec, **over)
    with ca.set_forward_context(md), pytest.raises(ValueError, match="spec|planned"):
        torch.ops.compiled_attn.flashinfer_attention(**op_args(spec, md.num_tokens, "cpu", name))


def test_an_encoder_only_query_dtype_unlike_the_spec_raises_before_planning(fake_flashinfer):
    """ENCODER_ONLY reads no cache, so the plan's own check is the one that sees a query (and
    key / value) of another dtype than the spec planned for."""
    spec = spec_of(attn_type=KINDS.ENCODER_ONLY)
    md = FlashInferBackend.get_builder_cls()(spec).build([5, 3], [5, 3], [])
    name, _keep = layer_of(spec)
    args = op_args(dataclasses.replace(spec, dtype=torch.float16), md.num_tokens, "cpu", name) | {"kv_cache": None}
    with ca.set_forward_context(md), pytest.raises(ValueError,
                                                   match=r"query dtype torch.float16 != spec dtype torch.bfloat16"):
        torch.ops.compiled_attn.flashinfer_attention(**args)
    assert md.step_plan.wrapper("ragged").plans == []


def test_fake_kernel_on_cuda_fake_tensors():
    """On fake CUDA tensors the op runs its fake kernel without error (the real one would need
    CUDA here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = spec_of()
    with FakeTensorMode():
        args = op_args(spec, 7, "cuda")
        torch.ops.compiled_attn.flashinfer_attention(**args)  # raises if the real kernel were dispatched


# ---------------------------------------------------------------------------------------------
# CPU: the whole op against the float64 reference, FlashInfer replaced by dense float64 attention


class DenseWrapper:
    """FlashInfer's plan/run contract, computed by `reference_attention` from what plan() was
    given, read with FlashInfer's meanings: pages (indptr / indices / last_page_len) or ragged
    K/V, causality, `window_left` (= window - 1), soft-cap, ALiBi (standard slopes) and the fp8
    scales run() gets."""

    def __init__(self, kind: str, *args, **kwargs) -> None:
        self.kind, self.num_plans = kind, 0
        # a use_cuda_graph decode wrapper's kernels read the page CSR from these buffers at run time
        self.graph_buffers = (kwargs.get("paged_kv_indptr_buffer"), kwargs.get("paged_kv_indices_buffer"),
                              kwargs.get("paged_kv_last_page_len_buffer")) if kwargs.get("use_cuda_graph") else None

    def plan(self, *args, **kw) -> None:
        self.num_plans += 1
        if self.kind == "decode":
            kv_indptr, indices, last, hq, _, _, page = args[:7]
            qo = torch.arange(len(kv_indptr))
        elif self.kind == "prefill":
            qo, kv_indptr, indices, last, hq, _, _, page = args[:8]
        else:
            qo, kv_indptr, hq = args[:3]
            indices = last = page = None
        self.qo, self.kv_indptr = torch.as_tensor(qo).tolist(), torch.as_tensor(kv_indptr).tolist()
        self.indices, self.last, self.page = indices, last, page
        if self.graph_buffers is not None:  # FlashInfer's plan() copies the page CSR into them
            for buf, src in zip(self.graph_buffers, (kv_indptr, indices, last), strict=True):
                buf[: len(src)].copy_(torch.as_tensor(src))
        self.options = dict(
            causal=kw.get("causal", True), scale=kw["sm_scale"], logits_soft_cap=kw["logits_soft_cap"] or None,
            sliding_window=kw["window_left"] + 1 if kw["window_left"] >= 0 else None,
            alibi=fib.standard_alibi_slopes(hq) if kw["pos_encoding_mode"] == "ALIBI" else None,
        )

    def run(self, q, kv, value=None, *, out, k_scale=None, v_scale=None) -> None:
        # FlashInfer's prefill run() refuses a query of other rows than its plan's (decode: one per request)
        assert q.shape[0] == out.shape[0] == self.qo[-1]
        if self.graph_buffers is not None:  # what the buffers hold now, as FlashInfer's graph kernels
            indptr, self.indices, self.last = self.graph_buffers
            self.kv_indptr = indptr.tolist()
        for i in range(len(self.qo) - 1):
            k, v = self._keys(i, kv, value)
            rows = slice(self.qo[i], self.qo[i + 1])
            lq, lk = rows.stop - rows.start, k.shape[0]
            o = reference_attention(q[rows], k.double() * (k_scale or 1.0), v.double() * (v_scale or 1.0),
                                    torch.arange(lk - lq, lk), **self.options)
            out[rows] = o.to(out.dtype)

    def _keys(self, i: int, kv, value) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.kv_indptr[i], self.kv_indptr[i + 1]
        if self.indices is None:  # ragged: this step's own K/V
            return kv[lo:hi], value[lo:hi]
        pages = torch.as_tensor(self.indices)[lo:hi].long()
        length = (hi - lo - 1) * self.page + int(torch.as_tensor(self.last)[i])
        k_cache, v_cache = kv
        return k_cache[pages].flatten(0, 1)[:length], v_cache[pages].flatten(0, 1)[:length]


DENSE_FLASHINFER = types.SimpleNamespace(
    BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: DenseWrapper("prefill", *a, **k),
    BatchPrefillWithRaggedKVCacheWrapper=lambda *a, **k: DenseWrapper("ragged", *a, **k),
    BatchDecodeWithPagedKVCacheWrapper=lambda *a, **k: DenseWrapper("decode", *a, **k),
)


@pytest.mark.parametrize("mixed", ["auto", "split", "prefill"])
@given(case=cases(FlashInferBackend, "cuda", CI_LIMITS))
@differential_settings(CI_LIMITS)
def test_host_path_matches_reference_with_dense_flashinfer(mixed, case):
    """Everything of the backend but FlashInfer's kernels, on CPU, for drawn cases: page layout,
    per-step planning (prefill, rebased decode, ragged; mixed steps every way: MIXED_STEP_ENV),
    options, fp8 scales, output rows."""
    with unittest.mock.patch.object(fib, "_flashinfer", lambda: DENSE_FLASHINFER), \
            unittest.mock.patch.object(fib, "WORKSPACE_BYTES", 1024), \
            unittest.mock.patch.dict(os.environ, {fib.MIXED_STEP_ENV: mixed}):
        check_against_reference(case, FlashInferBackend, "cpu")


# ---------------------------------------------------------------------------------------------
# GPU: features against the float64 reference (FEATURE_CASES)


def case_spec(case, num_blocks=4096, **kw):
    _, dtype, d, kv, hq, hkv, window, cap, alibi = case
    return ca.AttentionSpec(num_heads=hq, num_kv_heads=hkv, head_size=d, block_size=16, num_blocks=num_blocks,
                            dtype=dtype, device="cuda", kv_cache_dtype=kv, sliding_window=window,
                            logits_soft_cap=cap, alibi_slopes=alibi_slopes(hq) if alibi else None, **kw)


def random_lengths(seed, num_prefills, num_decodes, max_len=4096, max_chunk=512):
    """Prefills: a fresh prompt, then chunks over cached context, a 1-token prompt; decodes."""
    rng = random.Random(seed)
    seq_lens, query_lens = [], []
    for i in range(num_prefills):
        if i == num_prefills - 1 and num_prefills > 2:
            s = q = 1
        elif i == 0:
            s = q = rng.randint(1, max_chunk)
        else:
            s = rng.randint(2, max_len)
            q = rng.randint(1, min(s, max_chunk))
        seq_lens.append(s)
        query_lens.append(q)
    for _ in range(num_decodes):
        seq_lens.append(rng.randint(2, max_len))
        query_lens.append(1)
    return seq_lens, query_lens


def run_and_compare(spec, seq_lens, query_lens, *, seed=0, k_scale=1.0, v_scale=1.0, top_blocks=False):
    batch = make_batch(spec, seq_lens, query_lens, seed=seed, k_scale=k_scale, v_scale=v_scale,
                       top_blocks=top_blocks)
    impl = FlashInferBackend.get_impl_cls()(
        spec.num_heads, spec.head_size, spec.softmax_scale, num_kv_heads=spec.num_kv_heads,
        alibi_slopes=spec.alibi_slopes, sliding_window=spec.sliding_window, kv_cache_dtype=spec.kv_cache_dtype,
        logits_soft_cap=spec.logits_soft_cap)
    md = batch.build(FlashInferBackend)
    kv_cache = batch.kv_cache if spec.attn_type == KINDS.DECODER else None
    out = impl.forward(batch.query, batch.key, batch.value, kv_cache, md, k_scale=k_scale, v_scale=v_scale,
                       attn_type=spec.attn_type)
    ref = reference_forward(batch, spec.attn_type, sliding_window=spec.sliding_window,
                            logits_soft_cap=spec.logits_soft_cap, alibi=spec.alibi_slopes,
                            k_scale=k_scale, v_scale=v_scale)
    return rel_err(out.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("mixed", ["split", "prefill"])
@pytest.mark.parametrize("case", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_mixed_batch_matches_reference(case, mixed, monkeypatch):
    """Both ways of running a mixed step (MIXED_STEP_ENV) on FlashInfer's kernels."""
    monkeypatch.setenv(fib.MIXED_STEP_ENV, mixed)
    spec = case_spec(case)
    fp8 = spec.cache_dtype.itemsize == 1
    seq_lens, query_lens = random_lengths(FEATURE_CASES.index(case), 3, 5)
    err = run_and_compare(spec, seq_lens, query_lens, k_scale=0.5 if fp8 else 1.0, v_scale=2.0 if fp8 else 1.0)
    assert err <= (FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.gpu
def test_prefill_only_batch_with_a_full_length_prompt_matches_reference():
    seq_lens, query_lens = random_lengths(1, 3, 0)
    seq_lens[0] = query_lens[0] = 4096
    assert run_and_compare(case_spec(FEATURE_CASES[0]), seq_lens, query_lens) <= BF16_TOL


@pytest.mark.gpu
def test_decode_only_batch_matches_reference():
    seq_lens, query_lens = random_lengths(2, 0, 16)
    assert run_and_compare(case_spec(FEATURE_CASES[0]), seq_lens, query_lens) <= BF16_TOL


@pytest.mark.gpu
def test_encoder_only_is_bidirectional_over_fresh_kv():
    spec = case_spec(FEATURE_CASES[0], attn_type=KINDS.ENCODER_ONLY)
    lens = [random.Random(3).randint(1, 1024) for _ in range(4)]
    assert run_and_compare(spec, lens, lens) <= BF16_TOL


@pytest.mark.gpu
def test_cache_over_2_31_elements_with_top_block_ids():
    case = FEATURE_CASES[-1]  # fp8: each cache half holds > 2^31 one-byte elements (4.3 GB in all)
    per_block = 16 * case[5] * case[2]
    spec = case_spec(case, num_blocks=2**31 // per_block + 64)
    seq_lens, query_lens = random_lengths(4, 2, 4, max_len=300)
    err = run_and_compare(spec, seq_lens, query_lens, top_blocks=True, k_scale=0.5, v_scale=2.0)
    assert err <= FP8_TOL


# ---------------------------------------------------------------------------------------------
# GPU: CUDA graphs through the State API


def skip_unless_cudnn_decode() -> None:
    """Skip where the graphs' cuDNN decode cannot run: another card than sm90, or no cudnn-frontend."""
    if torch.cuda.get_device_capability() != fib.CUDNN_DECODE_CAPABILITY:
        pytest.skip(f"cuDNN decode is chosen on sm90 only, this card is {torch.cuda.get_device_capability()}")
    if not fib.cudnn_decode_available():
        pytest.skip("cuDNN decode needs the cudnn-frontend package")


def impl_for(spec):
    return FlashInferBackend.get_impl_cls()(
        spec.num_heads, spec.head_size, spec.softmax_scale, num_kv_heads=spec.num_kv_heads,
        sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap, kv_cache_dtype=spec.kv_cache_dtype)


def fp8_scales(spec) -> tuple[float, float]:
    """The layer's k / v scales: 1 for a 16-bit cache; for fp8 two that are not each other's
    inverse, so that a kernel swapping or inverting them cannot pass."""
    return (0.5, 3.0) if spec.cache_dtype.itemsize == 1 else (1.0, 1.0)


def capture(state, spec, impl, kv_cache, sizes):
    """Capture one decode step per batch size (the layer's scales: `fp8_scales`); returns
    {bs: (graph, bufs, graph_state, q, k, v, out)}."""
    hq, hkv, d, top = spec.num_heads, spec.num_kv_heads, spec.head_size, max(sizes)
    q = torch.randn(top, hq * d, device="cuda", dtype=spec.dtype)
    k = torch.randn(top, hkv * d, device="cuda", dtype=spec.dtype)
    v = torch.randn_like(k)
    graphs = {}
    name, keep = impl.register(*fp8_scales(spec), KINDS.DECODER)
    with state.graph_capture(top):
        for bs in sizes:
            md_bs = state.graph_capture_get_metadata_for_batch(bs)
            bufs = state.get_graph_input_buffers(md_bs)
            graph_state = state.graph_clone(bs)

            def step(bs=bs, md_bs=md_bs):
                with ca.set_forward_context(md_bs):
                    return impl.run(q[:bs], k[:bs], v[:bs], kv_cache, KINDS.DECODER, name)

            graph, out = captured(step)
            graphs[bs] = (graph, bufs, graph_state, out, keep)
    return graphs, q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("case, kernel", [(FEATURE_CASES[1], "flashinfer"), (FEATURE_CASES[0], "flashinfer"),
                                          (FEATURE_CASES[0], "cudnn"), (FEATURE_CASES[0], "triton"),
                                          (FEATURE_CASES[6], "triton")],
                         ids=["cuda_core", "tensor_core", "cudnn", "triton", "triton_fp8"])
def test_replayed_decode_equals_eager_for_100_steps(case, kernel, monkeypatch):
    """Graph replays (FlashInfer's graph wrappers, or cuDNN's / our Triton paged decode where they
    serve the spec) against the eager step (FlashInfer's wrappers) over the same cache."""
    if kernel == "cudnn":
        skip_unless_cudnn_decode()
    monkeypatch.setenv(fib.GRAPH_DECODE_ENV, kernel)
    spec = case_spec(case, num_blocks=1200, max_seq_len_to_capture=1024)
    if kernel == "triton" and (reason := fib.triton_decode_reason(spec, torch.cuda.get_device_capability())):
        pytest.skip(reason)
    impl = impl_for(spec)
    shape = FlashInferBackend.get_kv_cache_shape(spec.num_blocks, 16, spec.num_kv_heads, spec.head_size)
    kv_cache = torch.randn(shape, device="cuda", dtype=spec.dtype).to(spec.cache_dtype)
    state = FlashInferBackend.get_state_cls()(spec)
    assert state.decode_kernel == kernel
    graphs, q, k, v = capture(state, spec, impl, kv_cache, [8, 4])
    builder = FlashInferBackend.get_builder_cls()(spec)
    rng = random.Random(5)
    for step in range(100):
        bs = (8, 4)[step % 2]
        graph, bufs, graph_state, out, _ = graphs[bs]
        n = rng.randint(1, bs)
        seq_lens = [rng.randint(2, 1024) for _ in range(n)]
        blocks = (torch.randperm(spec.num_blocks - 1) + 1).tolist()  # block 0 is the pads' scratch block
        tables, at = [], 0
        for s in seq_lens:
            tables.append(blocks[at : at + (s + 15) // 16])
            at += len(tables[-1])
        md = builder.build(seq_lens, [1] * n, tables)
        q[:n].normal_()
        k[:n].normal_()
        v[:n].normal_()
        scratch = kv_cache[:, fib.SCRATCH_BLOCK].clone()
        graph_state.prepare_graph_input_buffers(bufs, md)
        graph_state.begin_forward(md)
        graph.replay()
        eager = impl.forward(q[:n], k[:n], v[:n], kv_cache, md, *fp8_scales(spec))
        torch.testing.assert_close(out[:n], eager, atol=2e-2, rtol=2e-2)
        assert torch.equal(kv_cache[:, fib.SCRATCH_BLOCK], scratch), "a pad row wrote into the cache"


@pytest.mark.gpu
def test_capturing_builder_metadata_raises_naming_the_state():
    spec = case_spec(FEATURE_CASES[0])
    md = FlashInferBackend.get_builder_cls()(spec).build([40, 9], [1, 1], [[1, 2, 3], [4]])
    name, _keep = layer_of(spec)
    args = op_args(spec, 2, "cuda", name)
    with ca.set_forward_context(md):
        torch.ops.compiled_attn.flashinfer_attention(**args)  # plans eagerly
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="graph_capture_get_metadata_for_batch"), torch.cuda.graph(graph):
            torch.ops.compiled_attn.flashinfer_attention(**args)


def largest_decode_graph(kernel: str, monkeypatch) -> tuple[ca.AttentionSpec, fib.FlashInferState, object]:
    """A FLASHINFER State on `kernel` and the all-pad metadata of its largest decode graph: the
    runner's top batch size (256) at 16K tokens, 32 q / 8 kv heads of 128."""
    monkeypatch.setenv(fib.GRAPH_DECODE_ENV, kernel)
    spec = ca.AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, num_blocks=8,
                            dtype=torch.bfloat16, device="cuda", max_seq_len_to_capture=16384)
    state = FlashInferBackend.get_state_cls()(spec)
    with state.graph_capture(256):
        md_bs = state.graph_capture_get_metadata_for_batch(256)
    return spec, state, md_bs


@pytest.mark.gpu
def test_workspace_covers_the_largest_decode_plan(record_property, monkeypatch):
    spec, state, _ = largest_decode_graph("flashinfer", monkeypatch)
    bs = 256
    pages = 16384 // 16
    indptr = torch.arange(bs + 1, dtype=torch.int32) * pages
    indices = torch.zeros(bs * pages, dtype=torch.int32, device="cuda")
    last = torch.full((bs,), 16, dtype=torch.int32)
    need, _ = state._slots[bs].wrapper.workspace_size(
        indptr, indices, last, 32, 8, 128, 16, **fib.plan_options(spec))
    record_property("graph_decode_float_workspace_bytes", need)
    assert need <= fib.WORKSPACE_BYTES


@pytest.mark.gpu
def test_cudnn_workspace_covers_the_largest_decode_graph(record_property, monkeypatch):
    skip_unless_cudnn_decode()
    spec, state, md_bs = largest_decode_graph("cudnn", monkeypatch)
    bs = 256
    name, _keep = layer_of(spec)
    with ca.set_forward_context(md_bs):  # all pads: one token of SCRATCH_BLOCK each
        torch.ops.compiled_attn.flashinfer_attention(**op_args(spec, bs, "cuda", name))
    prepared = state._slots[bs].wrapper._prepared  # one cuDNN graph per layout
    assert prepared, "the decode step built no cuDNN graph"
    need = max(p.graph.get_workspace_size() for p in prepared.values())
    record_property("cudnn_decode_workspace_bytes", need)
    assert need <= fib.WORKSPACE_BYTES


# ---------------------------------------------------------------------------------------------
# GPU: opcheck


@pytest.mark.gpu
def test_opcheck_flashinfer_attention():
    spec = case_spec(FEATURE_CASES[0])
    batch = make_batch(spec, [30, 50, 7], [30, 4, 1], seed=7)
    md = batch.build(FlashInferBackend)
    name, _keep = layer_of(spec)
    args = op_args(spec, md.num_tokens, "cuda", name)
    args["kv_cache"] = batch.kv_cache.nan_to_num()
    with ca.set_forward_context(md):
        torch.library.opcheck(torch.ops.compiled_attn.flashinfer_attention.default, (), args,
                              test_utils=OPCHECK_UTILS)


def prewarm(case) -> str:
    """Compile one case's kernels (run in parallel processes before the GPU tests)."""
    spec = case_spec(case)
    seq_lens, query_lens = random_lengths(0, 2, 2, max_len=64, max_chunk=16)
    run_and_compare(spec, seq_lens, query_lens)
    return case[0]


if __name__ == "__main__":
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(FEATURE_CASES), mp_context=ctx) as pool:
        for name in pool.map(prewarm, FEATURE_CASES):
            print("compiled", name)

