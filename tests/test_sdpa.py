"""TORCH_SDPA forward against the float64 reference, on CPU (fp32) and CUDA (bf16).

Cases are chosen pairwise rather than as a full product: every batch shape, attention type and
option appears at least once, and block sizes 1/16/32, head sizes 64/128 and GQA 8:1 / MQA are
spread over them. Every cache comes from `make_batch`, so slots outside a request hold NaN.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from reference import alibi_slopes, captured, flex_on_cpu, make_batch, reference_attention, reference_forward, rel_err

import compiled_attn as ca
from compiled_attn.backends import torch_sdpa as sdpa
from compiled_attn.ops import flex_decode
from compiled_attn.ops import torch_sdpa as sdpa_ops

T = ca.AttentionType
BACKEND = ca.get_attn_backend("TORCH_SDPA")


@dataclasses.dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    attn_type: T = T.DECODER
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    encoder_seq_lens: tuple[int, ...] | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi: bool = False
    cross_kv: bool = True  # ENCODER_DECODER: key/value hold the prefills' encoder tokens (else None)


# seq_len > query_len on a prefill is a chunked prefill / prefix hit; query_len 1, seq_len > 1 a decode.
CASES = {
    "prefill_only": Case((17, 5, 1), (17, 5, 1), head_size=128, block_size=32),
    "decode_only": Case((33, 7, 64, 2), (1, 1, 1, 1), block_size=1),
    "mixed": Case((40, 9, 33, 17), (12, 9, 1, 1)),
    "prefix_hit": Case((50, 21), (3, 21), head_size=128, block_size=16),
    "gqa_8_1": Case((40, 9, 33), (12, 9, 1), num_heads=16, num_kv_heads=2, block_size=32),
    "mqa": Case((26, 19, 5), (26, 1, 1), num_heads=8, num_kv_heads=1, head_size=128, block_size=1),
    "alibi": Case((40, 9, 33, 17), (12, 9, 1, 1), alibi=True, block_size=32),
    "sliding_window": Case((40, 9, 33, 17), (12, 9, 1, 1), sliding_window=5, block_size=1),
    "soft_cap": Case((40, 9, 33), (12, 9, 1), logits_soft_cap=2.0, head_size=128),
    "soft_cap_alibi_window_mqa": Case(
        (30, 4, 25), (30, 4, 1), num_kv_heads=1, logits_soft_cap=2.0, alibi=True, sliding_window=7,
        block_size=16,
    ),
    "encoder_only": Case((17, 5, 1), (17, 5, 1), attn_type=T.ENCODER_ONLY, head_size=128),
    "encoder_only_alibi": Case((12, 30), (12, 30), attn_type=T.ENCODER_ONLY, num_kv_heads=1, alibi=True),
    "encoder": Case((4, 9), (4, 9), attn_type=T.ENCODER, encoder_seq_lens=(13, 6), block_size=32),
    "cross_encoder_step": Case(
        (5, 1, 9), (5, 1, 1), attn_type=T.ENCODER_DECODER, encoder_seq_lens=(13, 6, 20), block_size=16,
    ),
    "cross_later_step": Case(
        (6, 12), (1, 1), attn_type=T.ENCODER_DECODER, encoder_seq_lens=(13, 40), block_size=1,
        head_size=128, cross_kv=False,
    ),
    "cross_gqa_8_1": Case(
        (7, 3), (7, 1), attn_type=T.ENCODER_DECODER, encoder_seq_lens=(9, 33), num_heads=16,
        num_kv_heads=2, block_size=32,
    ),
}


def make_spec(case: Case, dtype: torch.dtype, device: str) -> ca.AttentionSpec:
    return ca.AttentionSpec(
        num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_size=case.head_size,
        block_size=case.block_size, num_blocks=128, dtype=dtype, device=device,
        sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap,
        alibi_slopes=alibi_slopes(case.num_heads) if case.alibi else None, attn_type=case.attn_type,
    )


def run_case(case: Case, dtype: torch.dtype, device: str, *, seed: int = 0, fill: float | str = float("nan")):
    """(TORCH_SDPA output, the batch) for one case; fill="random" puts large random values in the
    unused cache slots instead of NaN."""
    spec = make_spec(case, dtype, device)
    enc = list(case.encoder_seq_lens) if case.encoder_seq_lens else None
    batch = make_batch(spec, list(case.seq_lens), list(case.query_lens), seed=seed, encoder_seq_lens=enc)
    if fill == "random":
        cache = batch.kv_cache
        noise = 100 * torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed + 1)).to(cache)
        cache.copy_(torch.where(cache.isnan(), noise, cache))
    impl = BACKEND.get_impl_cls()(
        case.num_heads, case.head_size, spec.softmax_scale, case.num_kv_heads,
        alibi_slopes=spec.alibi_slopes, sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap,
    )
    md = batch.build(BACKEND)
    query, key, value, cache = batch.query, batch.key, batch.value, batch.kv_cache
    if case.attn_type == T.ENCODER:
        query = batch.encoder_query()
        key = torch.cat(batch.enc_k).flatten(1).to(device)
        value = torch.cat(batch.enc_v).flatten(1).to(device)
        cache = None
    elif case.attn_type == T.ENCODER_ONLY:
        cache = None
    elif case.attn_type == T.ENCODER_DECODER:
        key, value = (x.to(device) for x in batch.encoder_kv()) if case.cross_kv else (None, None)
    out = impl.forward(query, key, value, cache, md, attn_type=case.attn_type)
    return out, batch


def reference(case: Case, batch) -> torch.Tensor:
    return reference_forward(
        batch, case.attn_type, sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap,
        alibi=batch.spec.alibi_slopes,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_fp32_cpu(name):
    case = CASES[name]
    out, batch = run_case(case, torch.float32, "cpu")
    rows = sum(case.encoder_seq_lens) if case.attn_type == T.ENCODER else sum(case.query_lens)
    assert out.shape == (rows, case.num_heads * case.head_size)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(case, batch)) <= 1e-5


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_every_block_size(block_size):
    case = dataclasses.replace(CASES["mixed"], block_size=block_size)
    out, batch = run_case(case, torch.float32, "cpu", seed=block_size)
    assert rel_err(out, reference(case, batch)) <= 1e-5


@pytest.mark.parametrize("name", ["mixed", "soft_cap_alibi_window_mqa", "cross_encoder_step", "cross_later_step"])
def test_garbage_outside_requests_changes_nothing(name):
    # Same seed, so the same requests; only the unused cache slots differ (NaN vs random values).
    case = CASES[name]
    out_nan, _ = run_case(case, torch.float32, "cpu", seed=3, fill=float("nan"))
    out_rand, _ = run_case(case, torch.float32, "cpu", seed=3, fill="random")
    assert torch.isfinite(out_nan).all()
    assert torch.equal(out_nan, out_rand)


def test_forward_writes_new_keys_then_cache_serves_next_decode():
    # Step 1: a prefill writes its K/V; step 2: a decode of the same request reads them back.
    case = Case((9,), (9,), block_size=4)
    spec = make_spec(case, torch.float32, "cpu")
    batch = make_batch(spec, [10], [10], seed=5)
    impl = BACKEND.get_impl_cls()(8, 64, spec.softmax_scale, 2)
    builder = BACKEND.get_builder_cls()(spec)
    table = batch.block_tables
    impl.forward(batch.query[:9], batch.key[:9], batch.value[:9], batch.kv_cache, builder.build([9], [9], table))
    out = impl.forward(batch.query[9:], batch.key[9:], batch.value[9:], batch.kv_cache,
                       builder.build([10], [1], table))
    batch.seq_lens, batch.query_lens, batch.query = [10], [1], batch.query[9:]
    assert rel_err(out, reference_forward(batch)) <= 1e-5


GPU_CASES = ["mixed", "decode_only", "alibi", "soft_cap", "sliding_window", "encoder_only", "cross_encoder_step",
             "cross_later_step"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_matches_reference_bf16_cuda(name):
    case = CASES[name]
    out, batch = run_case(case, torch.bfloat16, "cuda")
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(case, batch)) <= 1e-2


def test_layers_of_one_forward_share_key_slots_per_window():
    # The key slots are made once per forward by the first layer of each window and reused by
    # the others; a layer with another window must not read the first one's (its valid keys differ).
    case = dataclasses.replace(CASES["mixed"], block_size=4)
    spec = make_spec(case, torch.float32, "cpu")
    batch = make_batch(spec, list(case.seq_lens), list(case.query_lens), seed=11)
    md = batch.build(BACKEND)
    windows = [None, 5, None, 5]
    outs = []
    with ca.set_forward_context(md) as context:
        for window in windows:
            impl = BACKEND.get_impl_cls()(case.num_heads, case.head_size, spec.softmax_scale, case.num_kv_heads,
                                          sliding_window=window)
            name, _record = impl.register(1.0, 1.0, T.DECODER)
            outs.append(impl.run(batch.query, batch.key, batch.value, batch.kv_cache, T.DECODER, name))
        made = sorted((k[2] if isinstance(k[2], str) else k[2][0], k[4]) for k in context._derived
                      if k[0] == "torch_sdpa")
    # per window: the prefills' and decodes' slots, and the decodes' additive mask
    assert made == [("decode", 0), ("decode", 5), ("decode bias", 0), ("decode bias", 5),
                    ("prefill", 0), ("prefill", 5)]
    for window, out in zip(windows, outs, strict=True):
        assert rel_err(out, reference_forward(batch, sliding_window=window)) <= 1e-5
    assert not torch.equal(outs[0], outs[1])  # the window changes the output of these lengths


# ---------------------------------------------------------------------------------------------
# Graph decode through FlexAttention (COMPILED_ATTN_SDPA_GRAPH_DECODE: auto by default, flex, gather)


def flex_spec(**kw) -> ca.AttentionSpec:
    base = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, num_blocks=48, dtype=torch.float32,
                device="cpu", max_seq_len_to_capture=128)
    return ca.AttentionSpec(**{**base, **kw})


@pytest.mark.parametrize("over, reason", [(dict(sliding_window=32), "window"), (dict(logits_soft_cap=5.0), "soft-cap"),
                                          (dict(alibi_slopes=alibi_slopes(8)), "ALiBi"),
                                          (dict(num_heads=6, num_kv_heads=2), "power-of-two"),
                                          (dict(block_size=8), "power of two >= 16"),
                                          (dict(block_size=48), "power of two >= 16")])
def test_flex_graph_decode_is_the_default_where_it_serves_and_refused_where_it_cannot(over, reason, monkeypatch):
    state_cls = ca.get_attn_backend("TORCH_SDPA").get_state_cls()
    monkeypatch.delenv(sdpa.GRAPH_DECODE_ENV, raising=False)
    cpu = state_cls(flex_spec())  # "auto" on CPU, where flex does not run: gather, eager's kernel
    assert cpu.decode_kernel == "gather" and cpu.decodes_on_eager_kernel
    monkeypatch.setenv(sdpa.GRAPH_DECODE_ENV, "flex")
    with pytest.raises(NotImplementedError, match="runs on cuda only"):
        state_cls(flex_spec())
    monkeypatch.setattr(sdpa, "FLEX_DEVICES", ("cuda", "cpu"))  # States only: nothing runs
    monkeypatch.delenv(sdpa.GRAPH_DECODE_ENV)
    default = state_cls(flex_spec(max_seq_len_to_capture=1024))  # "auto": flex where it serves
    assert default.decode_kernel == "flex" and default.graph_table_widths() == (default.max_blocks_per_seq,)
    assert not default.decodes_on_eager_kernel
    refused = state_cls(flex_spec(**over))
    assert refused.decode_kernel == "gather" and refused.decodes_on_eager_kernel
    monkeypatch.setenv(sdpa.GRAPH_DECODE_ENV, "auto")  # the default, named
    assert state_cls(flex_spec()).decode_kernel == "flex" and state_cls(flex_spec(**over)).decode_kernel == "gather"
    monkeypatch.setenv(sdpa.GRAPH_DECODE_ENV, "gather")
    gather = state_cls(flex_spec(max_seq_len_to_capture=1024))
    assert gather.decode_kernel == "gather" and gather.graph_table_widths() == (64, 32, 16)
    monkeypatch.setenv(sdpa.GRAPH_DECODE_ENV, "flex")
    assert state_cls(flex_spec(max_seq_len_to_capture=1024)).decode_kernel == "flex"
    with pytest.raises(NotImplementedError, match=f"{sdpa.GRAPH_DECODE_ENV}=flex: .*{reason}"):
        state_cls(flex_spec(**over))
    monkeypatch.setenv(sdpa.GRAPH_DECODE_ENV, "flash")
    with pytest.raises(ValueError, match="gather, flex or auto"):
        state_cls(flex_spec())


def test_split_kv_follows_the_measured_splits(monkeypatch):
    """H100's 132 SMs, 8 KV heads: flex's own split at B=1 (32) and B=256 (1); 8 splits at B=8
    and 2 at B=64, the sweep's best (`scripts/flex_paged_probe.py`)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    got = {batch: flex_decode.split_kv(batch, 8, torch.device("cuda")) for batch in (1, 4, 8, 16, 64, 128, 256)}
    assert got == {1: None, 4: None, 8: 8, 16: 8, 64: 2, 128: None, 256: None}


