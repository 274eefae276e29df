"""XFORMERS backend: host-side builder / bias logic on CPU, kernels against the float64 reference on GPU."""

from __future__ import annotations

import dataclasses
import unittest.mock

import pytest
import torch
from hypothesis import given
from reference import make_batch, reference_forward, rel_err
from test_differential import CI_LIMITS, cases, check_against_reference, differential_settings

import compiled_attn as ca
from compiled_attn.backends.xformers import XFormersBackend, XFormersMetadata
from compiled_attn.forward_context import set_forward_context
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.metadata import CommonMetadataBuilder
from compiled_attn.ops import xformers as xformers_ops

T = ca.AttentionType
OPCHECK_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)


def make_spec(device: str = "cpu", **overrides) -> ca.AttentionSpec:
    opts = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=64, num_blocks=64,
                dtype=torch.bfloat16, device=device)
    opts.update(overrides)
    return ca.AttentionSpec(**opts)


def host_metadata(spec: ca.AttentionSpec, seq_lens, query_lens, tables, **kw) -> XFormersMetadata:
    """Common fields plus xFormers' gathers, without the bias objects (which need xformers)."""
    builder = XFormersBackend.get_builder_cls()(spec)
    return CommonMetadataBuilder.build(builder, seq_lens, query_lens, tables, **kw)


# ---------------------------------------------------------------- CPU: capabilities, host logic


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_unavailable_reason_on_cpu():
    assert XFormersBackend.unavailable_reason() is not None


def test_named_backend_on_cpu_says_why():
    if XFormersBackend.unavailable_reason() is None:
        pytest.skip("xformers runs here")
    with pytest.raises(RuntimeError, match="XFORMERS cannot run here"):
        ca.get_attn_backend("XFORMERS")


@pytest.mark.parametrize("block_size", [16, 32, 96])
def test_block_size_not_multiple_of_64_is_refused(block_size):
    assert not XFormersBackend.supports_block_size(block_size)
    with pytest.raises(NotImplementedError, match="multiples of 64"):
        XFormersBackend.get_builder_cls()(make_spec(block_size=block_size))


@pytest.mark.parametrize("block_size", [64, 128, 256])
def test_block_size_multiple_of_64_is_supported(block_size):
    assert XFormersBackend.supports_block_size(block_size)


def test_soft_cap_is_refused():
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        XFormersBackend.get_impl_cls()(8, 64, 0.125, num_kv_heads=2, logits_soft_cap=30.0)


def test_fp8_cache_is_refused():
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8'"):
        XFormersBackend.get_impl_cls()(8, 64, 0.125, num_kv_heads=2, kv_cache_dtype="fp8")


def test_head_size_outside_kernels_is_refused():
    with pytest.raises(NotImplementedError, match="head sizes"):
        XFormersBackend.get_impl_cls()(8, 80, 0.125, num_kv_heads=2)


def test_fresh_prefill_needs_no_gather():
    md = host_metadata(make_spec(), [100, 7], [100, 7], [[0, 1], [2]])
    assert md.prefill_fresh and md.prefill_kv_slots is None


def test_chunked_prefill_gathers_every_prefill_token_from_the_cache():
    md = host_metadata(make_spec(), [70, 3, 90], [6, 3, 1], [[5, 9], [2], [7, 8]])
    assert not md.prefill_fresh
    expect = list(range(5 * 64, 6 * 64)) + list(range(9 * 64, 9 * 64 + 6)) + list(range(2 * 64, 2 * 64 + 3))
    assert md.prefill_kv_slots.tolist() == expect


def test_decode_window_starts_clamp_at_zero():
    md = host_metadata(make_spec(sliding_window=50), [10, 40, 200], [10, 1, 1], [[0], [1], [2, 3, 4, 5]])
    assert md.decode_window_starts.tolist() == [0, 150, 0]  # + a trailing unused entry


def test_alibi_slots_cover_each_request_in_order():
    spec = make_spec(alibi_slopes=torch.ones(8))
    md = host_metadata(spec, [3, 2], [3, 1], [[4], [6]])
    assert md.alibi_kv_slots.tolist() == [256, 257, 258, 384, 385]


def test_alibi_slots_of_an_encoder_decoder_spec_serve_its_decoder_self_attention():
    """Such a spec's metadata also serves the decoder's self-attention layers, which may use ALiBi;
    its cross layers cannot (refused when made), so the encoder keys get no ALiBi slots."""
    spec = make_spec(attn_type=T.ENCODER_DECODER, alibi_slopes=torch.ones(8))
    md = host_metadata(spec, [3, 5], [3, 1], [[4], [6]], encoder_seq_lens=[2, 66], cross_block_tables=[[9], [1, 7]])
    assert md.alibi_kv_slots.tolist() == [256, 257, 258, *range(384, 389)]
    assert not hasattr(md, "alibi_cross_slots")


def test_alibi_op_refuses_cross_attention_rather_than_attending_as_self():
    """Layers refuse ALiBi on cross attention; the op refuses it too before any work, since its
    per-request loop would otherwise attend over the decoder's own keys."""
    from compiled_attn.ops.xformers import alibi_attention

    spec = make_spec(attn_type=T.ENCODER_DECODER, alibi_slopes=torch.ones(8))
    md = host_metadata(spec, [3, 5], [3, 1], [[4], [6]], encoder_seq_lens=[2, 66], cross_block_tables=[[9], [1, 7]])
    query = torch.randn(4, 8, 64)
    with pytest.raises(NotImplementedError, match=r"^ALiBi is not defined for ENCODER_DECODER \(cross\) attention$"):
        alibi_attention(md, query, None, None, torch.randn(2, 16, 64, 4, 64), torch.empty_like(query), 0.125, 0,
                        torch.ones(8), T.ENCODER_DECODER)


@pytest.mark.parametrize("options", [{"sliding_window": 50}, {"alibi_slopes": torch.linspace(0.1, 1.0, 8)}])
def test_a_step_with_prefills_uploads_its_gathers_in_the_one_copy(monkeypatch, options):
    """xFormers' own fields (decode rows, gathered-key starts and slots, window starts, ALiBi
    slots) reach the device in the step's one copy with the common fields: one `upload` call."""
    pytest.importorskip("xformers.ops.fmha")
    calls, real = [], ca.metadata.upload
    monkeypatch.setattr(ca.metadata, "upload", lambda arrays, dev: calls.append(list(arrays)) or real(arrays, dev))
    md = XFormersBackend.get_builder_cls()(make_spec(**options)).build([70, 3, 90], [6, 3, 1], [[5, 9], [2], [7, 8]])
    own = {"sliding_window": "decode_window_starts", "alibi_slopes": "alibi_kv_slots"}[next(iter(options))]
    assert len(calls) == 1 and {"decode_q_start", "prefill_k_start", "prefill_kv_slots", own} <= set(calls[0])
    assert md.decode_q_start.tolist() == [0, 1] and md.prefill_k_start.tolist() == [0, 70, 73]
    if "sliding_window" in options:
        assert md.decode_window_starts.tolist() == [40, 0]
    else:
        assert md.alibi_kv_slots.numel() == 70 + 3 + 90


def test_a_decode_only_step_reads_its_query_rows_from_query_start_loc():
    pytest.importorskip("xformers.ops.fmha")
    md = XFormersBackend.get_builder_cls()(make_spec()).build([9, 130], [1, 1], [[3], [4, 5, 6]])
    assert md.decode_q_start is md.query_start_loc and md.decode_q_start.tolist() == [0, 1, 2]