FLEX_CASES = [  # device, dtype, tolerance, spec options
    ("cpu", torch.float32, 1e-5, {}),
    pytest.param("cuda", torch.bfloat16, 1e-2, {}, marks=pytest.mark.gpu),  # FlexAttention's Triton decode kernel
    pytest.param("cuda", torch.bfloat16, 1e-2, dict(num_heads=32, num_kv_heads=4, head_size=128, block_size=32),
                 marks=pytest.mark.gpu),  # group 8, the 8B model's head size, pages of 32
]


@pytest.mark.parametrize("device, dtype, tol, over", FLEX_CASES)
def test_flex_graph_decode_reads_the_pages_in_place(device, dtype, tol, over, monkeypatch):
    """A State on flex: its graph metadata sends the op's decodes through FlexAttention over the
    refilled lengths and tables (pads: one token of block 0); the live rows match the float64
    reference over the cache, for two steps of other lengths through one graph, eagerly and in a
    replayed CUDA graph, with NaN in every slot no request has written (the rest of each last
    page, later pages, block 0 past its first token). CPU: flex through `reference.sparse_flex`.
    A layer with a window of its own gathers instead, at the same width."""
    monkeypatch.setenv(sdpa.GRAPH_DECODE_ENV, "flex")
    monkeypatch.setattr(sdpa, "FLEX_DEVICES", ("cuda", "cpu"))
    if device == "cpu":
        flex_on_cpu(monkeypatch)
    calls = []
    flex_call = sdpa_ops.paged_decode
    monkeypatch.setattr(sdpa_ops, "paged_decode", lambda *a: calls.append(a[0].shape) or flex_call(*a))
    backend = ca.get_attn_backend("TORCH_SDPA")
    spec = flex_spec(device=device, dtype=dtype, **over)
    hq, hkv, d, bs = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size
    state = backend.get_state_cls()(spec)
    with state.graph_capture(4):
        md_bs = state.graph_capture_get_metadata_for_batch(4)
        bufs = state.get_graph_input_buffers(md_bs)
        graph_state = state.graph_clone(4)
    assert md_bs.flex_decode
    layers = {window: backend.get_impl_cls()(hq, d, spec.softmax_scale, num_kv_heads=hkv, sliding_window=window)
              .register(1.0, 1.0, ca.AttentionType.DECODER) for window in (None, 20)}
    builder = backend.get_builder_cls()(spec)
    torch.manual_seed(0)
    cache = torch.randn(backend.get_kv_cache_shape(spec.num_blocks, bs, hkv, d), device=device).to(dtype)
    query = torch.empty(4, hq, d, device=device, dtype=dtype)
    outs = {window: torch.empty_like(query) for window in layers}

    def step() -> None:
        with ca.set_forward_context(md_bs):
            for window, (name, _keep) in layers.items():
                backend.attention_op(query, None, None, cache, outs[window], name)

    graph = None
    lens = [17, 3, 100] if bs == 16 else [40, 3, 128]
    for seq_lens in (lens, [33, 16]):
        n = len(seq_lens)
        tables = (torch.randperm(spec.num_blocks - 1)[: n * spec.max_seq_len_to_capture // bs] + 1).view(n, -1)
        cache.normal_()
        cache[:, 0, 1:] = float("nan")
        slots = cache.view(2, -1, hkv, d)  # [2, num_blocks * bs, ...]
        for s, table in zip(seq_lens, tables, strict=True):
            slots[:, (table[:, None] * bs + torch.arange(bs)).flatten()[s:].to(device)] = float("nan")
        tables = tables.tolist()
        md = builder.build(seq_lens, [1] * n, tables)
        graph_state.prepare_graph_input_buffers(bufs, md)
        graph_state.begin_forward(md)
        query.normal_()
        for out in outs.values():
            out.fill_(float("nan"))
        if device == "cpu":
            step()
        elif graph is None:  # warm up (compile), capture, replay
            graph, _ = captured(step)
            graph.replay()
        else:
            graph.replay()
        for window, out in outs.items():
            for i, (s, table) in enumerate(zip(seq_lens, tables, strict=True)):
                keys, values = (c[table].flatten(0, 1)[:s] for c in cache.cpu())
                ref = reference_attention(query[i : i + 1].cpu(), keys, values, torch.tensor([s - 1]), causal=True,
                                          scale=spec.softmax_scale, sliding_window=window)
                assert rel_err(out[i : i + 1].cpu(), ref) <= tol, (window, i)
            assert torch.isfinite(out[n:]).all()  # pad rows: one key of block 0
    # the window-less layer's rows through FlexAttention, the windowed layer's gathered
    # (CPU: one call a step; CUDA: the warm-up's and the capture's, replays run no Python)
    assert calls == [(4, hq, d)] * 2


def test_rolling_tables_serve_layers_within_the_spec_window_and_refuse_the_others():
    """Rolling tables hold only the blocks the spec's window sees (block 0, here NaN, in place of
    the rest). A layer of that window or a narrower one matches a float64 reference; a layer
    seeing further back (a wider window, or none) is refused before it reads a freed block,
    also when it first passed on metadata of the same spec built without rolling."""
    heads, d, bs, window = 2, 8, 4, 4
    spec = ca.AttentionSpec(num_heads=heads, num_kv_heads=heads, head_size=d, block_size=bs, num_blocks=16,
                            dtype=torch.float32, device="cpu", sliding_window=window)
    seq = 20  # a decode at position 19: the window sees 16..19, blocks of 0..15 are rolled
    md = sdpa.TorchSDPABackend.get_builder_cls()(spec, rolling_tables=True).build([seq], [1], [[-1] * 4 + [5]])
    assert md.rolled_blocks.tolist() == [4]
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(seq, heads, d, generator=g), torch.randn(seq, heads, d, generator=g)
    q = torch.randn(1, heads, d, generator=g)
    cache = torch.full((2, 16, bs, heads, d), float("nan"))
    cache[:, 5, : (seq - 1) % bs] = torch.stack([k[16 : seq - 1], v[16 : seq - 1]])
    for layer_window in (4, 2):
        layer = ca.Attention(heads, d, d**-0.5, sliding_window=layer_window, backend="TORCH_SDPA")
        with ca.set_forward_context(md):
            out = layer(q.flatten(1), k[-1:].flatten(1), v[-1:].flatten(1), cache.clone())
        want = reference_attention(q, k, v, torch.tensor([seq - 1]), causal=True, scale=d**-0.5,
                                   sliding_window=layer_window)
        assert rel_err(out.view(1, heads, d), want) < 1e-5, layer_window
    for layer_window in (8, None):
        layer = ca.Attention(heads, d, d**-0.5, sliding_window=layer_window, backend="TORCH_SDPA")
        full = sdpa.TorchSDPABackend.get_builder_cls()(spec).build([seq], [1], [[1, 2, 3, 4, 5]])
        with ca.set_forward_context(full):  # the same spec without rolling: served
            layer(q.flatten(1), k[-1:].flatten(1), v[-1:].flatten(1), torch.zeros_like(cache))
        with ca.set_forward_context(md), pytest.raises(ValueError, match="rolling tables have freed"):
            layer(q.flatten(1), k[-1:].flatten(1), v[-1:].flatten(1), cache.clone())