def test_fake_kernel_under_fake_mode_on_cuda():
    """On fake CUDA tensors the op runs its fake kernel (the real one would need CUDA here) and
    returns nothing, as its schema says (the output is written in place)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import compiled_attn.backends.xformers  # noqa: F401  (registers the op)

    with FakeTensorMode(allow_non_fake_inputs=False):
        q = torch.empty(5, 8, 64, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(5, 2, 64, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(2, 4, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        torch.ops.compiled_attn.xformers_attention(q, kv, kv, cache, out, "any.layer")  # the fake kernel: no error


# ---------------------------------------------------------------- CPU with xformers: bias objects


def _biases(spec, *args, **kw):
    pytest.importorskip("xformers.ops.fmha")
    return XFormersBackend.get_builder_cls()(spec).build(*args, **kw)


def test_fresh_prefill_bias_is_block_diagonal_causal():
    md = _biases(make_spec(), [5, 3], [5, 3], [[0], [1]])
    assert type(md.biases["prefill"]).__name__ == "BlockDiagonalCausalMask"
    mask = torch.isfinite(md.biases["prefill"].materialize((8, 8)))
    expect = torch.block_diag(torch.ones(5, 5).tril(), torch.ones(3, 3).tril()).bool()
    assert torch.equal(mask, expect)


def test_chunked_prefill_bias_is_bottom_right_causal_with_window():
    md = _biases(make_spec(sliding_window=3), [6], [2], [[0]])
    assert type(md.biases["prefill"]).__name__ == "BlockDiagonalCausalLocalAttentionFromBottomRightMask"
    mask = torch.isfinite(md.biases["prefill"].materialize((2, 6)))
    assert mask.int().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_decode_bias_is_paged_over_the_block_tables():
    md = _biases(make_spec(), [10, 130], [1, 1], [[3], [4, 5, 6]])
    bias = md.biases["decode"]
    assert type(bias).__name__ == "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask"
    assert bias.page_size == 64 and bias.k_seqinfo.seqlen.tolist() == [10, 130]
    assert bias.block_tables.tolist() == [[3, 0, 0], [4, 5, 6]]


def test_windowed_decode_bias_is_paged_gappy():
    md = _biases(make_spec(sliding_window=16), [10, 130], [1, 1], [[3], [4, 5, 6]])
    bias = md.biases["decode"]
    assert type(bias).__name__ == "PagedBlockDiagonalGappyKeysMask"
    assert bias.k_seqinfo.seqstart.tolist()[:2] == [0, 114] and bias.k_seqinfo.seqlen.tolist() == [10, 130]


def test_cross_biases_use_encoder_lengths():
    spec = make_spec(attn_type=T.ENCODER_DECODER)
    md = _biases(spec, [4, 9], [4, 1], [[0], [1]], encoder_seq_lens=[6, 70], cross_block_tables=[[2], [3, 4]])
    assert {"cross_decode", "cross_prefill", "encoder"} <= set(md.biases)
    assert type(md.biases["cross_decode"]).__name__ == "PagedBlockDiagonalPaddedKeysMask"
    assert md.biases["cross_decode"].k_seqinfo.seqlen.tolist() == [70]
    assert torch.isfinite(md.biases["cross_prefill"].materialize((4, 6))).all()


def test_metadata_rejects_a_layer_window_unlike_the_spec():
    md = _biases(make_spec(sliding_window=8), [5], [5], [[0]])
    with pytest.raises(ValueError, match="sliding_window"):
        md.check_options(0, False)


@pytest.mark.parametrize(("spec_alibi", "layer_alibi"), [(True, False), (False, True)])
def test_metadata_rejects_layer_alibi_unlike_the_spec(spec_alibi, layer_alibi):
    spec = make_spec(alibi_slopes=[2.0 ** -(i + 1) for i in range(8)] if spec_alibi else None)
    md = host_metadata(spec, [5], [5], [[0]])
    with pytest.raises(ValueError, match="the layer's alibi_slopes and the spec's must both be set or both be None"):
        md.check_options(0, layer_alibi)
    md.check_options(0, spec_alibi)  # the spec's own setting passes


def dense_bias(bias, mq: int, mk: int) -> torch.Tensor:
    """Any bias the op passes, as a dense float64 [.., Mq, Mk] additive mask. Paged biases
    address keys by cache slot: request i sees the slots of its positions [start, seqlen)."""
    if isinstance(bias, torch.Tensor):
        return bias.double()
    name = type(bias).__name__
    if not name.startswith("Paged"):
        return bias.materialize((mq, mk), dtype=torch.float64)
    tables, page = bias.block_tables.long(), bias.page_size
    n = tables.shape[0]
    ends = bias.k_seqinfo.seqlen.tolist()
    starts = bias.k_seqinfo.seqstart.tolist()[:n] if "Gappy" in name else [0] * n
    mask = torch.full((mq, mk), float("-inf"), dtype=torch.float64)
    for i in range(n):
        pos = torch.arange(starts[i], ends[i])
        mask[i, tables[i, pos // page] * page + pos % page] = 0
    return mask


def dense_float64_kernel(query, key, value, bias, scale, ops):
    """A stand-in for `run_xformers`: softmax(q k^T * scale + bias) v in float64, for the
    [1, M, G, Hpg, D] inputs the op passes. Gathered or fresh keys (a block-diagonal or tensor
    bias) all enter the math, as flash and cutlass load them (a NaN key or value there reaches the
    output through its -inf or zero weight). Over the paged cache (split-K's paged biases) each
    query row loads only the slots its bias lets through (masked loads): the others' scores are
    -inf whatever the key and their values 0 for that row, while a NaN slot the bias lets through
    still reaches the row's output (a pad row reading garbage leaves the real rows alone)."""
    assert query.dim() == 5, "the op calls run_xformers with grouped 5-D inputs"
    q, k, v = (x.double().movedim(1, -2) for x in (query, key, value))  # [1, G, Hpg, M, D]
    mask = dense_bias(bias, q.shape[-2], k.shape[-2])  # [.., Mq, Mk]
    scores = q @ k.transpose(-1, -2) * scale + mask
    if not type(bias).__name__.startswith("Paged"):
        return (torch.softmax(scores, dim=-1) @ v).movedim(-2, 1).to(query.dtype)
    allowed = mask > float("-inf")
    weights = torch.softmax(torch.where(allowed, scores, float("-inf")), dim=-1)
    finite = torch.isfinite(v)
    # per row: the finite values it reads, and NaN where it reads a non-finite one
    out = weights @ torch.where(finite, v, 0.0)
    poisoned = (allowed.double() @ (~finite).double()) > 0  # [.., Mq, D]
    return torch.where(poisoned, float("nan"), out).movedim(-2, 1).to(query.dtype)


@pytest.mark.parametrize("alibi", [False, True], ids=["window", "window+alibi"])
@pytest.mark.parametrize(("seq_lens", "query_lens"), [([200], [8]), ([200, 130], [8, 1]), ([130, 200], [1, 1])],
                         ids=["chunk", "mixed", "decodes"])
def test_rolled_blocks_are_never_gathered(seq_lens, query_lens, alibi):
    """A rolling table's freed entries read block 0 (NaN here, as a cache from torch.empty may
    hold), and no query's window reaches them: the prefill and ALiBi gathers start past them. They
    started at position 0, and a NaN key in block 0 reached the output through its -inf bias."""
    pytest.importorskip("xformers.ops.fmha")
    spec = make_spec(num_heads=4, num_kv_heads=2, head_size=64, block_size=64, num_blocks=16, dtype=torch.float32,
                     sliding_window=64, alibi_slopes=[2.0 ** -(i + 1) for i in range(4)] if alibi else None)
    batch = make_batch(spec, seq_lens, query_lens, seed=3, top_blocks=True)
    assert 0 not in [b for t in batch.block_tables for b in t]  # block 0: only rolled entries read it
    rolled = [(s - q - 64 + 1) // 64 for s, q in zip(seq_lens, query_lens, strict=True)]
    assert min(rolled) >= 1
    tables = [[-1] * r + t[r:] for r, t in zip(rolled, batch.block_tables, strict=True)]  # the server freed them
    md = XFormersBackend.get_builder_cls()(spec, rolling_tables=True).build(seq_lens, query_lens, tables)
    assert md.rolled_blocks.tolist() == rolled and torch.isnan(batch.kv_cache[:, 0]).all()
    impl = XFormersBackend.get_impl_cls()(4, 64, spec.softmax_scale, num_kv_heads=2, sliding_window=64,
                                         alibi_slopes=spec.alibi_slopes)
    with unittest.mock.patch.object(xformers_ops, "run_xformers", dense_float64_kernel):
        out = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, md)
    ref = reference_forward(batch, sliding_window=64, alibi=torch.tensor(spec.alibi_slopes) if alibi else None)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= 1e-5


@given(case=cases(XFormersBackend, "cuda", CI_LIMITS))
@differential_settings(CI_LIMITS)
def test_host_path_matches_reference_with_a_float64_kernel(case):
    """Everything of the op but xFormers' kernels, on CPU, for drawn cases of every attention type
    and option: biases (block-diagonal, paged, windowed, ALiBi), gathers, cache slots and where
    each output row goes."""
    pytest.importorskip("xformers.ops.fmha")
    with unittest.mock.patch.object(xformers_ops, "run_xformers", dense_float64_kernel):
        check_against_reference(dataclasses.replace(case, dtype="float32"), XFormersBackend, "cpu")


def test_graph_steps_keep_nan_in_block_0_out_of_every_row(monkeypatch):
    """Decode steps through a runner's padded static step (no CUDA graphs) on the XFORMERS State:
    pad rows and a rolling table's freed entries read block 0, here NaN; batches of 1 to 3
    requests padded to 2 or 4 rows, requests leaving and joining. Every real row equals eager's
    (on metadata of the step's own size), and the cache outside the step's slots is untouched."""
    pytest.importorskip("xformers.ops.fmha")
    monkeypatch.setattr(xformers_ops, "run_xformers", dense_float64_kernel)
    monkeypatch.setattr(XFormersBackend, "unavailable_reason", classmethod(lambda cls: None))
    monkeypatch.setattr(XFormersBackend, "supported_dtypes", (*XFormersBackend.supported_dtypes, torch.float32))
    monkeypatch.setattr(XFormersBackend, "requires_cuda", False)
    spec = make_spec(num_heads=4, num_kv_heads=2, head_size=64, block_size=64, num_blocks=32, dtype=torch.float32,
                     sliding_window=40, max_seq_len_to_capture=256)
    layer = ca.Attention(4, 64, spec.softmax_scale, num_kv_heads=2, sliding_window=40, backend="XFORMERS")
    g = torch.Generator().manual_seed(0)
    wq, wkv = torch.randn(64, 256, generator=g), torch.randn(64, 128, generator=g)
    embed = torch.randn(16, 64, generator=g)

    def model(ids, pos, caches):
        x = torch.nn.functional.embedding(ids, embed) * (1 + pos[:, None] / 32) * 0.1
        return layer(x @ wq, x @ wkv, x @ wkv, caches[0])

    caches = [torch.randn(XFormersBackend.get_kv_cache_shape(32, 64, 2, 64), generator=g)]
    caches[0][:, 0] = float("nan")
    eager_caches = [caches[0].clone()]
    runner = CUDAGraphRunner(model, XFormersBackend, spec, caches, capture_sizes=[2, 4], use_cuda_graphs=False,
                             progress=False)
    runner.capture()
    builder = XFormersBackend.get_builder_cls()(spec, rolling_tables=True)
    for seq_lens in ([100, 30, 5], [101, 31, 6], [102, 32], [103], [104, 2, 3], [105, 3, 4]):
        tables = [[1 + 5 * i + j for j in range(-(-s // 64))] for i, s in enumerate(seq_lens)]
        rolled = [max(s - 1 - 40 + 1, 0) // 64 for s in seq_lens]
        tables = [[-1] * r + t[r:] for r, t in zip(rolled, tables, strict=True)]
        md = builder.build(seq_lens, [1] * len(seq_lens), tables)
        ids = torch.randint(16, (len(seq_lens),), generator=g)
        pos = torch.tensor(seq_lens) - 1
        before = caches[0].clone()
        out = runner.run(md, ids, pos)
        with set_forward_context(md):
            want = model(ids, pos, eager_caches)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(caches[0], eager_caches[0], equal_nan=True, rtol=1e-4, atol=1e-5)
        unchanged = torch.ones(32 * 64, dtype=torch.bool)
        unchanged[md.slot_mapping] = False  # pad rows (slot -1) write nothing
        flat, flat_before = caches[0].view(2, 32 * 64, -1), before.view(2, 32 * 64, -1)
        torch.testing.assert_close(flat[:, unchanged], flat_before[:, unchanged], equal_nan=True, rtol=0, atol=0)
    assert runner.counts["graph"] == 6


def test_cross_decode_on_the_graph_state_matches_reference_with_a_float64_kernel():
    """The op on a cross graph's metadata after a step's refill (what a replay computes), on CPU,
    against the float64 reference. The State's metadata once lacked the cross slot mapping that
    the op's checks read."""
    pytest.importorskip("xformers.ops.fmha")
    spec = make_spec(attn_type=T.ENCODER_DECODER, dtype=torch.float32, num_blocks=32, max_seq_len_to_capture=256)
    batch = make_batch(spec, [9, 40], [1, 1], encoder_seq_lens=[100, 7], seed=4)
    bs, n = 4, 2
    impl = XFormersBackend.get_impl_cls()(spec.num_heads, spec.head_size, spec.softmax_scale,
                                         num_kv_heads=spec.num_kv_heads)
    state = XFormersBackend.get_state_cls()(spec)
    with state.graph_capture(bs):
        md_bs = state.graph_capture_get_metadata_for_batch(bs)
        bufs = state.get_graph_input_buffers(md_bs)
        clone = state.graph_clone(bs)
    md = batch.build(XFormersBackend)
    clone.prepare_graph_input_buffers(bufs, md)
    clone.begin_forward(md)
    query = torch.cat([batch.query, torch.randn(bs - n, *batch.query.shape[1:])])  # pad rows: anything
    with unittest.mock.patch.object(xformers_ops, "run_xformers", dense_float64_kernel):
        graphed = impl.forward(query, None, None, batch.kv_cache, md_bs, attn_type=T.ENCODER_DECODER)
    assert rel_err(graphed[:n], reference_forward(batch, T.ENCODER_DECODER)) <= 1e-5

# ---------------------------------------------------------------- GPU: against the float64 reference


def gpu_spec(**kw) -> ca.AttentionSpec:
    opts = dict(num_heads=8, num_kv_heads=2, head_size=128, block_size=64, num_blocks=256, device="cuda")
    opts.update(kw)
    return ca.AttentionSpec(**opts)


def capture_op_graph(spec, bs: int, run):
    """`run()` (an op call on the forward context's metadata) captured as a CUDA graph on an
    XFORMERS State's metadata of batch size `bs`, after a warm-up on a side stream: (the graph,
    its output, the State clone and input buffers a step is refilled through)."""
    state = XFormersBackend.get_state_cls()(spec)
    with state.graph_capture(bs):
        md_bs = state.graph_capture_get_metadata_for_batch(bs)
        bufs = state.get_graph_input_buffers(md_bs)
        graph_state = state.graph_clone(bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), set_forward_context(md_bs):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), set_forward_context(md_bs):
            out = run()
    return graph, out, graph_state, bufs


def run_impl(spec, batch, attn_type=T.DECODER, query=None, key=None, value=None, kv_cache=None):
    impl = XFormersBackend.get_impl_cls()(
        spec.num_heads, spec.head_size, spec.softmax_scale, num_kv_heads=spec.num_kv_heads,
        alibi_slopes=spec.alibi_slopes, sliding_window=spec.sliding_window,
    )
    md = batch.build(XFormersBackend)
    return impl.forward(query, key, value, kv_cache, md, attn_type=attn_type)


def check_decoder(spec, seq_lens, query_lens, tol=1e-2, **kw):
    batch = make_batch(spec, seq_lens, query_lens, seed=len(seq_lens), **kw)
    out = run_impl(spec, batch, T.DECODER, batch.query, batch.key, batch.value, batch.kv_cache)
    ref = reference_forward(batch, sliding_window=spec.sliding_window, alibi=spec.alibi_slopes)
    assert rel_err(out.cpu(), ref) <= tol


SHAPES = {
    "prefill": ([77, 130, 5], [77, 130, 5]),
    "chunked_prefill": ([300, 64, 9], [40, 64, 3]),
    "decode": ([1000, 65, 2, 513], [1, 1, 1, 1]),
    "mixed": ([200, 150, 700, 33], [200, 20, 1, 1]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoder_matches_reference(shape, dtype):
    check_decoder(gpu_spec(dtype=dtype), *SHAPES[shape])


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_head_layouts_match_reference(head_size, heads):
    check_decoder(gpu_spec(head_size=head_size, num_heads=heads[0], num_kv_heads=heads[1]), *SHAPES["mixed"])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_sliding_window_matches_reference(shape):
    check_decoder(gpu_spec(sliding_window=37), *SHAPES[shape])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_alibi_matches_reference(shape):
    from reference import alibi_slopes

    check_decoder(gpu_spec(alibi_slopes=alibi_slopes(8)), *SHAPES[shape])


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [128, 256])
def test_alibi_grouped_heads_with_a_partial_query_tile_match_reference(head_size):
    """3 query heads per KV head, prompts of 33 / 65 fresh tokens (a partial last query tile of
    the mem-efficient kernel): stride-0 K/V heads were wrong there (scripts/xf_alibi_probe.py)."""
    from reference import alibi_slopes

    spec = gpu_spec(num_heads=9, num_kv_heads=3, head_size=head_size, alibi_slopes=alibi_slopes(9))
    check_decoder(spec, [33, 65, 200, 7], [33, 65, 3, 1])


def test_cutlass_input_has_four_dims_and_a_copy_of_every_heads_kv():
    fmha = pytest.importorskip("xformers.ops.fmha")
    q = torch.randn(1, 5, 2, 3, 8)
    k, v = (xformers_ops.expanded(torch.randn(7, 2, 8), 3) for _ in range(2))  # head stride 0
    bias = torch.randn(1, 2, 3, 5, 8)[..., :7]
    safe = xformers_ops.cutlass_safe(fmha.Inputs(query=q, key=k, value=v, attn_bias=bias, p=0.0, scale=0.5))
    assert safe.query.shape == (1, 5, 6, 8) and torch.equal(safe.query, q.flatten(2, 3))
    for got, want in ((safe.key, k), (safe.value, v)):
        assert got.is_contiguous() and torch.equal(got, want.flatten(2, 3))
    assert safe.attn_bias.shape == (1, 6, 5, 7) and torch.equal(safe.attn_bias, bias.flatten(1, 2))
    assert safe.attn_bias.stride(-2) == 8  # the 8-aligned rows cutlass needs are kept
    assert safe.scale == 0.5


@pytest.mark.gpu
def test_block_size_128_matches_reference():
    check_decoder(gpu_spec(block_size=128), *SHAPES["mixed"])


@pytest.mark.gpu
def test_cache_over_2_pow_31_elements_per_half():
    # 32832 blocks * 64 * 8 * 128 > 2**31 elements in each of K and V; blocks drawn from the top
    spec = gpu_spec(num_heads=32, num_kv_heads=8, num_blocks=32832)
    check_decoder(spec, [900, 130, 70], [100, 1, 1], top_blocks=True)


@pytest.mark.gpu
def test_encoder_decoder_cross_attention_matches_reference():
    spec = gpu_spec(attn_type=T.ENCODER_DECODER)
    batch = make_batch(spec, [5, 30, 9], [5, 30, 1], encoder_seq_lens=[40, 7, 100], seed=3)
    key, value = batch.encoder_kv()
    out = run_impl(spec, batch, T.ENCODER_DECODER, batch.query, key.cuda(), value.cuda(), batch.kv_cache)
    ref = reference_forward(batch, T.ENCODER_DECODER)
    assert rel_err(out.cpu(), ref) <= 1e-2


@pytest.mark.gpu
def test_cross_attention_decode_reads_the_cache():
    spec = gpu_spec(attn_type=T.ENCODER_DECODER)
    batch = make_batch(spec, [9, 40], [1, 1], encoder_seq_lens=[100, 7], seed=4)
    out = run_impl(spec, batch, T.ENCODER_DECODER, batch.query, None, None, batch.kv_cache)
    assert rel_err(out.cpu(), reference_forward(batch, T.ENCODER_DECODER)) <= 1e-2


@pytest.mark.gpu
def test_cross_decode_graph_replays_match_reference():
    """A captured cross-decode graph replayed over steps of other batch sizes, self and encoder
    lengths, against the float64 reference: the README's cross graphs, whose capture once raised
    in the op's checks (the State's metadata lacked the cross slot mapping)."""
    spec = gpu_spec(attn_type=T.ENCODER_DECODER, max_seq_len_to_capture=512)
    bs, hq, d = 4, spec.num_heads, spec.head_size
    impl = XFormersBackend.get_impl_cls()(hq, d, spec.softmax_scale, num_kv_heads=spec.num_kv_heads)
    layer_name, _call = impl.register(1.0, 1.0, T.ENCODER_DECODER)  # _call keeps the name alive
    steps = [make_batch(spec, [9, 40], [1, 1], encoder_seq_lens=[100, 7], seed=4),
             make_batch(spec, [300, 2, 65, 17], [1, 1, 1, 1], encoder_seq_lens=[1, 250, 64, 33], seed=5),
             make_batch(spec, [129], [1], encoder_seq_lens=[400], seed=6)]
    kv_cache = steps[0].kv_cache.clone()
    query = torch.randn(bs, hq * d, dtype=spec.dtype, device="cuda")
    graph, out, graph_state, bufs = capture_op_graph(
        spec, bs, lambda: impl.run(query, None, None, kv_cache, T.ENCODER_DECODER, layer_name))
    for i, batch in enumerate(steps):
        n = len(batch.seq_lens)
        md = batch.build(XFormersBackend)
        kv_cache.copy_(batch.kv_cache)
        query[:n].copy_(batch.query.view(n, -1))
        graph_state.prepare_graph_input_buffers(bufs, md)
        graph_state.begin_forward(md)
        graph.replay()
        assert rel_err(out[:n].cpu(), reference_forward(batch, T.ENCODER_DECODER)) <= 1e-2, f"step {i}"


@pytest.mark.gpu
def test_encoder_matches_reference():
    spec = gpu_spec(attn_type=T.ENCODER)
    batch = make_batch(spec, [3, 4], [3, 4], encoder_seq_lens=[50, 129], seed=5)
    k = torch.cat(batch.enc_k).flatten(1).cuda()
    v = torch.cat(batch.enc_v).flatten(1).cuda()
    out = run_impl(spec, batch, T.ENCODER, batch.encoder_query(), k, v, None)
    assert rel_err(out.cpu(), reference_forward(batch, T.ENCODER)) <= 1e-2


@pytest.mark.gpu
def test_encoder_only_matches_reference():
    spec = gpu_spec(attn_type=T.ENCODER_ONLY)
    batch = make_batch(spec, [50, 129, 1], [50, 129, 1], seed=6)
    out = run_impl(spec, batch, T.ENCODER_ONLY, batch.query, batch.key, batch.value, None)
    assert rel_err(out.cpu(), reference_forward(batch, T.ENCODER_ONLY)) <= 1e-2


@pytest.mark.gpu
def test_opcheck_on_device():
    spec = gpu_spec()
    batch = make_batch(spec, *SHAPES["mixed"], seed=7)
    md = batch.build(XFormersBackend)
    q = batch.query.view(-1, 8, 128)
    k, v = batch.key.view(-1, 2, 128), batch.value.view(-1, 2, 128)
    impl = XFormersBackend.get_impl_cls()(8, 128, spec.softmax_scale, num_kv_heads=2)
    layer_name, _call = impl.register(1.0, 1.0, T.DECODER)  # _call keeps the name alive
    args = (q, k, v, batch.kv_cache.nan_to_num(0.0), torch.empty_like(q), layer_name)
    with set_forward_context(md):
        torch.library.opcheck(torch.ops.compiled_attn.xformers_attention.default, args, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.long(45)
def test_graph_replays_with_changing_lengths_equal_eager():
    spec = gpu_spec(num_blocks=512, max_seq_len_to_capture=1024)
    backend, bs, hq, hkv, d = XFormersBackend, 8, 8, 2, 128
    impl = backend.get_impl_cls()(hq, d, spec.softmax_scale, num_kv_heads=hkv)
    layer_name, _call = impl.register(1.0, 1.0, T.DECODER)  # _call keeps the name alive
    kv_cache = torch.randn(2, spec.num_blocks, 64, hkv, d, dtype=spec.dtype, device="cuda")
    widths = {"q": hq * d, "k": hkv * d, "v": hkv * d}
    static = {n: torch.randn(bs, w, dtype=spec.dtype, device="cuda") for n, w in widths.items()}
    graph, out, graph_state, bufs = capture_op_graph(
        spec, bs, lambda: impl.run(static["q"], static["k"], static["v"], kv_cache, T.DECODER, layer_name))
    builder = backend.get_builder_cls()(spec)
    g = torch.Generator().manual_seed(0)
    for step in range(100):
        n = int(torch.randint(1, bs + 1, (1,), generator=g))
        seq_lens = torch.randint(2, 1025, (n,), generator=g).tolist()
        blocks = torch.randperm(spec.num_blocks, generator=g)[: n * 16].view(n, 16).tolist()
        md = builder.build(seq_lens, [1] * n, [row[: -(-s // 64)] for row, s in zip(blocks, seq_lens, strict=True)])
        for t in static.values():
            t.normal_()
        graph_state.prepare_graph_input_buffers(bufs, md)
        graph_state.begin_forward(md)
        graph.replay()
        eager = impl.forward(static["q"][:n], static["k"][:n], static["v"][:n], kv_cache, md)
        torch.testing.assert_close(out[:n], eager, rtol=2e-2, atol=2e-2, msg=f"step {step}")
